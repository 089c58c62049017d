"""Load Qwen hybrid checkpoints (raw Hugging Face or MLX-converted) with their MTP head."""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import UnsupportedModelError, get_model_module
from .hybrid import MissingMTPWeightsError, SparseMoeBlock

DEFAULT_MODEL = Path(__file__).parent.parent / "assets" / "demo-model"


class ModelLoadError(ValueError):
    pass


# Errors that describe a problem with the user's checkpoint or arguments (CLI: exit 2).
USER_ERRORS = (ModelLoadError, UnsupportedModelError, MissingMTPWeightsError)


def resolve_model_path(path: Optional[str]) -> Path:
    if path is None:
        if not (DEFAULT_MODEL / "config.json").exists():
            raise ModelLoadError(
                "No --model given and the embedded demo model is not installed "
                f"(expected at {DEFAULT_MODEL}). Pass --model PATH to a local checkpoint."
            )
        return DEFAULT_MODEL
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(
            f"Model path {path!r} does not exist. mlx-mtp loads local checkpoints "
            "(a directory with config.json and *.safetensors)."
        )
    if not (p / "config.json").exists():
        raise ModelLoadError(f"{p} has no config.json; is it a model directory?")
    return p


def load_config(path: Path) -> dict:
    with open(path / "config.json") as f:
        return json.load(f)


def weight_files(path: Path) -> list:
    """Safetensors files of a checkpoint: those named by the index, or all of them."""
    index = path / "model.safetensors.index.json"
    files = set()
    if index.exists():
        with open(index) as f:
            files = {path / name for name in json.load(f)["weight_map"].values()}
    # Some releases ship the MTP head in an extra file (e.g. mtp.safetensors).
    files |= {Path(p) for p in glob.glob(str(path / "*.safetensors"))}
    return sorted(files)


def read_weights(path: Path) -> dict:
    files = weight_files(path)
    if not files:
        raise ModelLoadError(f"No *.safetensors weight files found in {path}.")
    weights = {}
    for f in files:
        weights.update(mx.load(str(f)))
    return weights


def _text_config(config: dict) -> dict:
    return config.get("text_config", config)


def _apply_overrides(config: dict, mtp: bool, mtp_hidden: Optional[str]) -> dict:
    config = json.loads(json.dumps(config))
    text = _text_config(config)
    if not mtp:
        text["mtp_num_hidden_layers"] = 0
        text["num_nextn_predict_layers"] = 0
    if mtp_hidden is not None:
        text["mtp_hidden"] = mtp_hidden
    return config


def _quantization(config: dict) -> Optional[dict]:
    q = config.get("quantization") or _text_config(config).get("quantization")
    return q


def quantize_like_checkpoint(model: nn.Module, weights: dict, quantization: Optional[dict]):
    """Quantize exactly the modules the checkpoint stores quantized (per-layer bits)."""
    from mlx_lm.utils import infer_quant_config

    if not any(k.endswith(".scales") for k in weights):
        return
    quantization = quantization or {"group_size": 64, "bits": 4}

    def predicate(path, module):
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        override = quantization.get(path)
        if isinstance(override, dict):
            return override
        return infer_quant_config(path, module, weights)

    nn.quantize(
        model,
        group_size=quantization.get("group_size", 64),
        bits=quantization.get("bits", 4),
        mode=quantization.get("mode", "affine"),
        class_predicate=predicate,
    )


def _upcast_cpu_experts(model: nn.Module):
    """MLX's CPU gather_mm only takes float32: upcast float experts there."""
    if mx.default_device() != mx.cpu:
        return
    for _, m in model.named_modules():
        if isinstance(m, SparseMoeBlock):
            sw = m.switch_mlp
            for proj in (sw.gate_proj, sw.up_proj, sw.down_proj):
                if "scales" not in proj and proj.weight.dtype != mx.float32:
                    proj.weight = proj.weight.astype(mx.float32)


def load_model(
    path,
    mtp: bool = True,
    mtp_hidden: Optional[str] = None,
    dtype: Optional[mx.Dtype] = None,
    lazy: bool = False,
) -> Tuple[nn.Module, dict]:
    """Build the model for ``path`` and load its weights (MTP head included).

    ``mtp=False`` skips the head (and runs models whose weights lack one).
    """
    path = resolve_model_path(path) if not isinstance(path, Path) else path
    config = _apply_overrides(load_config(path), mtp, mtp_hidden)
    model_type = config.get("model_type")
    if model_type is None:
        raise ModelLoadError(f"{path / 'config.json'} has no model_type.")
    module = get_model_module(model_type)
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = model.sanitize(read_weights(path))
    quantize_like_checkpoint(model, weights, _quantization(config))
    if dtype is not None:
        weights = {
            k: (v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating)
                and model.cast_predicate(k) else v)
            for k, v in weights.items()
        }
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(f"Weights in {path} do not match the model: {e}") from e
    _upcast_cpu_experts(model)
    model.eval()
    if not lazy:
        mx.eval(model.parameters())
    return model, config


def load_tokenizer(path: Path, config: dict):
    from mlx_lm.utils import load_tokenizer as _load

    eos = config.get("eos_token_id")
    gen = path / "generation_config.json"
    if gen.exists():
        with open(gen) as f:
            eos = json.load(f).get("eos_token_id", eos)
    return _load(path, eos_token_ids=eos)


def load(path: Optional[str] = None, mtp: bool = True, mtp_hidden: Optional[str] = None,
         dtype: Optional[mx.Dtype] = None, lazy: bool = False):
    """Load model and tokenizer. ``path=None`` loads the embedded demo model."""
    p = resolve_model_path(path)
    model, config = load_model(p, mtp=mtp, mtp_hidden=mtp_hidden, dtype=dtype, lazy=lazy)
    return model, load_tokenizer(p, config)


def generation_defaults(path: Optional[str]) -> dict:
    """Sampling defaults from generation_config.json (as vLLM uses them)."""
    p = resolve_model_path(path) / "generation_config.json"
    if not p.exists():
        return {}
    with open(p) as f:
        g = json.load(f)
    keys = {"temperature": "temp", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p"}
    return {ours: g[k] for k, ours in keys.items() if k in g}


def parameter_count(model) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))
