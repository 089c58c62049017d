"""Window families on disk: convert and add-mtp write the MTP layer under its released
names and in its released form (step3p5: zero-centred norms, block under ``transformer.``;
MiMo-V2-Flash: ``model.mtp.layers.0.*``); plain mlx-lm still loads the result."""

import json

import numpy as np
import pytest

import family_checks as fc
from family_checks import raw_tensors
from mlx_mtp.models.io.layout import config_mtp_layers
from mlx_mtp.testing.tiny_special import make_tiny_mimo_v2_flash, make_tiny_step3p5

PROMPT = [int(x) for x in np.random.default_rng(1).integers(0, 128, 20)]
BUILDERS = {"step3p5": make_tiny_step3p5, "mimo_v2_flash": make_tiny_mimo_v2_flash}
PREFIX = {"step3p5": "model.layers.3.", "mimo_v2_flash": "model.mtp.layers.0."}
NORMS = {"step3p5": ("enorm.weight", "shared_head.norm.weight",
                     "transformer.post_attention_layernorm.weight"),
         "mimo_v2_flash": ("enorm.weight", "final_layernorm.weight", "pre_mlp_layernorm.weight")}


@pytest.mark.parametrize("family", list(BUILDERS))
def test_convert_writes_the_released_form_and_mlx_lm_still_loads(tmp_path, family):
    src = BUILDERS[family](tmp_path / "src", "noisy")
    out = tmp_path / "out"
    fc.assert_convert_round_trip(src, out, PROMPT, n=16, atol=1e-5)
    mtp, raw = raw_tensors(out, "mtp.safetensors"), raw_tensors(src)
    layers = {k.split(".")[2 if family == "step3p5" else 3] for k in mtp}
    assert layers == ({"3"} if family == "step3p5" else {"0", "1", "2"})  # all MTP layers
    assert all(k.startswith(PREFIX[family].rsplit(".", 2)[0]) for k in mtp)
    for name in NORMS[family]:  # step3p5: zero-centred, as released
        k = PREFIX[family] + name
        np.testing.assert_allclose(mtp[k], raw[k], atol=1e-6)


@pytest.mark.parametrize("family,quantize", [("step3p5", False), ("step3p5", True),
                                             ("mimo_v2_flash", True)])
def test_add_mtp_onto_an_mlx_lm_conversion(tmp_path, family, quantize):
    src = BUILDERS[family](tmp_path / "src", "noisy")
    dst = tmp_path / "mlx-community"
    fc.assert_add_mtp_onto_mlx_lm_conversion(src, dst, PROMPT, quantize)
    assert config_mtp_layers(json.loads((dst / "config.json").read_text())) >= 1
