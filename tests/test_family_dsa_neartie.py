"""DeepSeek sparse attention at a near-tie (issue 27): on a fixture where mlx-lm's
one-token and many-token paths select different keys (two indexer scores nearly tie at the
top-k boundary of layer 1), verify rows select as plain one-token decoding does: the
verify row is bit-equal to plain decoding, a many-token pass is not, and greedy output
equals mlx-lm's plain decoding at K = 0..3."""

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step as mlx_lm_generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model

from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.testing.dsa_neartie import INDEX_TOPK, make_near_tie_dsa, mlx_lm_selections

FAMILIES = ["deepseek_v32", "glm_moe_dsa"]


@pytest.fixture(scope="module")
def tie(tmp_path_factory):
    made = {}

    def make(family):
        if family not in made:
            made[family] = make_near_tie_dsa(tmp_path_factory.mktemp(family), family)
        return made[family]

    return make


def first_token(ref, prompt):
    return int(ref(mx.array([prompt]))[0, -1].argmax())


@pytest.mark.parametrize("family", FAMILIES)
def test_mlx_lm_paths_select_differently_on_the_fixture(tie, family):
    """The fixture's point, checked on the checkpoint as mlx-lm itself loads it."""
    path, prompt, _ = tie(family)
    ref = mlx_lm_load_model(Path(path))[0]
    assert len(prompt) + 1 > INDEX_TOPK  # sparse attention is active
    one, many, _, _ = mlx_lm_selections(ref, prompt, first_token(ref, prompt))
    assert len(one) == INDEX_TOPK and one != many


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_row_is_plain_decoding_not_the_many_token_path(tie, family):
    path, prompt, _ = tie(family)
    model = load_model(path)[0]
    first = first_token(mlx_lm_load_model(Path(path))[0], prompt)

    def row0(tokens, capture):
        cache = model.make_cache()
        model.trunk(mx.array([prompt]), cache)
        return model.logits(model.trunk(mx.array([tokens]), cache, capture=capture)[0])[:, 0]

    plain = row0([first], False)
    verify = row0([first, 5, 9, 2], True)
    assert mx.array_equal(verify, plain)
    many = row0([first, 5, 9, 2], False)  # mlx-lm's many-token path: other keys in layer 1
    assert float(mx.abs(many - plain).max()) > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identical_to_mlx_lm(tie, family):
    path, prompt, _ = tie(family)
    ref = mlx_lm_load_model(Path(path))[0]
    want = [int(t) for t, _ in mlx_lm_generate_step(mx.array(prompt), ref, max_tokens=12)]
    model = load_model(path)[0]
    for k in (0, 1, 2, 3):
        dec = MTPDecoder(model, k, adaptive=False)
        got = [t for t, _, _ in generate_step(prompt, model, decoder=dec, max_tokens=12)]
        assert got == want, f"K={k}"
