"""Window families on disk: convert and add-mtp write the MTP layer under its released
names and in its released form (step3p5: zero-centred norms, block under ``transformer.``;
MiMo-V2-Flash: ``model.mtp.layers.0.*``); plain mlx-lm still loads the result."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step as mlx_lm_generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model
from safetensors.numpy import load_file

from mlx_mtp.convert.add_mtp import add_mtp
from mlx_mtp.convert.main import convert
from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.models.layout import MissingMTPWeightsError, config_mtp_layers
from mlx_mtp.models.loader import load_model
from mlx_mtp.testing.tiny_special import make_tiny_mimo_v2_flash, make_tiny_step3p5

PROMPT = [int(x) for x in np.random.default_rng(1).integers(0, 128, 20)]
BUILDERS = {"step3p5": make_tiny_step3p5, "mimo_v2_flash": make_tiny_mimo_v2_flash}
PREFIX = {"step3p5": "model.layers.3.", "mimo_v2_flash": "model.mtp.layers.0."}
NORMS = {"step3p5": ("enorm.weight", "shared_head.norm.weight",
                     "transformer.post_attention_layernorm.weight"),
         "mimo_v2_flash": ("enorm.weight", "final_layernorm.weight", "pre_mlp_layernorm.weight")}


def decode(model, k):
    dec = MTPDecoder(model, k, adaptive=False)
    toks = [t for t, _, _ in generate_step(PROMPT, model, decoder=dec, max_tokens=16)]
    return toks, dec.stats.num_accepted_tokens


def tensors(path: Path, name: str = "*.safetensors"):
    out = {}
    for f in Path(path).glob(name):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("family", list(BUILDERS))
def test_convert_writes_the_released_form_and_mlx_lm_still_loads(tmp_path, family):
    src = BUILDERS[family](tmp_path / "src", "noisy")
    out = tmp_path / "out"
    convert(src, out, verbose=False)
    mtp, raw = tensors(out, "mtp.safetensors"), tensors(src)
    layers = {k.split(".")[2 if family == "step3p5" else 3] for k in mtp}
    assert layers == ({"3"} if family == "step3p5" else {"0", "1", "2"})  # all MTP layers
    assert all(k.startswith(PREFIX[family].rsplit(".", 2)[0]) for k in mtp)
    for name in NORMS[family]:  # step3p5: zero-centred, as released
        k = PREFIX[family] + name
        np.testing.assert_allclose(mtp[k], raw[k], atol=1e-6)
    ours, original = load_model(out)[0], load_model(src)[0]
    assert decode(ours, 2) == decode(original, 2)
    plain, _ = mlx_lm_load_model(out)  # strict: mlx-lm never opens mtp.safetensors
    x = mx.array([PROMPT])
    np.testing.assert_allclose(np.array(plain(x)), np.array(ours(x)), atol=1e-5)


@pytest.mark.parametrize("family,quantize", [("step3p5", False), ("step3p5", True),
                                             ("mimo_v2_flash", True)])
def test_add_mtp_onto_an_mlx_lm_conversion(tmp_path, family, quantize):
    from mlx_lm import convert as mlx_lm_convert

    src = BUILDERS[family](tmp_path / "src", "noisy")
    dst = tmp_path / "mlx-community"
    mlx_lm_convert(str(src), str(dst), quantize=quantize, q_group_size=32, q_bits=4)
    with pytest.raises(MissingMTPWeightsError, match="add-mtp"):
        load_model(dst)
    add_mtp(dst, src, verbose=False)
    assert config_mtp_layers(json.loads((dst / "config.json").read_text())) >= 1
    model = load_model(dst)[0]
    plain, _ = mlx_lm_load_model(dst)
    ref = [int(t) for t, _ in mlx_lm_generate_step(mx.array(PROMPT), plain, max_tokens=16)]
    toks, accepted = decode(model, 2)
    assert toks == ref and accepted > 0
    if not quantize:  # the grafted layer is the original's: same drafts, same acceptance
        assert (toks, accepted) == decode(load_model(src)[0], 2)
