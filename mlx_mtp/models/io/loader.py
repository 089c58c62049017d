"""Load Qwen hybrid checkpoints (raw Hugging Face or MLX-converted) with their MTP head."""

from __future__ import annotations

import glob
import json
import os
import sys
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from .. import UnsupportedModelError, get_model_module
from . import config_checks, dtype_timing, layout, split_drafter
from ..blocks.hybrid import SparseMoeBlock
from .files import damaged, load_safetensors, read_json_object, read_safetensors_header
from .layout import CheckpointError
from ...errors import ModelLoadError

DEFAULT_MODEL = Path(__file__).parents[2] / "assets" / "demo-model"
INDEX_FILE = "model.safetensors.index.json"


# Errors that describe a problem with the user's checkpoint or arguments (CLI: exit 2).
USER_ERRORS = (CheckpointError, UnsupportedModelError)


def resolve_model_path(path: Optional[str], files=None) -> Path:
    """The local directory of ``path``: a directory, a hub id ``org/name[@revision]``
    (downloaded into the Hugging Face cache: only ``files``, patterns, default
    ``hub.MODEL_FILES``), or None for the embedded demo model."""
    from . import hub

    if path is None:
        if not (DEFAULT_MODEL / "config.json").exists():
            raise ModelLoadError(
                "No --model given and the embedded demo model is not installed "
                f"(expected at {DEFAULT_MODEL}). Pass --model PATH or --model org/name."
            )
        return DEFAULT_MODEL
    p = Path(path).expanduser()
    if not hub.local_path_exists(p):
        if hub.parse_repo_id(str(path)) is not None:
            return hub.snapshot(str(path), files or hub.MODEL_FILES)
        raise ModelLoadError(
            f"Model path {path!r} does not exist. Pass a local checkpoint (a directory with "
            "config.json and *.safetensors) or a Hugging Face id (org/name[@revision])."
        )
    if not (p / "config.json").exists():
        raise ModelLoadError(f"{p} has no config.json; is it a model directory?")
    return p


def load_config(path: Path) -> dict:
    """config.json of the checkpoint at ``path``, its JSON types and values checked."""
    config = read_json_object(path / "config.json")
    config_checks.check_config(config, path / "config.json")
    return config


def weight_files(path: Path) -> list:
    """Safetensors files of a checkpoint: those named by the index, and all others present
    (some releases ship the MTP head in an extra file such as mtp.safetensors)."""
    index = path / INDEX_FILE
    files = set()
    if index.exists():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index} has no weight_map; the file is damaged.")
        files = {path / name for name in weight_map.values()}
        missing = sorted(f.name for f in files if not f.exists())
        if missing:
            raise ModelLoadError(
                f"{index} names {', '.join(missing[:3])}, which "
                f"{'is' if len(missing) == 1 else 'are'} missing: the checkpoint is "
                "incomplete. Download the missing file(s) again.")
    files |= {Path(p) for p in glob.glob(str(path / "*.safetensors"))}
    for f in files:
        if not f.is_file():
            raise damaged(f, "a directory" if f.is_dir() else "not a file: a broken or "
                          "looping symlink?")
    return sorted(files)


def read_weights(path: Path) -> dict:
    files = weight_files(path)
    if not files:
        raise ModelLoadError(f"No *.safetensors weight files found in {path}.")
    weights = {}
    for f in files:
        weights.update(load_safetensors(f))
    return weights


def _apply_overrides(config: dict, mtp: bool, mtp_hidden: Optional[str]) -> dict:
    config = json.loads(json.dumps(config))
    if not mtp:
        layout.set_config_mtp_layers(config, 0)
    if mtp_hidden is not None:
        layout.text_config(config)["mtp_hidden"] = mtp_hidden
    return config


def model_config(path: Path, mtp: bool = True, mtp_hidden: Optional[str] = None) -> dict:
    """The config the model at ``path`` is built from: config.json checked, the overrides
    applied, its counts bounded by what the weight files can hold."""
    config = _apply_overrides(load_config(path), mtp, mtp_hidden)
    config_checks.check_fits_weights(config, weight_files(path), path / "config.json")
    return config


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
        # Ours (SparseMoeBlock) and mlx-lm's MoE blocks (attention-trunk families).
        if isinstance(m, SparseMoeBlock) or isinstance(m.get("switch_mlp"),
                                                        (SwitchGLU, SwitchMLP)):
            sw = m.switch_mlp
            for name in ("gate_proj", "up_proj", "down_proj", "fc1", "fc2"):  # GLU / MLP
                proj = sw.get(name)
                if proj is not None and "scales" not in proj \
                        and proj.weight.dtype != mx.float32:
                    proj.weight = proj.weight.astype(mx.float32)


DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
DTYPE_CHOICES = ("auto",) + tuple(DTYPES)
# The static rule, for when no figures of this machine decide (``choose_dtype``): ``auto``
# upcasts half-precision weights to float32 on the CPU while the float32 copy stays this
# small (and within a quarter of the memory): MLX's CPU backend runs float32 matmuls on
# BLAS and bf16/fp16 ones without. Measured by shape (benchmarks/dtype_rule.py, real_shape.py;
# docs/real-shape.md): float32 plain steps 1.4-2.8x faster from the demo model up to a 1B
# Qwen3.5 (4.1 GB float32 copy), verify passes 2.9-4.6x; no measured shape where bf16 won.
AUTO_FLOAT32_MAX_BYTES = 8 << 30


def _quantized_prefixes(weights: dict) -> set:
    return {k[: -len(".scales")] for k in weights if k.endswith(".scales")}


def _castable(key: str, value: mx.array, model, quantized: set) -> bool:
    """Float weights the dtype choice applies to: not quantized layers (their scales),
    nor what the model keeps in float32 (the DeltaNet ``A_log``)."""
    return (mx.issubdtype(value.dtype, mx.floating) and model.cast_predicate(key)
            and key.rsplit(".", 1)[0] not in quantized)


def resolve_dtype(choice, weights: dict, model) -> Optional[mx.Dtype]:
    """The dtype float weights are cast to at load; None keeps them as stored (see
    ``choose_dtype``)."""
    return choose_dtype(choice, weights, model)[0]


def choose_dtype(choice, weights: dict, model,
                 timings: str = "rule") -> Tuple[Optional[mx.Dtype], str]:
    """The dtype float weights are cast to at load (None: as stored), and why.

    ``choice``: None (as stored), an ``mx.Dtype``, a name of ``DTYPES`` (always wins), or
    ``"auto"``: on the CPU, for a checkpoint with half-precision weights, none quantized,
    float32 when this machine's measured figures say it pays (``dtype_timing``) and the
    float32 copy fits a quarter of the memory; as stored otherwise (GPUs run bf16 fast).
    ``timings`` says which figures decide (``dtype_timing.CONSULT``): "measure" (the stored
    ones, measured once now when there are none), "stored", or "rule": the static rule
    (``AUTO_FLOAT32_MAX_BYTES``), also the fallback when nothing is stored and measuring
    is not allowed. A split load asks the rule: every rank must pick the same dtype.
    """
    if choice is None or isinstance(choice, mx.Dtype):
        return choice, "as stored" if choice is None else f"{_name(choice)} (requested)"
    if choice in DTYPES:
        return DTYPES[choice], f"{choice} (requested)"
    if choice != "auto":
        raise ModelLoadError(f"dtype must be one of {', '.join(DTYPE_CHOICES)} (got {choice!r})")
    if mx.default_device() != mx.cpu:
        return None, "as stored (auto: GPU)"
    if _quantized_prefixes(weights):
        return None, "as stored (auto: quantized checkpoint)"
    shape = auto_shape(weights, model)
    if shape is None:
        return None, "as stored (auto: no half-precision weights)"
    timing = dtype_timing.timing_for(shape, timings)
    size = sum(4 * v.size for k, v in weights.items()
               if _castable(k, v, model, quantized=set()))  # none are, by now
    if timing is None:
        return _static_rule(shape.half, size)
    return _measured_choice(timing, size)


def auto_shape(weights: dict, model) -> Optional[dtype_timing.ShapeClass]:
    """The shape class whose measured figures decide ``auto`` for these weights; None when
    none do (quantized layers, or no half-precision weights)."""
    quantized = _quantized_prefixes(weights)
    if quantized:
        return None
    floats = [v for k, v in weights.items() if _castable(k, v, model, quantized)]
    half = next((v.dtype for v in floats if v.dtype in (mx.bfloat16, mx.float16)), None)
    return None if half is None else dtype_timing.ShapeClass.of(floats, _name(half))


def _memory_quarter() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError, AttributeError):
        return None


def _static_rule(half: str, size: int) -> Tuple[Optional[mx.Dtype], str]:
    limit = min(AUTO_FLOAT32_MAX_BYTES, _memory_quarter() or AUTO_FLOAT32_MAX_BYTES)
    if size <= limit:
        return mx.float32, (f"float32 (auto: {half} upcast, float32 copy "
                            f"{size / 1e9:.2f} GB <= {limit / 1e9:.2f} GB)")
    return None, (f"{half} as stored (auto: float32 copy {size / 1e9:.2f} GB > "
                  f"{limit / 1e9:.2f} GB, where bf16 decodes faster on this CPU)")


def _measured_choice(timing, size: int) -> Tuple[Optional[mx.Dtype], str]:
    half, limit = timing.shape.half, _memory_quarter() or AUTO_FLOAT32_MAX_BYTES
    if size > limit:
        return None, (f"{half} as stored (auto: float32 copy {size / 1e9:.2f} GB > "
                      f"{limit / 1e9:.2f} GB, a quarter of the memory)")
    if timing.float32_pays:
        return mx.float32, f"float32 (auto: {half} upcast, measured here: {timing.describe()})"
    return None, f"{half} as stored (auto: measured here: {timing.describe()})"


def _name(dtype: mx.Dtype) -> str:
    return next((n for n, d in DTYPES.items() if d == dtype), str(dtype))


def build_model(config: dict, where="config.json") -> nn.Module:
    """The model ``config`` describes (parameters lazy, not loaded)."""
    module = get_model_module(config.get("model_type"))
    try:
        return module.Model(module.ModelArgs.from_dict(config))
    except CheckpointError:
        raise
    except (ValueError, TypeError, KeyError, IndexError) as e:
        raise ModelLoadError(f"{where} describes a model mlx-mtp cannot build: "
                             f"{type(e).__name__}: {e}") from e


def quantize_and_cast(model: nn.Module, weights: dict, quantization: Optional[dict],
                      dtype_choice, timings: str = "rule") -> dict:
    """The one path from sanitized checkpoint weights to loadable ones (single-process and
    distributed loads alike): quantize the modules the checkpoint stores quantized, pick the
    dtype (``choose_dtype``; recorded by ``model.record_load_dtype``) and
    cast the float weights to it, lazily, so a caller evaluates only what it keeps."""
    quantize_like_checkpoint(model, weights, quantization)
    dtype, choice = choose_dtype(dtype_choice, weights, model, timings)
    model.record_load_dtype(dtype, choice)
    if dtype is None:
        return weights
    quantized = _quantized_prefixes(weights)
    return {k: v.astype(dtype) if _castable(k, v, model, quantized) else v
            for k, v in weights.items()}


def loadable_weights(model: nn.Module, path: Path, config: dict, dtype=None,
                     drafter=None, timings: str = "rule") -> dict:
    """The checkpoint's weights, opened lazily, sanitized, quantized and cast as ``model``
    takes them; ``drafter``: a split MTP drafter (``read_drafter``) whose head replaces
    the checkpoint's own; ``timings``: what decides ``dtype="auto"`` (``choose_dtype``)."""
    weights = read_weights(path)
    if drafter is not None:
        weights = split_drafter.merge_into(weights, drafter)
    weights = model.sanitize(weights)
    quantization = layout.config_quantization(config)
    if drafter is not None:
        prefix = next(k for k in weights if layout.is_mtp_key(k)).split("mtp.")[0] + "mtp."
        quantization = dict(quantization or {}, **drafter.quantization_overrides(prefix))
    return quantize_and_cast(model, weights, quantization, dtype, timings)


def load_model(
    path,
    mtp: bool = True,
    mtp_hidden: Optional[str] = None,
    dtype=None,
    lazy: bool = False,
    mtp_model=None,
) -> Tuple[nn.Module, dict]:
    """Build the model for ``path`` and load its weights (MTP head included).

    ``mtp=False`` skips the head (and runs models whose weights lack one). ``dtype``: see
    ``choose_dtype`` (None: as stored; "auto" follows this machine's measured figures,
    measured once when none are stored); the choice made is ``model.load_dtype``.
    ``mtp_model``: a split MTP drafter (directory or hub id) whose head replaces the
    model's own (``split_drafter``), after checking it belongs to this model.
    """
    path = resolve_model_path(path) if not isinstance(path, Path) else path
    config = model_config(path, mtp, mtp_hidden)
    model_type = config.get("model_type")
    if model_type is None:
        raise ModelLoadError(f"{path / 'config.json'} has no model_type.")
    if (mtp and not mtp_model and layout.family(config) in layout.QWEN_FAMILIES
            and layout.config_mtp_layers(config) and not _has_head(path)):
        mtp_model = split_drafter.sibling_drafter(path)  # Name-4bit beside Name-MTP-4bit
        if mtp_model is not None:
            print(f"mlx-mtp: note: {path} has no MTP head; drafting with the one in "
                  f"{mtp_model}, beside it (pass --mtp-model to choose another)",
                  file=sys.stderr)
    drafter = read_drafter(mtp_model, config, path) if mtp and mtp_model else None
    model = build_model(config, path / "config.json")
    weights = loadable_weights(model, path, config, dtype, drafter, timings="measure")
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(f"Weights in {path} do not match the model: {e}") from e
    _upcast_cpu_experts(model)
    model.eval()
    if not lazy:
        check_fits_memory(parameter_bytes(model), str(path))
        mx.eval(model.parameters())
    return model, config


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters, from their shapes (lazy ones are not read)."""
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def check_fits_memory(needed: int, what: str, instead: str = "split it over several "
                      "machines (--distributed, docs/distributed.md)") -> None:
    """Refuse, before any tensor is read, weights over this process's memory limit
    (``mx.set_memory_limit``; MLX's default is sized from the machine's memory)."""
    limit = mx.get_memory_limit()
    if needed > limit:
        raise ModelLoadError(f"{what}: {_in_mb_or_gb(needed)} of weights, over this "
                             f"process's memory limit of {_in_mb_or_gb(limit)}: {instead}")


def _in_mb_or_gb(n: int) -> str:
    return f"{n / (1 << 30):.2f} GB" if n >= 1 << 30 else f"{n / (1 << 20):.2f} MB"


def _has_head(path: Path) -> bool:
    """Whether the checkpoint stores MTP tensors (read from the file headers only)."""
    return any(layout.is_mtp_key(k) for f in weight_files(path)
               for k in read_safetensors_header(f))


def read_drafter(mtp_model, config: dict, path: Path):
    """The split drafter ``mtp_model`` for the model at ``path``; records its depth in
    ``config``."""
    drafter = split_drafter.read_drafter(resolve_model_path(str(mtp_model)))
    split_drafter.check_belongs(drafter, config, path)
    layout.set_config_mtp_layers(config, drafter.num_layers)
    return drafter


# Files that hold a vocabulary (one of them is needed), and the JSON files beside them.
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model",
                         "*.tiktoken", "vocab.txt")
# generation_config.json: the end-of-sequence ids the tokenizer is given.
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                        "added_tokens.json", "generation_config.json")


def _optional_json(path: Path) -> dict:
    """The JSON object in ``path``, or {} when there is no such file."""
    return read_json_object(path) if os.path.lexists(path) else {}


def check_tokenizer_files(path: Path, required: bool = True) -> None:
    """Refuse a checkpoint without tokenizer files (when ``required``), or with damaged
    JSON ones, naming them (the tokenizer libraries would fall back to an empty vocabulary
    or a traceback)."""
    if required and not any(glob.glob(str(path / name)) for name in TOKENIZER_VOCAB_FILES):
        raise ModelLoadError(
            f"{path} has no tokenizer (none of {', '.join(TOKENIZER_VOCAB_FILES)}): copy the "
            "tokenizer files of the model it was made from into it.")
    for name in TOKENIZER_JSON_FILES:
        _optional_json(path / name)


def load_tokenizer(path: Path, config: dict):
    from mlx_lm.utils import load_tokenizer as _load

    check_tokenizer_files(path)
    eos = _optional_json(path / "generation_config.json").get(
        "eos_token_id", config.get("eos_token_id"))
    try:
        return _load(path, eos_token_ids=eos)
    except (ValueError, OSError, TypeError, KeyError, AttributeError, IndexError) as e:
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        raise ModelLoadError(f"The tokenizer in {path} cannot be loaded ({type(e).__name__}: "
                             f"{reason}); the tokenizer files are damaged.") from e


def tokenizer_id_limit(tokenizer) -> int:
    """One past the largest token id the tokenizer can produce (added tokens included)."""
    return max(tokenizer.get_vocab().values(), default=-1) + 1


def check_tokenizer_fits(model, tokenizer, where) -> None:
    """A tokenizer with ids past the embedding table would make prompts read outside it
    (no error on the CPU, nor on the GPU): refuse the pair at load (ModelLoadError)."""
    rows = model.text.args.vocab_size
    limit = tokenizer_id_limit(tokenizer)
    if limit > rows:
        raise ModelLoadError(
            f"The tokenizer of {where} has token ids up to {limit - 1}, but the model's "
            f"embedding table has {rows} rows (vocab_size in config.json): prompts could "
            "hold ids the model cannot embed. Use the tokenizer the checkpoint was made with.")


def load(path: Optional[str] = None, mtp: bool = True, mtp_hidden: Optional[str] = None,
         dtype=None, lazy: bool = False, mtp_model=None, vision: bool = False):
    """Load model and tokenizer. ``path=None`` loads the embedded demo model. ``dtype``:
    None (weights as stored), ``"auto"`` (the CLI's default: float32 on the CPU for small
    half-precision checkpoints), ``"float32"``/``"bfloat16"``/``"float16"`` or an mx.Dtype.
    A checkpoint with a vision tower gets an image encoder that reads the tower at its
    first image; ``vision``: read it now (and refuse a checkpoint without one)."""
    from ...platform import blas, gemv_limits

    blas.ensure_configured()  # Linux CPU: OpenBLAS for multi-row matmuls, checked once
    p = resolve_model_path(path)
    model, config = load_model(p, mtp=mtp, mtp_hidden=mtp_hidden, dtype=dtype, lazy=True,
                               mtp_model=mtp_model)
    tokenizer = load_tokenizer(p, config)  # a bad tokenizer fails before the weights are read
    check_tokenizer_fits(model, tokenizer, p)
    _attach_vision(model, p, config, vision)
    if not lazy:
        check_fits_memory(parameter_bytes(model), str(p))
        mx.eval(model.parameters())
    gemv_limits.apply(tree_flatten(model.parameters()))  # shapes only: lazy loads too
    return model, tokenizer


def _attach_vision(model, path: Path, config: dict, load_now: bool):
    from ..vision.encoder import VISION_FAMILIES, encoder_for

    encoder = encoder_for(path, config, model.load_dtype) \
        if layout.family(config) in VISION_FAMILIES else None
    if encoder is not None:
        model.use_image_encoder(encoder)
    if load_now:
        if encoder is None:
            raise CheckpointError(f"--vision: {path} has no vision tower this package can "
                                  "load (Qwen3.5 / 3.6 checkpoints with vision_config)")
        encoder.load()


def generation_defaults(path: Optional[str]) -> dict:
    """Sampling defaults from generation_config.json, the keys vLLM takes from it
    (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``)."""
    g = _optional_json(resolve_model_path(path) / "generation_config.json")
    keys = {"temperature": "temp", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty"}
    return {ours: g[k] for k, ours in keys.items() if k in g}


def parameter_count(model) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))
