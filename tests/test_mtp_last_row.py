"""The head's first pass of a step keeps only its last row (``mtp_forward(last_only=True)``):
every row still runs attention (the MTP cache gets the same entries as the full pass, the
last row attends to them all); the MLP / MoE and the norm after it run on the last row."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_mtp.testing import tiny, tiny_attention, tiny_bailing, tiny_special

FULL, PREFIX = 4, 5  # rows in the pass, positions already in the MTP cache
HYBRID = ("qwen3_5_moe", "qwen3_next")


def _hybrid(family):
    model = tiny.build_model(family, tiny.tiny_text_config(family, mtp_layers=2))
    return model, model.text.mtp.layers[-1], "mlp"


def _attention(config):
    model = tiny_attention.build_model(config)
    return model, model.mtp.layers[0].block, "mlp"


BUILDERS = {
    "qwen3_5_moe": lambda: _hybrid("qwen3_5_moe"),
    "qwen3_next": lambda: _hybrid("qwen3_next"),
    "glm4_moe": lambda: _attention(tiny_attention.tiny_config("glm4_moe")),
    "deepseek_v3": lambda: _attention(tiny_attention.tiny_config("deepseek_v3")),
    "mimo": lambda: _attention(tiny_attention.tiny_config("mimo")),
    "step3p5": lambda: _attention(tiny_special.step3p5_config()),  # windowed, one layer
    "longcat_flash": lambda: _attention(tiny_special.longcat_flash_config()),
    "deepseek_v32": lambda: _attention(tiny_special.dsa_config("deepseek_v32")),
    "glm_moe_dsa": lambda: _attention(tiny_special.dsa_config("glm_moe_dsa")),
    "nemotron_h": lambda: _nemotron(),  # pattern "*E": attention, then an MoE block
    "bailing_hybrid": lambda: _attention(tiny_bailing.bailing_hybrid_config()),  # gated MLA
}


def _nemotron():
    """The MLP to watch is the mixer of the MoE block."""
    model, blocks, _ = _attention(tiny_special.nemotron_h_config())
    return model, next(layer for layer in blocks.layers if layer.block_type == "E"), "mixer"


class RowsSeen:
    """Wraps a block's MLP and records how many rows each call gets."""

    def __init__(self, mlp):
        self.mlp, self.rows = mlp, []

    def __call__(self, x):
        self.rows.append(x.shape[1])
        return self.mlp(x)


def _cache_arrays(cache):
    return [a for c in cache for a in c.state]


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_last_row_matches_full_pass(family, monkeypatch):
    model, owner, mlp = BUILDERS[family]()  # the block's MLP / MoE: ``owner.<mlp>``
    H = model.model.embed_tokens.weight.shape[1] if family not in HYBRID else \
        model.text.args.hidden_size
    rng = np.random.default_rng(1)
    hidden = mx.array(rng.standard_normal((1, PREFIX + FULL, H)), mx.float32)
    tokens = mx.array(rng.integers(0, 100, (1, PREFIX + FULL)), mx.uint32)
    caches = [model.make_mtp_cache(), model.make_mtp_cache()]
    for c in caches:  # earlier positions, so the pass attends to cached keys too
        model.mtp_forward(hidden[:, :PREFIX], tokens[:, :PREFIX], c)
    full = model.mtp_forward(hidden[:, PREFIX:], tokens[:, PREFIX:], caches[0])
    seen = RowsSeen(getattr(owner, mlp))
    monkeypatch.setattr(owner, mlp, seen)
    last = model.mtp_forward(hidden[:, PREFIX:], tokens[:, PREFIX:], caches[1], last_only=True)
    mx.eval(full, last, _cache_arrays(caches[0]), _cache_arrays(caches[1]))

    assert seen.rows == [1]  # the MLP / MoE ran on the last row alone
    assert last.shape == (1, 1, H)
    for a, b in zip(_cache_arrays(caches[0]), _cache_arrays(caches[1]), strict=True):
        assert a.shape == b.shape and mx.array_equal(a, b).item()  # same entries, bit for bit
    assert caches[0][0].offset == caches[1][0].offset == PREFIX + FULL
    np.testing.assert_allclose(np.array(model.logits(last)),
                               np.array(model.logits(full[:, -1:])), rtol=1e-5, atol=1e-5)
