"""step3p5 on disk: convert and add-mtp write the MTP layer under its released names and
in its released form (zero-centred norms, block under ``transformer.``); plain mlx-lm
still loads the result."""

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
from mlx_mtp.models.layout import MissingMTPWeightsError
from mlx_mtp.models.loader import load_model
from mlx_mtp.testing.tiny_special import make_tiny_step3p5

PROMPT = [int(x) for x in np.random.default_rng(1).integers(0, 128, 20)]
PREFIX = "model.layers.3."


def decode(model, k):
    dec = MTPDecoder(model, k, adaptive=False)
    toks = [t for t, _, _ in generate_step(PROMPT, model, decoder=dec, max_tokens=16)]
    return toks, dec.stats.num_accepted_tokens


def tensors(path: Path, name: str = "*.safetensors"):
    out = {}
    for f in Path(path).glob(name):
        out.update(load_file(f))
    return out


def test_convert_writes_the_released_form_and_mlx_lm_still_loads(tmp_path):
    src = make_tiny_step3p5(tmp_path / "src", "noisy")
    out = tmp_path / "out"
    convert(src, out, verbose=False)
    mtp, raw = tensors(out, "mtp.safetensors"), tensors(src)
    assert mtp and all(k.startswith(PREFIX) for k in mtp)
    for k in (PREFIX + "enorm.weight", PREFIX + "shared_head.norm.weight",
              PREFIX + "transformer.post_attention_layernorm.weight"):
        np.testing.assert_allclose(mtp[k], raw[k], atol=1e-6)  # zero-centred, as released
    ours, original = load_model(out)[0], load_model(src)[0]
    assert decode(ours, 2) == decode(original, 2)
    plain, _ = mlx_lm_load_model(out)  # strict: mlx-lm never opens mtp.safetensors
    x = mx.array([PROMPT])
    np.testing.assert_allclose(np.array(plain(x)), np.array(ours(x)), atol=1e-5)


@pytest.mark.parametrize("quantize", [False, True])
def test_add_mtp_onto_an_mlx_lm_conversion(tmp_path, quantize):
    from mlx_lm import convert as mlx_lm_convert

    src = make_tiny_step3p5(tmp_path / "src", "noisy")
    dst = tmp_path / "mlx-community"
    mlx_lm_convert(str(src), str(dst), quantize=quantize, q_group_size=32, q_bits=4)
    with pytest.raises(MissingMTPWeightsError, match="add-mtp"):
        load_model(dst)
    add_mtp(dst, src, verbose=False)
    assert json.loads((dst / "config.json").read_text())["num_nextn_predict_layers"] == 1
    model = load_model(dst)[0]
    plain, _ = mlx_lm_load_model(dst)
    ref = [int(t) for t, _ in mlx_lm_generate_step(mx.array(PROMPT), plain, max_tokens=16)]
    toks, accepted = decode(model, 2)
    assert toks == ref and accepted > 0
    if not quantize:  # the grafted layer is the original's: same drafts, same acceptance
        assert (toks, accepted) == decode(load_model(src)[0], 2)
