"""Shared by ``mlx-mtp convert`` and ``mlx-mtp add-mtp``: the error type, config and
key helpers, input checks, the quantization scheme and model-level operations
(dequantize, cast, report).
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path, tree_unflatten
from tqdm import tqdm

from ..models.io.layout import CheckpointError, is_mtp_key, text_config
from ..models.interface import ModelInterface
from ..models.io.loader import build_model, weight_files

MTP_BITS = (4, 8, 16)  # 16 = keep the head in floating point
ROUTER_QUANT = {"group_size": 64, "bits": 8}
# Checkpoint formats whose packed weights mlx-mtp cannot read.
FOREIGN_QUANT_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".input_scale", ".qweight",
                          ".qzeros", ".g_idx")


class ConversionError(ValueError):
    """A conversion that cannot go ahead; the message says what is wrong and how to fix it."""


# --------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------

def _is_router(path: str) -> bool:
    return path.endswith("mlp.gate") or path.endswith("shared_expert_gate")


def _build_model(config: dict, mtp_layers: int):
    """Our model for ``config`` with ``mtp_layers`` MTP layers (parameters stay lazy)."""
    config = copy.deepcopy(config)
    if config.get("model_type") is None:
        raise ConversionError("config.json has no model_type; is this a Hugging Face checkpoint?")
    text_config(config)["mtp_num_hidden_layers"] = mtp_layers  # read first of the aliases
    return build_model(config)


def _check_model_dir(path: Path, role: str, hub_files=None) -> Path:
    """A local checkpoint directory; with ``hub_files`` (patterns) a hub id is downloaded."""
    from ..models.io import hub

    if hub_files and hub.is_repo_id(path):
        path = hub.snapshot(str(path), hub_files)
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ConversionError(
            f"{role} {path} does not exist or is not a directory. Pass the local directory "
            "of a checkpoint (config.json + *.safetensors)"
            + (" or a Hugging Face id (org/name[@revision])." if hub_files else ".")
        )
    if not (path / "config.json").exists():
        raise ConversionError(f"{role} {path} has no config.json; is it a model directory?")
    try:
        files = weight_files(path)
    except CheckpointError as e:
        raise ConversionError(str(e)) from e
    if not files:
        raise ConversionError(
            f"{role} {path} has no *.safetensors weight files. Only safetensors checkpoints "
            "are supported (not .bin, .gguf or .pt)."
        )
    return path

def _check_foreign_quant(keys: Iterable[str], path: Path, readable: tuple = ()):
    """``readable``: suffixes the model's sanitize dequantizes (FP8 ``.weight_scale_inv``)."""
    bad = [k for k in keys if k.endswith(FOREIGN_QUANT_SUFFIXES) and not k.endswith(readable)]
    if bad:
        raise ConversionError(
            f"{path} stores pre-quantized weights ({bad[0]}, ...: FP8/AWQ/GPTQ-style) that "
            "mlx-mtp cannot read. Convert from the BF16 release of the model instead."
        )


def _param_bytes(params: Dict[str, mx.array]) -> int:
    return sum(v.nbytes for v in params.values())


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GB"  # pragma: no cover


# --------------------------------------------------------------------------
# Quantization scheme
# --------------------------------------------------------------------------

@dataclass
class QuantScheme:
    """Bits for the trunk and for the MTP head; ``None`` keeps a part in floating point."""

    bits: Optional[int]
    group_size: int
    mtp_bits: Optional[int]
    mtp_group_size: int

    @property
    def active(self) -> bool:
        return self.bits is not None or self.mtp_bits is not None

    def params(self, path: str, module) -> Optional[dict]:
        """Quantization parameters for the module at ``path`` (None: keep it float)."""
        if not hasattr(module, "to_quantized"):
            return None
        mtp = is_mtp_key(path + ".")
        bits, group_size = (self.mtp_bits, self.mtp_group_size) if mtp else (
            self.bits, self.group_size)
        if bits is None:
            return None
        if _is_router(path):
            # Router gates are tiny and steer every token: always 8 bits.
            bits, group_size = ROUTER_QUANT["bits"], ROUTER_QUANT["group_size"]
        if module.weight.shape[-1] % group_size:
            return None
        return {"group_size": group_size, "bits": bits}

    def default(self) -> dict:
        """The config's top-level entry: the trunk's parameters (the head's if no trunk)."""
        bits, group_size = (self.bits, self.group_size) if self.bits is not None else (
            self.mtp_bits, self.mtp_group_size)
        return {"group_size": group_size, "bits": bits, "mode": "affine"}

    def apply(self, model: nn.Module, prefix: str = "", default: Optional[dict] = None,
              verbose: bool = True) -> dict:
        """Quantize ``model`` (lazily) and return the per-path entries for config.json.

        ``prefix`` turns ``model``'s paths into the checkpoint's; ``default`` is the
        config's top-level entry: modules quantized otherwise get their own entry,
        and MTP modules kept in floating point on purpose get ``false`` (which
        mlx-lm's and our loaders read as "not quantized").
        """
        default = default or self.default()
        record = {}
        n_modules = sum(1 for _, m in model.named_modules() if hasattr(m, "to_quantized"))
        bar = tqdm(total=n_modules, desc="quantizing", unit="module", disable=not verbose)

        def predicate(path, module):
            if not hasattr(module, "to_quantized"):
                return False
            bar.update(1)
            full = prefix + path
            params = self.params(full, module)
            if params is None:
                if is_mtp_key(full + ".") and self.mtp_bits is None:
                    record[full] = False
                return False
            if (params["group_size"], params["bits"], "affine") != (
                    default.get("group_size"), default.get("bits"),
                    default.get("mode", "affine")):
                record[full] = dict(params)
            return dict(params, mode="affine")

        with bar:
            nn.quantize(model, default.get("group_size") or 64, default.get("bits") or 4,
                        class_predicate=predicate)
        return record


# --------------------------------------------------------------------------
# Model-level operations
# --------------------------------------------------------------------------

def _dequantize(model: nn.Module) -> int:
    """Replace every quantized layer by its floating-point equivalent; returns the count."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    replaced = []
    for path, m in model.named_modules():
        if not isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)):
            continue
        w = mx.dequantize(m.weight, m.scales, m.get("biases"), m.group_size, m.bits,
                          mode=m.mode)
        has_bias = "bias" in m
        if isinstance(m, nn.QuantizedEmbedding):
            f = nn.Embedding(w.shape[0], w.shape[1])
        elif isinstance(m, QuantizedSwitchLinear):
            f = SwitchLinear(w.shape[2], w.shape[1], w.shape[0], bias=has_bias)
        else:
            f = nn.Linear(w.shape[1], w.shape[0], bias=has_bias)
        f.weight = w
        if has_bias:
            f.bias = m.bias
        replaced.append((path, f))
    if replaced:
        model.update_modules(tree_unflatten(replaced))
    return len(replaced)


def _cast(module: nn.Module, dtype: mx.Dtype, keep=ModelInterface.cast_predicate):
    """Cast floating-point parameters to ``dtype``, except those ``keep`` (a model's
    ``cast_predicate``) leaves as they are."""

    def cast(path, v):
        if keep(path) and mx.issubdtype(v.dtype, mx.floating):
            return v.astype(dtype)
        return v

    module.update(tree_map_with_path(cast, module.parameters()))


def _incomplete_head(src: Path, error: Exception, fix: str) -> str:
    detail = str(error).split(" This usually means")[0].split("weights lack the MTP head: ")[-1]
    return f"The MTP head in {src} is incomplete: {detail.rstrip('.')}. {fix}"


def _summarize(params: Dict[str, mx.array], model: nn.Module) -> List[dict]:
    """Rows of (part, tensors, bytes, precision) for the final report."""
    kinds = {}
    for path, m in model.named_modules():
        if "scales" in m and hasattr(m, "bits"):
            kinds[path] = f"{m.bits}-bit (group {m.group_size})"
    rows = {}
    for k, v in params.items():
        part = "MTP head" if is_mtp_key(k) else "trunk"
        module = k.rsplit(".", 1)[0]
        precision = kinds.get(module) or str(v.dtype).replace("mlx.core.", "")
        row = rows.setdefault((part, precision), {"part": part, "precision": precision,
                                                  "tensors": 0, "bytes": 0})
        if not k.endswith((".scales", ".biases")) or module not in kinds:
            row["tensors"] += 1
        row["bytes"] += v.nbytes
    return sorted(rows.values(), key=lambda r: (r["part"] != "trunk", -r["bytes"]))


def _print_summary(title: str, rows: List[dict], extra: List[str]):
    print(title)
    for r in rows:
        print(f"  {r['part']:<9} {r['precision']:<22} {r['tensors']:>6} tensors "
              f"{_fmt_bytes(r['bytes']):>10}")
    for line in extra:
        print(f"  {line}")


def _warn(message: str, verbose: bool = True):
    if verbose:
        print(f"[mlx-mtp] warning: {message}", file=sys.stderr)
