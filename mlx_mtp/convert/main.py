"""``mlx-mtp convert`` and ``mlx-mtp add-mtp``: MLX checkpoints that keep their MTP heads.

Output layout (loads in mlx-mtp with MTP, and in plain mlx-lm without it):

* trunk tensors in ``model.safetensors`` or ``model-0000i-of-0000N.safetensors``
  (mlx-lm globs ``model*.safetensors``);
* every ``mtp.*`` tensor in ``mtp.safetensors``, which mlx-lm never opens
  (its sanitize would choke on the keys) and mlx-mtp reads like any shard;
* ``model.safetensors.index.json`` naming both, ``config.json`` with the
  per-module quantization (``quantization`` and ``quantization_config``),
  and the tokenizer files of the source.

Nothing is written in place. A conversion is staged in a hidden directory next
to the target and renamed at the end; ``add-mtp`` stages a hard-linked copy of
the target, changes it there and swaps the two directories. On any error or
interrupt the staging directory is removed: the source is never touched and the
target is either absent (convert) or unchanged (add-mtp).

This module holds ``convert`` and its command; ``add_mtp`` the add-mtp command,
``checkpoint_io`` writing, staging and the atomic swap, ``common`` the helpers and
quantization scheme shared by both.
"""

from __future__ import annotations

import argparse
import copy
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from .checkpoint_io import (MTP_SHARD, TOKENIZER_FILES, _finalize_config, read_tensors,
                            run_guarded, write_checkpoint)
from .common import (MTP_BITS, ConversionError, QuantScheme, _build_model, _cast,
                     _check_foreign_quant, _check_model_dir, _dequantize, _fmt_bytes,
                     _incomplete_head, _param_bytes, _print_summary, _summarize, _warn)
from . import block_drafter as block_drafter_io
from . import split_mtp as split_mtp_io
from ..models.io import hub
from ..models import UnsupportedModelError, refuse_not_yet
from ..models.blocks.attention_trunk import count_checkpoint_mtp_layers, family_of
from ..models.io.layout import (QWEN_FAMILIES, CheckpointError, MissingMTPWeightsError,
                             config_mtp_layers, config_quantization, count_mtp_layers, family,
                             is_mtp_key, set_config_mtp_layers, text_config)
from ..models.io.loader import load_config, quantize_like_checkpoint, weight_files
from ..models.io.split_drafter import is_drafter_config
from ..drafters.block import dsv4_dspark
from ..drafters.block.config import KIND_NAMES

DEFAULT_MAX_SHARD_GB = 5.0
Q_BITS = (2, 3, 4, 5, 6, 8)
Q_GROUP_SIZES = (32, 64, 128)
DEFAULT_MTP_BITS = 8  # when quantizing and --mtp-bits is not given
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


# --------------------------------------------------------------------------
# Reading the source
# --------------------------------------------------------------------------

@dataclass
class _Source:
    model: nn.Module
    config: dict  # config.json as stored (mtp count fixed up if needed)
    mtp_layers: int
    quantized: bool
    files: List[Path]


def _refuse_split_drafter(src: Path, config: dict, weights: dict) -> None:
    """A split drafter is a head without a trunk: converting it cannot give a model."""
    if is_drafter_config(config) and not any("embed_tokens" in k for k in weights):
        raise ConversionError(
            f"{src} is a split MTP drafter (model_type {config.get('model_type')!r}: the head "
            "alone, mlx-vlm's layout), not a model to convert. Use it beside its trunk "
            f"(`--model TRUNK --mtp-model {src}`), or convert the original release with "
            "--split-mtp to write a new pair.")


def _load_source(src: Path, verbose: bool) -> _Source:
    config = load_config(src)
    refuse_not_yet(config.get("model_type"))  # before reading any weights
    files = weight_files(src)
    weights = read_tensors(files, verbose=verbose)
    _refuse_split_drafter(src, config, weights)
    attention_trunk = family_of(config) is not None  # reads FP8 block-scaled weights
    _check_foreign_quant(weights, src, (".weight_scale_inv",) if attention_trunk else ())

    n_keys = (count_mtp_layers(k for k in weights if is_mtp_key(k))
              or count_checkpoint_mtp_layers(config, weights))
    n_config = config_mtp_layers(config)
    if n_keys == 0 and any(is_mtp_key(k) for k in weights):
        n_keys = max(n_config, 1)
    if n_keys and n_keys != n_config:
        _warn(f"{src}/config.json says {n_config} MTP layer(s) but the weights hold "
              f"{n_keys}; keeping {n_keys}.", verbose)
        set_config_mtp_layers(config, n_keys)

    model = _build_model(config, n_keys)
    try:
        weights = model.sanitize(weights)
    except MissingMTPWeightsError as e:
        raise ConversionError(_incomplete_head(src, e, "The checkpoint looks damaged; "
                                                        "download it again.")) from e
    quantized = any(k.endswith(".scales") for k in weights)
    if quantized:
        quantize_like_checkpoint(model, weights, config_quantization(config))
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ConversionError(
            f"The weights in {src} do not match its config.json: {e}. Check that the "
            "download is complete and config.json belongs to these weights."
        ) from e
    return _Source(model, config, n_keys, quantized, files)



# --------------------------------------------------------------------------
# convert
# --------------------------------------------------------------------------

def _config_dtype(config: dict) -> Optional[str]:
    for c in (config, text_config(config)):
        for key in ("torch_dtype", "dtype"):
            if c.get(key) in DTYPES:
                return c[key]
    return None


def _validate_quant_args(quantize, q_bits, q_group_size, mtp_bits, dequantize):
    if quantize and dequantize:
        raise ConversionError("Choose either -q/--quantize or --dequantize, not both.")
    if q_bits not in Q_BITS:
        raise ConversionError(f"--q-bits must be one of {Q_BITS} (got {q_bits}).")
    if q_group_size not in Q_GROUP_SIZES:
        raise ConversionError(f"--q-group-size must be one of {Q_GROUP_SIZES} (got {q_group_size}).")
    if mtp_bits is not None and mtp_bits not in MTP_BITS:
        raise ConversionError(
            f"--mtp-bits must be one of {MTP_BITS} (16 keeps the head in floating point); "
            f"got {mtp_bits}."
        )
    if mtp_bits is not None and dequantize:
        raise ConversionError("--mtp-bits cannot be combined with --dequantize (the output is "
                              "all floating point).")


def _refuse_bad_source(source, src, dst, quantize, mtp_bits, dequantize, drafter_dir,
                       verbose):
    """Combinations of source and options that cannot give a useful checkpoint."""
    if source.quantized and quantize:
        raise ConversionError(
            f"{src} is already quantized. Quantize from the original floating-point "
            "checkpoint, or first convert it back with --dequantize."
        )
    if source.quantized and mtp_bits is not None:
        raise ConversionError(
            f"{src} is already quantized, so --mtp-bits cannot re-quantize its head. Convert "
            "from the original checkpoint, or replace the head with "
            "`mlx-mtp add-mtp --force --mtp-bits N --source ORIGINAL`."
        )
    if dequantize and not source.quantized:
        raise ConversionError(f"{src} is not quantized: there is nothing to --dequantize.")
    if drafter_dir is not None and family(source.config) not in QWEN_FAMILIES:
        raise ConversionError(
            f"--split-mtp writes mlx-vlm's qwen3_5_mtp drafter layout, which holds Qwen3.5/3.6 "
            f"and Qwen3-Next heads; {src} is a {family(source.config)!r} model. Convert "
            "without --split-mtp (the head stays in mtp.safetensors).")
    if source.mtp_layers == 0 and drafter_dir is not None:
        raise ConversionError(f"{src} has no MTP head (no mtp.* tensors): there is nothing for "
                              "--split-mtp to write. Convert from the original release.")
    if source.mtp_layers == 0:
        _warn(
            f"{src} has no MTP weights (mtp.*): converting the trunk only. Graft the head "
            f"later with `mlx-mtp add-mtp --model {dst} --source ORIGINAL_HF_CHECKPOINT`.",
            verbose,
        )


def _set_precision(source, quantize, q_bits, q_group_size, mtp_bits, dtype, dequantize,
                   verbose):
    """Dequantize, cast and quantize ``source.model`` in place; returns the config's
    quantization record (None: float) and the dtype cast to (None: as stored)."""
    model, config = source.model, source.config
    if dequantize:
        _dequantize(model)
    if dtype is None:
        dtype = _config_dtype(config)  # as mlx-lm does: the dtype the config declares
    if dtype is not None:
        _cast(model, DTYPES[dtype], model.cast_predicate)
    if dequantize:
        return None, dtype
    if source.quantized:
        return config_quantization(config), dtype  # passed through unchanged
    if mtp_bits is None:
        mtp_bits = DEFAULT_MTP_BITS if quantize else 16
    scheme = QuantScheme(
        bits=q_bits if quantize else None,
        group_size=q_group_size,
        mtp_bits=None if (mtp_bits == 16 or source.mtp_layers == 0) else mtp_bits,
        mtp_group_size=q_group_size,
    )
    if not scheme.active:
        return None, dtype
    record = scheme.apply(model, verbose=verbose)
    # Attention-trunk families: the MTP layer under the checkpoint's own prefix.
    record = {model.text.checkpoint_name(k): v for k, v in record.items()}
    return dict(scheme.default(), **record), dtype


def _output_config(config, quantization, dtype, verbose) -> dict:
    out_config = _finalize_config(config, quantization)
    if family(out_config) in QWEN_FAMILIES and "full_attention_interval" not in text_config(
            out_config):
        _warn("the attention pattern (layer_types) is not periodic: mlx-mtp loads the output, "
              "plain mlx-lm (which reads only full_attention_interval) cannot.", verbose)
    if dtype is not None:
        for c in (out_config, text_config(out_config)):
            for key in ("torch_dtype", "dtype"):
                if key in c:
                    c[key] = dtype
    return out_config


def _write(model, src, dst, out_config, quantization, drafter_dir, max_shard_size_gb,
           verbose):
    """Write the checkpoint (and the split drafter: both or neither); returns the weight map,
    the per-part size rows and the total size."""
    weights = dict(tree_flatten(model.parameters()))
    rows = _summarize(weights, model)
    # The MTP layer under its checkpoint names, in its released form (step3p5: 1+w norms).
    weights = model.text.checkpoint_mtp_names(weights)
    if dsv4_dspark.declares_stages(out_config):  # kept as released (float), for its loader
        weights.update(dsv4_dspark.stage_weights(src))
    if drafter_dir is not None:
        weights, trunk_q, head, head_q = split_mtp_io.split_head(weights, quantization)
        drafter_from = copy.deepcopy(out_config)
        for key in ("quantization", "quantization_config"):
            out_config.pop(key, None)
        if trunk_q:
            out_config["quantization"], out_config["quantization_config"] = (
                trunk_q, copy.deepcopy(trunk_q))
    total_size = _param_bytes(weights)
    # Hand the tensors to the writer only, so each shard is freed once written.
    model.update(tree_map(lambda _: mx.array([]), model.parameters()))
    weight_map = write_checkpoint(dst, weights, out_config, tokenizer_from=src,
                                  max_shard_bytes=int(max_shard_size_gb * (1 << 30)),
                                  verbose=verbose,
                                  is_head=model.text.is_mtp_key)
    if drafter_dir is not None:
        try:
            split_mtp_io.write_drafter(drafter_dir, head, drafter_from, head_q, src, verbose)
        except BaseException:
            shutil.rmtree(dst, ignore_errors=True)  # both or neither
            raise
    return weight_map, rows, total_size


def _block_drafter_target(draft_model, draft_kind, draft_path, draft_q_bits, dst):
    """Where the block drafter ``--draft-model`` names goes (None: none named)."""
    if draft_model is None:
        if draft_kind or draft_path or draft_q_bits:
            raise ConversionError("--draft-kind, --draft-path and --draft-q-bits apply to the "
                                  "drafter --draft-model names; add it or drop them.")
        return None
    return block_drafter_io.check_target(draft_path or block_drafter_io.default_target(dst), dst)


def _write_block_drafter(out, block, dst, drafter_dir, verbose):
    """The block drafter beside the written checkpoint: all of them or none."""
    tensors, config, kind = block
    try:
        block_drafter_io.write(out, tensors, config, verbose)
    except BaseException:
        for written in (dst, drafter_dir):
            if written is not None:
                shutil.rmtree(written, ignore_errors=True)
        raise
    if verbose:
        bits = (config.get("quantization") or {}).get("bits")
        print(f"[mlx-mtp] wrote the {kind} drafter {out} "
              f"({f'{bits}-bit' if bits else 'as stored'}; use: --model {dst} "
              f"--draft-model {out})")


def _report(source, dst, drafter_dir, tokenizer_files, rows, total_size):
    extra = [f"MTP head: {source.mtp_layers} layer(s) kept in {MTP_SHARD}"
             if source.mtp_layers else "MTP head: none in the source (trunk only)"]
    if drafter_dir is not None:
        extra[0] = (f"MTP head: {source.mtp_layers} layer(s) in the drafter {drafter_dir} "
                    f"(use: --model {dst} --mtp-model {drafter_dir})")
    if not tokenizer_files:
        extra.append("no tokenizer files found in the source")
    _print_summary(f"[mlx-mtp] wrote {dst} ({_fmt_bytes(total_size)}):", rows, extra)


def convert(
    hf_path,
    mlx_path,
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    mtp_bits: Optional[int] = None,
    dtype: Optional[str] = None,
    dequantize: bool = False,
    *,
    max_shard_size_gb: float = DEFAULT_MAX_SHARD_GB,
    split_mtp=None,
    draft_model=None,
    draft_kind: Optional[str] = None,
    draft_path=None,
    draft_q_bits: Optional[int] = None,
    verbose: bool = True,
) -> dict:
    """Convert a local Hugging Face (or MLX) checkpoint to MLX, keeping its MTP head.

    ``mtp_bits``: precision of the MTP head (4, 8, or 16 = float). Default: 8 bits
    when quantizing, else float. Router gates are always kept at 8 bits.
    ``dtype``: cast floating-point weights (``A_log`` excepted) before quantizing;
    default: the config's ``torch_dtype``/``dtype`` (as mlx-lm), else the stored dtypes.
    ``dequantize``: the reverse direction, for an MLX-quantized source. ``split_mtp``:
    write the head to this directory as a split drafter (mlx-vlm's layout) and the trunk
    alone to ``mlx_path``, as mlx-lm would. ``draft_model``: a block drafter (path or hub
    id; ``draft_kind`` where its config cannot tell) checked against the model and written
    to ``draft_path`` (default: ``MLX_PATH-drafter``), its weights at ``draft_q_bits`` bits
    (None: as stored). Returns a summary dict.
    """
    _validate_quant_args(quantize, q_bits, q_group_size, mtp_bits, dequantize)
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"--dtype must be one of {sorted(DTYPES)} (got {dtype!r}).")
    if max_shard_size_gb <= 0:
        raise ConversionError("The maximum shard size must be positive.")
    src = _check_model_dir(hf_path, "Source", hub_files=hub.MODEL_FILES)
    dst = Path(mlx_path).expanduser()
    if dst.exists() or dst.is_symlink():
        raise ConversionError(
            f"Cannot write to {dst}: it already exists. Delete it or pick a new --mlx-path "
            "(convert never overwrites; to add an MTP head to an existing model use "
            "`mlx-mtp add-mtp`)."
        )
    drafter_dir = None if split_mtp is None else split_mtp_io.check_target(split_mtp, dst)
    block_dir = _block_drafter_target(draft_model, draft_kind, draft_path, draft_q_bits, dst)
    if not dst.parent.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        source = _load_source(src, verbose)
    except (CheckpointError, UnsupportedModelError) as e:
        raise ConversionError(str(e)) from e
    _refuse_bad_source(source, src, dst, quantize, mtp_bits, dequantize, drafter_dir, verbose)
    block = None if block_dir is None else block_drafter_io.prepare(
        draft_model, draft_kind, draft_q_bits, q_group_size, source.model)
    quantization, dtype = _set_precision(source, quantize, q_bits, q_group_size, mtp_bits,
                                         dtype, dequantize, verbose)
    out_config = _output_config(source.config, quantization, dtype, verbose)
    weight_map, rows, total_size = _write(source.model, src, dst, out_config, quantization,
                                          drafter_dir, max_shard_size_gb, verbose)
    if block is not None:
        _write_block_drafter(block_dir, block, dst, drafter_dir, verbose)
    tokenizer_files = [f.name for f in sorted(dst.iterdir())
                       if f.name in TOKENIZER_FILES or f.suffix == ".tiktoken"]
    if verbose:
        _report(source, dst, drafter_dir, tokenizer_files, rows, total_size)
    return {
        "path": str(dst),
        "mtp_layers": source.mtp_layers,
        "quantization": quantization,
        "files": sorted(set(weight_map.values())),
        "tokenizer_files": tokenizer_files,
        "parts": rows,
        "total_size": total_size,
        "drafter": None if drafter_dir is None else str(drafter_dir),
        "block_drafter": None if block is None else {
            "path": str(block_dir), "kind": block[2],
            "quantization": block[1].get("quantization")},
    }


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--hf-path", "--model", dest="hf_path", required=True,
                        help="Hugging Face checkpoint: a local directory (single file or "
                             "sharded) or a hub id org/name[@revision]; or an MLX model for "
                             "--dequantize.")
    parser.add_argument("--mlx-path", default="mlx_model",
                        help="Output directory; must not exist (default: mlx_model).")
    parser.add_argument("-q", "--quantize", action="store_true",
                        help="Quantize the weights (router gates stay at 8 bits).")
    parser.add_argument("--q-bits", type=int, default=4, choices=Q_BITS,
                        help="Bits per weight for the trunk (default: 4).")
    parser.add_argument("--q-group-size", type=int, default=64, choices=Q_GROUP_SIZES,
                        help="Quantization group size (default: 64).")
    parser.add_argument("--mtp-bits", type=int, default=None, choices=MTP_BITS,
                        help="Precision of the MTP head: 4, 8, or 16 (floating point). "
                             f"Default: {DEFAULT_MTP_BITS} with -q, else floating point.")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                        help="Cast floating-point weights (A_log excepted). Default: the "
                             "config's torch_dtype, else the stored dtypes.")
    parser.add_argument("-d", "--dequantize", action="store_true",
                        help="Dequantize an MLX-quantized model back to floating point.")
    parser.add_argument("--split-mtp", default=None, metavar="DIR",
                        help="Write the MTP head to DIR as a separate drafter (mlx-vlm's split "
                             "layout, as mlx-community's ...-MTP repos) and the trunk alone to "
                             "--mlx-path, as mlx_lm.convert would. Load the pair with "
                             "--model MLX_PATH --mtp-model DIR.")
    parser.add_argument("--draft-model", default=None, metavar="PATH|ID",
                        help="A block drafter (DFlash, DFlash2, DSpark, EAGLE-3) for this model, "
                             "checked against it and written beside it (--draft-path) in its "
                             "published layout; load the pair with --model MLX_PATH "
                             "--draft-model DRAFT_PATH.")
    parser.add_argument("--draft-kind", default=None, choices=KIND_NAMES,
                        help="The drafter's kind, where its config does not say.")
    parser.add_argument("--draft-path", default=None, metavar="DIR",
                        help="Where to write the drafter (default: MLX_PATH-drafter).")
    parser.add_argument("--draft-q-bits", type=int, default=None,
                        choices=block_drafter_io.DRAFT_Q_BITS,
                        help="Quantize the drafter's weights to 4 or 8 bits (group size "
                             "--q-group-size). Default: as stored.")
    parser.add_argument("--max-shard-size", type=float, default=DEFAULT_MAX_SHARD_GB,
                        metavar="GB", help="Maximum size of a weight file in GB (default: 5).")
    return parser


def run(args) -> int:
    return run_guarded("convert", lambda: convert(
        args.hf_path, args.mlx_path, quantize=args.quantize, q_bits=args.q_bits,
        q_group_size=args.q_group_size, mtp_bits=args.mtp_bits, dtype=args.dtype,
        dequantize=args.dequantize,
        max_shard_size_gb=getattr(args, "max_shard_size", DEFAULT_MAX_SHARD_GB),
        split_mtp=getattr(args, "split_mtp", None),
        draft_model=getattr(args, "draft_model", None),
        draft_kind=getattr(args, "draft_kind", None),
        draft_path=getattr(args, "draft_path", None),
        draft_q_bits=getattr(args, "draft_q_bits", None),
    ))


