"""Attention-trunk families on disk: convert keeps the MTP layer under its own prefix in
mtp.safetensors (plain mlx-lm still loads the result), FP8 releases are dequantized."""

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model as mlx_lm_load_model

import family_checks as fc
from mlx_mtp.convert.main import convert
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.testing.tiny_attention import FAMILIES, make_tiny

PROMPT = [1, 5, 9, 22, 7, 3, 100, 20, 42, 17, 18]
MTP_PREFIX = {"mimo": "model.mtp_layers.0."}


def decode(model, k):
    return fc.decode_and_accepted(model, PROMPT, k, n=16)


def mtp_file_keys(path: Path):
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    return sorted(k for k, f in weight_map.items() if f == "mtp.safetensors")


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_keeps_the_mtp_layer_and_mlx_lm_still_loads(tmp_path, family):
    src = make_tiny(tmp_path / "src", family, "noisy")
    out = tmp_path / "out"
    fc.assert_convert_round_trip(src, out, PROMPT, n=16)
    prefix = MTP_PREFIX.get(family, "model.layers.2.")
    keys = mtp_file_keys(out)
    assert keys and all(k.startswith(prefix) for k in keys)
    assert not any("embed_tokens" in k or "shared_head.head" in k for k in keys)  # duplicates


def test_quantized_convert_records_the_head_under_its_own_prefix(tmp_path):
    src = make_tiny(tmp_path / "src", "glm4_moe_lite", "oracle")
    out = tmp_path / "out"
    convert(src, out, quantize=True, q_bits=4, q_group_size=32, mtp_bits=8, verbose=False)
    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert quant["bits"] == 4 and quant["model.layers.2.eh_proj"]["bits"] == 8
    assert "model.layers.2.eh_proj.scales" in mtp_file_keys(out)
    model = load_model(out)[0]
    assert model.mtp.layers[0].eh_proj.bits == 8
    toks, accepted = decode(model, 2)
    assert toks == decode(model, 0)[0] and accepted > 0
    plain, _ = mlx_lm_load_model(out)
    assert mx.array_equal(plain(mx.array([PROMPT])), model(mx.array([PROMPT])))


def test_fp8_release_is_dequantized_on_load_and_convert(tmp_path):
    src = make_tiny(tmp_path / "src", "deepseek_v3", "noisy", fp8=True)
    model = load_model(src)[0]
    # mlx-lm's deepseek_v3 dequantizes FP8 itself: the same trunk (its sanitize keeps a
    # tiny model's MTP layer, which it expects at index 61: ignore it).
    plain, _ = mlx_lm_load_model(src, strict=False)
    x = mx.array([PROMPT])
    assert mx.array_equal(model(x), plain(x))
    toks, accepted = decode(model, 2)
    assert accepted > 0
    convert(src, tmp_path / "out", verbose=False)
    assert decode(load_model(tmp_path / "out")[0], 2) == (toks, accepted)


@pytest.mark.parametrize("family,quantize", [("glm4_moe", False), ("glm4_moe_lite", True),
                                             ("mimo", True)])
def test_add_mtp_onto_an_mlx_lm_conversion(tmp_path, family, quantize):
    src = make_tiny(tmp_path / "src", family, "noisy", num_shards=2)
    dst = tmp_path / "mlx-community"
    model = fc.assert_add_mtp_onto_mlx_lm_conversion(src, dst, PROMPT, quantize)
    assert mtp_file_keys(dst)[0].startswith(MTP_PREFIX.get(family, "model.layers.2."))
    if quantize:
        assert model.mtp.layers[0].eh_proj.bits == 4  # quantized like the model


def test_add_mtp_from_an_fp8_release(tmp_path):
    src = make_tiny(tmp_path / "src", "deepseek_v3", "noisy", fp8=True)
    trunk_only = make_tiny(tmp_path / "trunk", "deepseek_v3", "noisy", fp8=True, drop_mtp=True)
    dst = tmp_path / "dst"
    convert(trunk_only, dst, quantize=True, q_group_size=32, verbose=False)
    from mlx_mtp.convert.add_mtp import add_mtp

    add_mtp(dst, src, mtp_bits=16, verbose=False)
    model = load_model(dst)[0]
    assert model.mtp.layers[0].eh_proj.weight.dtype != mx.uint32  # kept in floating point
    toks, accepted = decode(model, 2)
    assert toks == decode(model, 0)[0] and accepted > 0


def test_cli_generates_and_explains_a_missing_head(tmp_path, cli):
    full = make_tiny(tmp_path / "full", "glm4_moe_lite", "oracle", vocab_size=4096)
    code, out, err = cli("generate", "--model", str(full), "--prompt", "def f():", "-m", "12",
                         "--num-draft-tokens", "2", "--fixed-k")
    assert code == 0, err
    assert "MTP: accepted" in out and "(100.0%)" in out
    stripped = make_tiny(tmp_path / "stripped", "glm4_moe_lite", vocab_size=4096, drop_mtp=True)
    code, out, err = cli("generate", "--model", str(stripped), "--prompt", "hi", "-m", "4")
    assert code == 2 and "Traceback" not in err
    assert "model.layers.2.eh_proj.weight" in err and "mlx-mtp add-mtp" in err
