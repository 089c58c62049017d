"""``convert --split-mtp DIR``: the trunk as ``mlx_lm.convert`` writes it, and the MTP head
as a separate drafter directory in mlx-vlm's split layout (``models/split_drafter.py``),
staged and renamed into place like every conversion."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx
from tqdm import tqdm

from .checkpoint_io import TOKENIZER_FILES, _copy_tokenizer, _save_shard, _staging, _write_json
from .common import ConversionError, _param_bytes
from ..models.io.layout import count_mtp_layers, is_mtp_key
from ..models.io.split_drafter import drafter_config


def check_target(out, mlx_path) -> Path:
    out = Path(out).expanduser()
    if out.exists() or out.is_symlink():
        raise ConversionError(f"Cannot write the drafter to {out}: it already exists. Delete "
                              "it or pick a new --split-mtp directory.")
    if out.absolute() == Path(mlx_path).expanduser().absolute():
        raise ConversionError("--split-mtp must name another directory than --mlx-path.")
    return out


def split_head(weights: Dict[str, mx.array], quantization: Optional[dict]
               ) -> Tuple[Dict[str, mx.array], Optional[dict], Dict[str, mx.array], Optional[dict]]:
    """(trunk weights, trunk quantization, head weights with bare names, head quantization
    keyed by bare module path, one explicit entry per quantized module)."""
    trunk = {k: v for k, v in weights.items() if not is_mtp_key(k)}
    head_keys = [k for k in weights if is_mtp_key(k)]
    if not head_keys:
        raise ConversionError("The source has no MTP head (no mtp.* tensors): there is nothing "
                              "for --split-mtp to write. Convert from the original release.")
    prefix = head_keys[0].split("mtp.")[0] + "mtp."
    head = {k[len(prefix):]: weights[k] for k in head_keys}
    trunk_q = head_q = None
    if quantization:
        trunk_q = {k: v for k, v in quantization.items() if not is_mtp_key(k + ".")}
        default = {k: quantization[k] for k in ("group_size", "bits", "mode") if k in quantization}
        modules = [k[: -len(".scales")] for k in head if k.endswith(".scales")]
        entries = {}
        for m in modules:
            entry = quantization.get(prefix + m)
            entries[m] = dict(default, **entry) if isinstance(entry, dict) else dict(default)
        if entries:  # the head's most common setting as its default, every module explicit
            common = [json.dumps(e, sort_keys=True) for e in entries.values()]
            head_q = dict(json.loads(max(set(common), key=common.count)), **entries)
    return trunk, trunk_q, head, head_q


def write_drafter(out: Path, head: Dict[str, mx.array], config: dict,
                  quantization: Optional[dict], tokenizer_from: Path,
                  verbose: bool = True) -> Path:
    """Write the drafter directory ``out`` atomically (staged, then renamed)."""
    depth = count_mtp_layers("mtp." + k for k in head)
    cfg = drafter_config(config, depth, quantization)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _staging(out, verbose) as tmp:
        with tqdm(total=_param_bytes(head), desc="writing the drafter", unit="B",
                  unit_scale=True, disable=not verbose) as bar:
            _save_shard(tmp / "model.safetensors", head, bar)
        _write_json(tmp / "config.json", cfg)
        _copy_tokenizer(Path(tokenizer_from), tmp, TOKENIZER_FILES + ("vocab.json",))
        tmp.rename(out)
    return out
