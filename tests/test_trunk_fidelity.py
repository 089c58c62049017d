"""Trunks that compute what the released models compute, where mlx-lm 0.32.2 departs from the
reference (docs/model-families.md, "Where we differ from mlx-lm"): MiMo-V2-Flash's window
layers attend to ``sliding_window_size + 1`` keys, Step-3.5's zero-centred norms are
``1 + w`` formed in float32, DeepSeek-V3's router (and V3.2's, GLM-4.x's, GLM-5's) masks the
groups it leaves out with -inf.

The reference is transformers 5.24.0's own classes, recorded once on tiny checkpoints in the
released layouts (bfloat16 weights, run in float32) by tests/fixtures/trunk_fidelity/
generate.py (its docstring says how to rerun it): logits at every position of a prompt that
wraps the window, and a greedy continuation on a prompt where mlx-lm's greedy text parts
from the reference (``mlx_lm_parts_at``; checked here again against mlx-lm itself, so the
fixture keeps exercising the difference).
"""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step as mlx_lm_generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model

from family_checks import mtp_tokens
from mlx_mtp.models.io.loader import load_model

FIXTURES = Path(__file__).parent / "fixtures" / "trunk_fidelity"
FAMILIES = sorted(p.name for p in FIXTURES.iterdir() if (p / "reference.npz").exists())


def reference(family: str):
    return np.load(FIXTURES / family / "reference.npz")


@pytest.fixture(scope="module")
def model_of():
    made = {}

    def get(family):
        if family not in made:
            made[family] = load_model(FIXTURES / family, dtype=mx.float32)[0]
        return made[family]

    return get


def test_every_family_has_its_fixture():
    assert FAMILIES == ["deepseek_v3", "deepseek_v32", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa",
                        "mimo_v2_flash", "step3p5"]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_at_every_position(model_of, family):
    ref = reference(family)
    model = model_of(family)
    got = model.logits(model.trunk(mx.array([ref["prompt"].tolist()]), model.make_cache())[0])
    np.testing.assert_allclose(np.array(got[0]), ref["logits"], atol=2e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_where_mlx_lm_parts(model_of, family):
    """Plain decoding (K = 0) and MTP decoding at K = 1..3 give transformers' greedy text,
    past the token where mlx-lm's own greedy text leaves it."""
    ref = reference(family)
    prompt, want = ref["prompt"].tolist(), ref["greedy"].tolist()
    plain = mlx_lm_load_model(FIXTURES / family, strict=False)[0]  # leaves the tiny MTP layer
    plain.set_dtype(mx.float32)
    theirs = [int(t) for t, _ in mlx_lm_generate_step(mx.array(prompt), plain,
                                                     max_tokens=len(want))]
    parts_at = int(ref["mlx_lm_parts_at"])
    assert theirs[:parts_at] == want[:parts_at] and theirs[parts_at] != want[parts_at]
    for k in range(4):
        assert mtp_tokens(model_of(family), prompt, k, n=len(want))[0] == want, f"K={k}"


def test_step3p5_norms_stay_exact_in_a_bfloat16_model():
    """Loaded as stored (bfloat16), the norms keep ``1 + w`` in float32 and hand the
    activations back in bfloat16 (as transformers' ``Step3p7RMSNorm`` does)."""
    path = FIXTURES / "step3p5"
    model = load_model(path)[0]
    raw = mx.load(str(path / "model.safetensors"))
    for name, norm in (("model.layers.0.input_layernorm", model.model.layers[0].input_layernorm),
                       ("model.layers.3.enorm", model.mtp.layers[0].enorm)):
        stored = raw[name + ".weight"]
        assert stored.dtype == mx.bfloat16 and norm.weight.dtype == mx.float32
        assert mx.array_equal(norm.weight, stored.astype(mx.float32) + 1)
    # A dense layer stays in bfloat16 (the MoE layers' experts run in float32 on the CPU).
    x = model.model.embed_tokens(mx.array([[1, 2, 3]]))
    assert x.dtype == mx.bfloat16 and model.model.layers[0](x, "causal", None).dtype == x.dtype
