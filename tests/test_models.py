"""Loading: raw HF layouts of each family give mlx-lm's logits; MTP weights kept or refused."""

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model as mlx_lm_load_model

from mlx_mtp.models.io.loader import ModelLoadError, load_model
from mlx_mtp.models import UnsupportedModelError
from mlx_mtp.models.io.layout import MissingMTPWeightsError

PROMPT = mx.array([[1, 5, 9, 22, 7, 3, 100, 200, 42, 17, 300, 4]])

LAYOUTS = [
    ("qwen3_5", {}),
    ("qwen3_5", {"nested": False}),
    ("qwen3_5", {"tie": True}),
    ("qwen3_5", {"shards": 3}),
    ("qwen3_5_moe", {"expert_layout": "fused", "mtp_expert_layout": "per_expert"}),
    ("qwen3_5_moe", {"expert_layout": "per_expert", "mtp_expert_layout": "fused"}),
    ("qwen3_next", {}),
]


@pytest.mark.parametrize("family,kw", LAYOUTS)
def test_logits_match_mlx_lm(tiny_ckpt, family, kw):
    path = tiny_ckpt(family, "random", **kw)
    ours, _ = load_model(Path(path))
    # mlx-lm reads only fused trunk experts for qwen3_5_moe and has no module for a
    # flat `qwen3_5_text` (Qwen3_5ForCausalLM) config: give it the same weights in the
    # layout it reads.
    ref_kw = {**kw, "expert_layout": "fused"} if family == "qwen3_5_moe" else dict(kw)
    ref_kw.pop("nested", None)
    theirs, _ = mlx_lm_load_model(Path(tiny_ckpt(family, "random", **ref_kw)))
    assert ours.num_mtp_layers == 1
    assert mx.allclose(ours(PROMPT), theirs(PROMPT), atol=1e-5).item()


def test_mtp_weights_loaded_with_norm_shift(tiny_ckpt):
    """HF stores MTP norms zero-centred; loading must add 1 (as for the trunk)."""
    path = tiny_ckpt("qwen3_5", "random")
    raw = mx.load(str(Path(path) / "model.safetensors"))
    model, _ = load_model(Path(path))
    head = model.text.mtp
    for name in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        assert mx.allclose(getattr(head, name).weight, raw[f"mtp.{name}.weight"] + 1).item()
    assert mx.array_equal(head.fc.weight, raw["mtp.fc.weight"]).item()


def test_bf16_moe_runs_on_cpu(tiny_ckpt):
    """MLX's CPU gather_mm is float32-only; a bf16 MoE checkpoint must still decode."""
    from mlx_mtp.decode.speculative import MTPDecoder, generate_step

    path = tiny_ckpt("qwen3_5_moe", "random", dtype=mx.bfloat16)
    model, _ = load_model(Path(path))
    assert model.text.model.embed_tokens.weight.dtype == mx.bfloat16
    dec = MTPDecoder(model, 2, adaptive=False)
    out = [t for t, _, _ in generate_step([1, 2, 3, 4], model, decoder=dec, max_tokens=6)]
    assert len(out) == 6


def test_missing_mtp_weights_error_names_keys_and_fixes(tiny_ckpt):
    path = tiny_ckpt("qwen3_5", "random", drop_mtp=True)
    with pytest.raises(MissingMTPWeightsError) as e:
        load_model(Path(path))
    msg = str(e.value)
    assert "mtp.*" in msg and "mlx-mtp convert" in msg and "add-mtp" in msg and "--no-mtp" in msg
    model, _ = load_model(Path(path), mtp=False)  # --no-mtp still runs it
    assert model.num_mtp_layers == 0


def test_partially_missing_mtp_weights_listed(tiny_ckpt, tmp_path):
    src = Path(tiny_ckpt("qwen3_5", "random"))
    weights = mx.load(str(src / "model.safetensors"))
    del weights["mtp.fc.weight"]
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(MissingMTPWeightsError, match="mtp.fc.weight"):
        load_model(tmp_path)


def test_unknown_model_type_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UnsupportedModelError) as e:
        load_model(tmp_path)
    assert "qwen3_5" in str(e.value) and "qwen3_next" in str(e.value)


def test_missing_path_is_clear():
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model("/nonexistent/model")
