"""``convert --draft-model SPEC``: a block drafter (DFlash, DFlash2, DSpark, EAGLE-3) written
beside the converted trunk, in its published layout (the names and ``config.json`` it
shipped with), so ``--draft-model DIR`` loads it as it loads the original.

Only the tensors the drafter uses are written: a copy of the target's embedding or head that
its packaging ships (EAGLE-3's frozen embedding, a verifier's tensors) stays with the trunk.
``--draft-q-bits`` quantizes the drafter's linear layers and its own embedding/head in place
under their published names (``.weight`` + ``.scales``/``.biases``, the quantization recorded
in ``config.json`` as mlx-lm does); norms, convolution kernels and index tables stay as
stored. The directory is staged and renamed like every conversion.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from tqdm import tqdm

from .checkpoint_io import _save_shard, _staging, _write_json
from .common import ConversionError, _param_bytes
from ..drafters.block import KINDS
from ..drafters.block import load as block_load
from ..drafters.block.config import fit_to_tensors
from ..models.io.files import load_safetensors
from ..models.io.loader import weight_files

DRAFT_Q_BITS = (4, 8)


def check_target(out, mlx_path) -> Path:
    out = Path(out).expanduser()
    if out.exists() or out.is_symlink():
        raise ConversionError(f"Cannot write the drafter to {out}: it already exists. Delete "
                              "it or pick a new --draft-path directory.")
    if out.absolute() == Path(mlx_path).expanduser().absolute():
        raise ConversionError("--draft-path must name another directory than --mlx-path.")
    return out


def default_target(mlx_path) -> Path:
    """Beside the trunk: ``MLX_PATH-drafter``."""
    dst = Path(mlx_path).expanduser()
    return dst.with_name(dst.name + "-drafter")


def _published_tensors(drafter: nn.Module, raw: Dict[str, mx.array], group_size: int
                       ) -> Tuple[Dict[str, mx.array], set]:
    """(the stored tensors the drafter uses, under their stored names; the stored names of
    the weights that can be quantized: a linear layer's or the drafter's own embedding's,
    rows divisible by ``group_size``). ``sanitize`` renames without copying, so a stored
    tensor is matched to its module by identity."""
    used = drafter.sanitize(dict(raw))
    module_name = {id(v): k for k, v in used.items()}
    kept = {k: v for k, v in raw.items() if id(v) in module_name or k in used}
    modules = dict(drafter.named_modules())
    quantizable = set()
    for key, value in kept.items():
        name = module_name.get(id(value), key)
        module = modules.get(name[: -len(".weight")]) if name.endswith(".weight") else None
        if (key.endswith(".weight") and isinstance(module, (nn.Linear, nn.Embedding))
                and value.shape[-1] % group_size == 0):
            quantizable.add(key)
    return kept, quantizable


def _quantize(tensors: Dict[str, mx.array], names: set, bits: int, group_size: int
              ) -> Dict[str, mx.array]:
    out = {}
    for key, value in tensors.items():
        if key not in names:
            out[key] = value
            continue
        base = key[: -len(".weight")]
        out[key], out[base + ".scales"], out[base + ".biases"] = mx.quantize(
            value, group_size=group_size, bits=bits)
    return out


def prepare(spec: str, kind: Optional[str], bits: Optional[int], group_size: int,
            model=None) -> Tuple[Dict[str, mx.array], dict, str]:
    """(tensors, ``config.json``, kind) of the drafter ``spec`` names, checked against the
    trunk ``model`` (when given), quantized to ``bits`` (None: as stored)."""
    kind = block_load.kind_for(spec, kind)
    if kind is None:
        raise ConversionError(f"--draft-model {spec} is a split MTP drafter, not a block "
                              "drafter; write one with --split-mtp instead.")
    if bits is not None and bits not in DRAFT_Q_BITS:
        raise ConversionError(f"--draft-q-bits must be one of {DRAFT_Q_BITS} (got {bits}).")
    path, config = block_load.read_config(spec)
    if bits is not None and config.get("quantization"):
        raise ConversionError(f"--draft-model {spec} is already quantized; quantize from the "
                              "floating-point drafter, or copy it without --draft-q-bits.")
    if model is not None:
        block_load.check_fits(block_load.load_block_drafter(spec, kind), model,
                              f"--draft-model {spec}")
    raw = {k: v for f in weight_files(path) for k, v in load_safetensors(f).items()}
    parsed = block_load.parse(config, kind, str(spec))
    drafter = KINDS[kind](fit_to_tensors(parsed, raw))
    tensors, quantizable = _published_tensors(drafter, raw, group_size)
    config = copy.deepcopy(config)
    if bits is not None and quantizable:
        tensors = _quantize(tensors, quantizable, bits, group_size)
        record = {"group_size": group_size, "bits": bits, "mode": "affine"}
        config["quantization"], config["quantization_config"] = record, dict(record)
    return tensors, config, kind


def write(out: Path, tensors: Dict[str, mx.array], config: dict, verbose: bool = True) -> Path:
    """Write the drafter directory ``out`` atomically (staged, then renamed)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with _staging(out, verbose) as tmp:
        with tqdm(total=_param_bytes(tensors), desc="writing the block drafter", unit="B",
                  unit_scale=True, disable=not verbose) as bar:
            _save_shard(tmp / "model.safetensors", tensors, bar)
        _write_json(tmp / "config.json", config)
        tmp.rename(out)
    return out
