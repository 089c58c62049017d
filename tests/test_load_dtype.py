"""The load-time dtype choice (``--dtype``, ``load(dtype=...)``): applied to the float
weights, never to quantized layers or ``A_log``, and greedy output equal to mlx-lm's
with the same dtype."""

from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step as mlx_lm_generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model

from mlx_mtp.convert.main import convert
from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.models.io import loader
from mlx_mtp.models.io.loader import ModelLoadError, load_model
from mlx_mtp.options import add_model_arguments

PROMPT = [1, 5, 9, 22, 7, 3, 100, 200, 42, 17, 18]
N_TOKENS = 40  # the bf16 and float32 greedy outputs of the checkpoint below part at 31


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    from mlx_mtp.testing.tiny import make_tiny

    path = tmp_path_factory.mktemp("bf16")
    return make_tiny(path, "qwen3_5", "random", dtype=mx.bfloat16)


def float_dtypes(model) -> dict:
    """Parameter name -> dtype, float parameters only."""
    return {k: v.dtype for k, v in tree_flatten(model.parameters())
            if mx.issubdtype(v.dtype, mx.floating)}


def mlx_lm_greedy(path, dtype, n=N_TOKENS):
    model, _ = mlx_lm_load_model(Path(path))
    if dtype is not None:
        model.set_dtype(dtype)
    return [int(t) for t, _ in mlx_lm_generate_step(mx.array(PROMPT), model, max_tokens=n)]


def mtp_greedy(model, k=2, n=N_TOKENS):
    dec = MTPDecoder(model, k, SamplingParams(), adaptive=False)
    return [t for t, _, _ in generate_step(PROMPT, model, decoder=dec, max_tokens=n)]


def test_auto_upcasts_a_small_bf16_checkpoint_on_the_cpu(bf16_ckpt):
    assert mx.default_device() == mx.cpu
    stored, _ = load_model(Path(bf16_ckpt))
    auto, _ = load_model(Path(bf16_ckpt), dtype="auto")
    assert stored.load_dtype is None and auto.load_dtype == mx.float32
    assert stored.dtype_choice == "as stored"
    assert auto.dtype_choice.startswith("float32 (auto: bfloat16 upcast, float32 copy ")
    kinds = float_dtypes(stored)
    assert {d for k, d in kinds.items() if not k.endswith("A_log")} == {mx.bfloat16}
    assert all(d == mx.float32 for d in float_dtypes(auto).values())
    assert all(kinds[k] == mx.float32 for k in kinds if k.endswith("A_log"))
    explicit, _ = load_model(Path(bf16_ckpt), dtype="bfloat16")
    assert float_dtypes(explicit) == kinds


def test_auto_keeps_bf16_past_the_size_limit(bf16_ckpt, monkeypatch):
    monkeypatch.setattr(loader, "AUTO_FLOAT32_MAX_BYTES", 1000)
    model, _ = load_model(Path(bf16_ckpt), dtype="auto")
    assert model.load_dtype is None
    assert model.language_model.model.embed_tokens.weight.dtype == mx.bfloat16
    assert model.dtype_choice.startswith("bfloat16 as stored (auto: float32 copy ")


@pytest.mark.parametrize("dtype", [None, "auto", "bfloat16"])
def test_greedy_output_equals_mlx_lm_with_the_same_dtype(bf16_ckpt, dtype):
    model, _ = load_model(Path(bf16_ckpt), dtype=dtype)
    ref = mlx_lm_greedy(bf16_ckpt, model.load_dtype)
    assert mtp_greedy(model) == ref
    assert mtp_greedy(model, k=0) == ref


def test_the_dtype_changes_this_checkpoint_s_output(bf16_ckpt):
    """So the equalities above tell the dtypes apart."""
    assert mlx_lm_greedy(bf16_ckpt, None) != mlx_lm_greedy(bf16_ckpt, mx.float32)


def test_quantized_layers_are_never_changed(bf16_ckpt, tmp_path):
    q4 = tmp_path / "q4"
    convert(bf16_ckpt, q4, quantize=True, dtype="bfloat16", verbose=False)
    stored, _ = load_model(q4)
    auto, _ = load_model(q4, dtype="auto")
    assert auto.load_dtype is None  # a quantized checkpoint keeps its dtype
    assert auto.dtype_choice == "as stored (auto: quantized checkpoint)"
    assert float_dtypes(auto) == float_dtypes(stored)
    upcast, _ = load_model(q4, dtype="float32")
    before, after = float_dtypes(stored), float_dtypes(upcast)
    quantized = [k for k in before if k.endswith(".scales") or k.endswith(".biases")
                 and k[: -len(".biases")] + ".scales" in before]
    assert quantized and all(after[k] == before[k] for k in quantized)
    others = [k for k in before if k not in quantized and not k.endswith("A_log")]
    assert others and all(after[k] == mx.float32 for k in others)


def test_bad_dtype_is_a_load_error(bf16_ckpt):
    with pytest.raises(ModelLoadError, match="dtype must be one of auto, float32"):
        load_model(Path(bf16_ckpt), dtype="float64")


def test_cli_flag_defaults_to_auto():
    import argparse

    p = argparse.ArgumentParser()
    add_model_arguments(p)
    assert p.parse_args([]).dtype == "auto"
    assert p.parse_args(["--dtype", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--dtype", "float64"])
    assert e.value.code == 2
