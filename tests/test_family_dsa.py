"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): a tiny index_topk so short contexts
cross it; verify rows select keys as plain one-token decoding does, both caches of every
attention layer roll back; greedy output equals mlx-lm's plain decoding."""

import mlx.core as mx
import numpy as np
import pytest

import family_checks as fc
from family_checks import HEADS, mlx_lm_model, raw_tensors, rms
from mlx_mtp.models.cache.kv import KVCache
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.testing.tiny_special import make_tiny_dsa

FAMILIES = ["deepseek_v32", "glm_moe_dsa"]
RNG = np.random.default_rng(11)
PROMPT = [int(x) for x in RNG.integers(0, 128, 14)]  # index_topk is 6
PROMPTS = [[int(x) for x in RNG.integers(0, 128, n)] for n in (5, 12, 1, 9)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # mlx_lm_model loads them strictly: its sanitize drops the MTP layer.
    return fc.checkpoints(tmp_path_factory, make_tiny_dsa)


@pytest.mark.parametrize("family", FAMILIES)
def test_trunk_logits_equal_mlx_lm_past_index_topk(ckpt, family):
    path = ckpt(family)
    ours, theirs = fc.assert_trunk_follows_mlx_lm(load_model(path)[0], mlx_lm_model(path),
                                                  [PROMPT[:4], [4], PROMPT[4:], [77], [2]])
    assert len(ours) == 2 * len(theirs)  # latents and indexer keys, per layer


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_rows_follow_plain_decoding_and_both_caches_roll_back(ckpt, family):
    """Rows past index_topk: each selects its own top-k as one-token decoding does."""
    model = load_model(ckpt(family, "noisy"))[0]
    rows = [4, 77, 2, 9]
    want = fc.one_by_one_logits(model, PROMPT, rows)
    got, spec = fc.verify_logits(model, PROMPT, rows)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-6, atol=1e-4)
    assert mx.array_equal(got.argmax(-1), want.argmax(-1))
    for c in spec:
        c.accept([2])
    assert [c.offset for c in spec] == [len(PROMPT) + 2] * len(spec)
    again = model.logits(model.trunk(mx.array([[2]]), spec)[0])
    np.testing.assert_allclose(np.array(again), np.array(want[:, 2:3]), rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("agree", list(HEADS))
def test_greedy_identical_to_mlx_lm(ckpt, family, agree):
    fc.assert_greedy_identical(ckpt(family, HEADS[agree]), PROMPT, agree)


def test_mtp_layer_equals_reference(ckpt):
    """[enorm(e) || hnorm(h)] @ eh_proj -> the DSA block (with its own indexer, past its
    top-k) as mlx-lm runs it -> shared_head.norm, from the checkpoint's tensors."""
    path = ckpt("deepseek_v32", "noisy")
    raw, p = raw_tensors(path), "model.layers.2."
    model = load_model(path)[0]
    from mlx_lm.models.base import create_causal_mask

    eps = model.args.rms_norm_eps
    hidden, tokens = fc.reference_inputs(model.args.hidden_size,
                                         [[int(x) for x in RNG.integers(0, 128, 9)]])
    x = fc.fused_input(raw["model.embed_tokens.weight"][tokens], hidden, raw[p + "enorm.weight"],
                       raw[p + "hnorm.weight"], raw[p + "eh_proj.weight"], eps)
    block = model.mtp.layers[0].block
    x = np.array(block(mx.array(x), create_causal_mask(9), (KVCache(), KVCache())))
    fc.assert_mtp_forward_equals(model, hidden, tokens,
                                 rms(x, raw[p + "shared_head.norm.weight"], eps),
                                 model.make_mtp_cache())


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_rows_equal_mlx_lm(ckpt, family):
    path = ckpt(family, "noisy")
    fc.assert_batched_rows_equal_mlx_lm(load_model(path)[0], mlx_lm_model(path), PROMPTS)


def test_missing_head_and_convert(ckpt, tmp_path):
    fc.assert_missing_head_explained(ckpt("glm_moe_dsa", drop_mtp=True),
                                     "model.layers.2.eh_proj.weight")
    fc.assert_convert_round_trip(ckpt("glm_moe_dsa", "noisy"), tmp_path / "out", PROMPT)
