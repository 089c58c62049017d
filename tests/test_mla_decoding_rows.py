"""Verify cost at long context (issue 38): the MLA head catching up on a step's accepted
rows runs the absorbed formula, as one token does, instead of expanding every cached
latent into per-head keys and values on each step; its output is the expanded formula's
(the same attention, in another order) and a prompt still runs expanded, as in mlx-lm."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_mtp.models.blocks import attention_trunk
from mlx_mtp.models.families import bailing_hybrid
from mlx_mtp.testing import tiny_attention, tiny_bailing, tiny_special

PREFIX, ROWS = 6, 3  # positions the head holds, rows of a catch-up pass (accepted + 1)
BUILDERS = {
    "deepseek_v3": lambda: tiny_attention.tiny_config("deepseek_v3"),
    "glm4_moe_lite": lambda: tiny_attention.tiny_config("glm4_moe_lite"),
    "longcat_flash": tiny_special.longcat_flash_config,
    "bailing_hybrid": tiny_bailing.bailing_hybrid_config,
}


@pytest.mark.parametrize("family", sorted(BUILDERS))
@pytest.mark.parametrize("last_only", [False, True])
def test_catch_up_rows_run_absorbed_with_the_expanded_output(family, last_only, monkeypatch):
    model = tiny_attention.build_model(BUILDERS[family]())
    assert model.family.mla
    H = model.model.embed_tokens.weight.shape[1]
    rng = np.random.default_rng(2)
    hidden = mx.array(rng.standard_normal((1, PREFIX + ROWS, H)), mx.float32)
    tokens = mx.array(rng.integers(0, 100, (1, PREFIX + ROWS)), mx.uint32)
    formulas, heads = [], attention_trunk.mla_heads  # (rows, absorbed) of every MLA call

    def spy(attn, x, mask, cache, absorbed):
        formulas.append((x.shape[1], absorbed))
        return heads(attn, x, mask, cache, absorbed)

    for module in (attention_trunk, bailing_hybrid):
        monkeypatch.setattr(module, "mla_heads", spy)
    caches = [model.make_mtp_cache(), model.make_mtp_cache()]
    for c in caches:
        model.mtp_forward(hidden[:, :PREFIX], tokens[:, :PREFIX], c)
    assert formulas and all(f == (PREFIX, False) for f in formulas)  # a prompt: expanded
    formulas.clear()
    out = model.mtp_forward(hidden[:, PREFIX:], tokens[:, PREFIX:], caches[0], last_only=last_only)
    assert formulas and all(f == (ROWS, True) for f in formulas)  # catching up: absorbed
    monkeypatch.setattr(attention_trunk, "decoding_rows", lambda cache, L: L == 1)
    ref = model.mtp_forward(hidden[:, PREFIX:], tokens[:, PREFIX:], caches[1], last_only=last_only)
    assert formulas[-1] == (ROWS, False)  # the reference: the expanded formula
    np.testing.assert_allclose(np.array(model.logits(out)), np.array(model.logits(ref)),
                               rtol=1e-4, atol=1e-4)
    for a, b in zip(caches[0], caches[1], strict=True):  # the caches get the same entries
        for x, y in zip(a.state, b.state, strict=True):
            assert mx.array_equal(x, y).item()


def test_a_batch_with_a_fresh_row_stays_expanded():
    """Rows more than a sequence holds (a joining row's prompt): the prompt formula."""
    model = tiny_attention.build_model(tiny_attention.tiny_config("deepseek_v3"))
    cache = model.make_mtp_cache()[0]
    assert attention_trunk.decoding_rows(None, 1)
    assert not attention_trunk.decoding_rows(None, 3)
    assert not attention_trunk.decoding_rows(cache, 3)  # empty: a prompt
