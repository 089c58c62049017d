"""``mlx-mtp add-mtp``: graft the MTP head of an original checkpoint into an MLX model
(e.g. an mlx-lm conversion that stripped it), via a staged copy swapped in atomically.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from tqdm import tqdm

from ..models.io import hub
from .checkpoint_io import (MTP_SHARD, run_guarded, read_tensors, _checkpoint_tensors, _link_tree,
                            _recover_stale, _save_shard, _staging, _swap_into_place, _write_index,
                            _write_json)
from .common import (MTP_BITS, ConversionError, QuantScheme, _build_model, _cast,
                     _check_foreign_quant, _check_model_dir, _dequantize, _incomplete_head,
                     _param_bytes, _print_summary, _summarize)
from ..models import UnsupportedModelError, get_model_module
from ..models.blocks.attention_trunk import family_of, mtp_key_predicate
from ..models.blocks.hybrid import HybridArgs
from ..models.io.layout import (MissingMTPWeightsError, args_dict, config_mtp_layers,
                             config_quantization, count_mtp_layers, family, is_mtp_key,
                             set_config_mtp_layers, text_config)
from ..models.io.loader import load_config, quantize_like_checkpoint

# Text-config fields that must agree for a head to fit a trunk.
_SHAPE_FIELDS = (
    "hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size",
)


def _shape_args(cfg: dict):
    if family_of(cfg) is not None:  # attention-trunk families: the config's own fields
        text = text_config(cfg)
        return SimpleNamespace(**{k: text.get(k) for k in _SHAPE_FIELDS + ("num_experts",)})
    return HybridArgs.from_dict(args_dict(cfg))


def _config_mismatches(dst_cfg: dict, src_cfg: dict) -> List[str]:
    # Compare effective values (e.g. head_dim derived when absent).
    a, b = _shape_args(dst_cfg), _shape_args(src_cfg)
    out = []
    for k in _SHAPE_FIELDS:
        if k == "intermediate_size" and a.num_experts:
            continue  # MoE heads have no dense MLP
        if getattr(a, k) != getattr(b, k):
            out.append(f"{k}: model {getattr(a, k)} vs source {getattr(b, k)}")
    return out


def _float_dtype_of(tensors: Dict[str, Tuple[Path, dict]]) -> Optional[mx.Dtype]:
    names = {"BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32}
    for k, (_, e) in tensors.items():
        if k.endswith("embed_tokens.scales") or (k.endswith("embed_tokens.weight")
                                                  and e["dtype"] in names):
            return names.get(e["dtype"])
    return None


def _load_mtp_head(src: Path, src_cfg: dict, dst_cfg: dict, tensors, mtp_keys: List[str],
                   n_layers: int, verbose: bool):
    """The source's MTP head, sanitized and in floating point, built for DST's config.

    Also returns the source's quantized modules (path -> module), to reuse as they are
    where the target precision is the same (re-quantizing would add error).
    """
    files = sorted({tensors[k][0] for k in mtp_keys})
    weights = read_tensors(files, set(mtp_keys), verbose)
    _check_foreign_quant(weights, src, (".weight_scale_inv",) if family_of(src_cfg) else ())

    model = _build_model(dst_cfg, n_layers)
    try:
        weights = model.sanitize(weights)  # the head's norm form is read from its weights
    except MissingMTPWeightsError as e:
        raise ConversionError(_incomplete_head(src, e, "Use a complete original checkpoint "
                                                        "as --source.")) from e
    head = model.text.mtp
    prefix = next(k for k in weights if is_mtp_key(k)).split("mtp.")[0] + "mtp."
    head_weights = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
    if any(k.endswith(".scales") for k in head_weights):
        q = copy.deepcopy(config_quantization(src_cfg) or {})
        q = {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in q.items()}
        quantize_like_checkpoint(head, head_weights, q)
    try:
        head.load_weights(list(head_weights.items()), strict=True)
    except ValueError as e:
        raise ConversionError(
            f"The MTP head in {src} does not fit this model: {e}. The tensor shapes differ, "
            "so the source is a different model (size or variant); use the original "
            "checkpoint this model was converted from."
        ) from e
    packed = {p: m for p, m in head.named_modules() if "scales" in m and hasattr(m, "bits")}
    _dequantize(head)
    return model, head, prefix, packed


def _check_pair(model_path, source_path, force: bool, verbose: bool):
    """The model and source directories, configs and tensor tables; refuses a pair whose
    head cannot fit. Returns (dst, src, dst_cfg, src_cfg, is_head, dst_tensors, existing
    head keys, src_tensors, source head keys)."""
    _recover_stale(Path(model_path).expanduser().absolute(), restore=True, verbose=verbose)
    dst = _check_model_dir(model_path, "Model").resolve()  # swap the real directory
    src = _check_model_dir(source_path, "Source")
    if dst.resolve() == src.resolve():
        raise ConversionError("--model and --source are the same directory.")
    dst_cfg, src_cfg = load_config(dst), load_config(src)
    dst_family, src_family = family(dst_cfg), family(src_cfg)
    try:
        get_model_module(dst_cfg.get("model_type", ""))
    except UnsupportedModelError as e:
        raise ConversionError(str(e)) from e
    if dst_family != src_family:
        raise ConversionError(
            f"The source is a {src_family!r} model but {dst} is {dst_family!r}: its MTP head "
            "cannot fit. Use the original checkpoint this model was converted from."
        )
    # Head tensors: ``mtp.*``, or an attention-trunk family's own prefixes.
    is_head = mtp_key_predicate(dst_cfg)
    dst_tensors = _checkpoint_tensors(dst)
    existing = sorted(k for k in dst_tensors if is_head(k))
    if existing and not force:
        files = sorted({dst_tensors[k][0].name for k in existing})
        raise ConversionError(
            f"{dst} already has an MTP head ({len(existing)} mtp.* tensors in "
            f"{', '.join(files)}). Pass --force to replace it."
        )
    src_tensors = _checkpoint_tensors(src)
    mtp_keys = sorted(k for k in src_tensors if is_head(k))
    if not mtp_keys:
        raise ConversionError(
            f"{src} has no MTP weights (no mtp.* tensors in "
            f"{', '.join(sorted({f.name for f, _ in src_tensors.values()}))}). Use the "
            "original Hugging Face release as --source: conversions made by other tools "
            "(mlx-lm, most GGUF/MLX uploads) strip the head."
        )
    mismatches = _config_mismatches(dst_cfg, src_cfg)
    if mismatches:
        raise ConversionError(
            f"The source's config does not match {dst}: " + "; ".join(mismatches)
            + ". The head belongs to a different model (size or variant); use the original "
            "checkpoint this model was converted from."
        )
    return dst, src, dst_cfg, src_cfg, is_head, dst_tensors, existing, src_tensors, mtp_keys


def _quantize_head(model, head, prefix, packed, dst_quant, dst_quantized: bool,
                   dst_dtype, mtp_bits, verbose):
    """Quantize the grafted head like the model unless ``mtp_bits`` says otherwise;
    returns (bits or None, the scheme, the head's quantization record)."""
    group_size = (dst_quant or {}).get("group_size", 64) if dst_quantized else 64
    if mtp_bits is None:
        affine = (dst_quant or {}).get("mode", "affine") == "affine"
        # Non-affine trunks (mxfp4...) keep a floating-point head.
        bits = (dst_quant or {}).get("bits", 4) if dst_quantized and affine else None
    else:
        bits = None if mtp_bits == 16 else mtp_bits
    scheme = QuantScheme(bits=None, group_size=group_size, mtp_bits=bits,
                         mtp_group_size=group_size)
    default = dst_quant if dst_quant else scheme.default()
    record = scheme.apply(head, prefix=prefix, default=default, verbose=verbose)
    record = {model.text.checkpoint_name(k): v for k, v in record.items()}
    # Layers the source already stored at this precision keep their exact packed values.
    same = [(p, packed[p]) for p, m in head.named_modules() if p in packed and hasattr(m, "bits")
            and (m.bits, m.group_size, m.mode) == (packed[p].bits, packed[p].group_size,
                                                   packed[p].mode)]
    if same:
        head.update_modules(tree_unflatten(same))
        if dst_dtype is not None:
            _cast(head, dst_dtype)  # their scales/biases
    return bits, scheme, record


def _grafted_config(dst_cfg, n_layers, dst_quant, is_head, bits, scheme, record):
    """config.json with the MTP layer count and the head's quantization entries."""
    new_cfg = copy.deepcopy(dst_cfg)
    set_config_mtp_layers(new_cfg, n_layers)
    quant = None
    if dst_quant:
        quant = {k: v for k, v in copy.deepcopy(dst_quant).items()
                 if not is_head(k + ".")}
        quant.update(record)
    elif bits is not None:
        quant = dict(scheme.default(), **record)
    for c in (new_cfg, text_config(new_cfg)):
        c.pop("quantization", None)
        c.pop("quantization_config", None)
    if quant is not None:
        new_cfg["quantization"] = quant
        new_cfg["quantization_config"] = copy.deepcopy(quant)
    return new_cfg, quant


def _swap_in_head(dst, dst_tensors, existing, is_head, head_params, new_cfg, verbose):
    """Stage the model with the new head (the old one dropped) and swap it into place."""
    with _staging(dst, verbose, restore=True) as tmp:
        _link_tree(dst, tmp)
        # Drop the old head (--force): whole mtp-only files, or mtp.* keys of mixed files.
        weight_map = {k: f.name for k, (f, _) in dst_tensors.items()}
        sizes = {k: _entry_nbytes(e) for k, (_, e) in dst_tensors.items()}
        for fname in sorted({weight_map[k] for k in existing}):
            keep = [k for k, f in weight_map.items() if f == fname and not is_head(k)]
            (tmp / fname).unlink()
            if keep:
                kept = {k: v for k, v in mx.load(str(dst / fname)).items() if k in set(keep)}
                with tqdm(total=_param_bytes(kept), desc=f"rewriting {fname}", unit="B",
                          unit_scale=True, disable=not verbose) as bar:
                    _save_shard(tmp / fname, kept, bar)
        for k in existing:
            weight_map.pop(k)
            sizes.pop(k)
        if (tmp / MTP_SHARD).exists():
            (tmp / MTP_SHARD).unlink()
        with tqdm(total=_param_bytes(head_params), desc="writing", unit="B", unit_scale=True,
                  disable=not verbose) as bar:
            _save_shard(tmp / MTP_SHARD, head_params, bar)
        weight_map.update({k: MTP_SHARD for k in head_params})
        total = sum(sizes.values()) + _param_bytes(head_params)
        _write_index(tmp, weight_map, total)
        _write_json(tmp / "config.json", new_cfg)
        old = _swap_into_place(tmp, dst)
        shutil.rmtree(old, ignore_errors=True)


def add_mtp(model_path, source_path, mtp_bits: Optional[int] = None, force: bool = False,
            *, verbose: bool = True) -> dict:
    """Graft the MTP head of ``source_path`` into the MLX model at ``model_path``.

    Reads only the source shards that hold ``mtp.*`` tensors. The head is quantized
    like the model (same bits and group size, router gates at 8 bits) unless
    ``mtp_bits`` says otherwise (16 = floating point), written to ``mtp.safetensors``
    and recorded in the index and config.json. Refuses when the source has no head,
    when it does not fit the model, or when the model already has one (``force``).
    """
    if mtp_bits is not None and mtp_bits not in MTP_BITS:
        raise ConversionError(
            f"--mtp-bits must be one of {MTP_BITS} (16 keeps the head in floating point); "
            f"got {mtp_bits}."
        )
    if hub.is_repo_id(source_path):  # fetch only the config and the shards holding mtp.*
        with tempfile.TemporaryDirectory(prefix="mlx-mtp-head-") as tmp:
            source = hub_mtp_source(str(source_path), Path(tmp) / Path(str(source_path)).name)
            return add_mtp(model_path, source, mtp_bits, force, verbose=verbose)
    if hub.is_repo_id(model_path):
        raise ConversionError(
            f"{model_path} is a hub id: add-mtp changes the model in place and mlx-mtp does "
            "not write into the Hugging Face cache. Pass --output DIR to write a copy with the "
            "head there.")
    (dst, src, dst_cfg, src_cfg, is_head, dst_tensors, existing, src_tensors,
     mtp_keys) = _check_pair(model_path, source_path, force, verbose)
    n_layers = count_mtp_layers(mtp_keys) or max(config_mtp_layers(src_cfg), 1)
    model, head, prefix, packed = _load_mtp_head(src, src_cfg, dst_cfg, src_tensors,
                                                  mtp_keys, n_layers, verbose)
    dst_dtype = _float_dtype_of(dst_tensors)
    if dst_dtype is not None:
        _cast(head, dst_dtype)
    dst_quant = config_quantization(dst_cfg)
    dst_quantized = any(k.endswith(".scales") for k in dst_tensors if not is_head(k))
    bits, scheme, record = _quantize_head(model, head, prefix, packed, dst_quant,
                                          dst_quantized, dst_dtype, mtp_bits, verbose)
    head_params = {prefix + k: v for k, v in tree_flatten(head.parameters())}
    rows = _summarize(head_params, model)
    head_params = model.text.checkpoint_mtp_names(head_params)
    new_cfg, quant = _grafted_config(dst_cfg, n_layers, dst_quant, is_head, bits, scheme,
                                     record)
    _swap_in_head(dst, dst_tensors, existing, is_head, head_params, new_cfg, verbose)
    if verbose:
        what = f"{bits}-bit" if bits else "floating point"
        _print_summary(
            f"[mlx-mtp] {'replaced' if existing else 'added'} the MTP head of {src} in {dst} "
            f"({n_layers} layer(s), {what}, in {MTP_SHARD}):", rows, [])
    return {"path": str(dst), "mtp_layers": n_layers, "replaced": bool(existing),
            "mtp_bits": bits or 16, "quantization": quant, "parts": rows}


def add_mtp_to_copy(model_path, source_path, output, mtp_bits: Optional[int] = None,
                    force: bool = False, *, verbose: bool = True) -> dict:
    """``add_mtp`` on a copy of ``model_path`` (a local directory or a hub id) written to
    ``output`` (hard links where possible), which must not exist."""
    out = Path(output).expanduser()
    if out.exists() or out.is_symlink():
        raise ConversionError(f"Cannot write to {out}: it already exists. Delete it or pick a "
                              "new --output.")
    src = _check_model_dir(model_path, "Model", hub_files=hub.MODEL_FILES)
    out.parent.mkdir(parents=True, exist_ok=True)

    def link(s, d):  # the cache's files are symlinks to blobs: link the blobs
        s = os.path.realpath(s)
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)

    with _staging(out, verbose) as tmp:
        shutil.copytree(src, tmp, copy_function=link, dirs_exist_ok=True)
        summary = add_mtp(tmp, source_path, mtp_bits, force, verbose=verbose)
        tmp.rename(out)
    return dict(summary, path=str(out))


def _entry_nbytes(entry: dict) -> int:
    start, end = entry.get("data_offsets", (0, 0))
    return int(end) - int(start)


# --- command line ---------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", required=True,
                        help="MLX model to add the head to (e.g. an mlx-lm conversion): a "
                             "local directory, changed in place, or with --output a hub id.")
    parser.add_argument("--source", "--from", dest="source", required=True,
                        help="Original checkpoint holding mtp.* weights: a local directory "
                             "or a hub id org/name[@revision], of which only config.json, "
                             "the safetensors index and the shards holding the head are "
                             "downloaded (checksummed).")
    parser.add_argument("--output", default=None, metavar="DIR",
                        help="Write the model with its head to DIR (must not exist) instead "
                             "of changing --model in place; required when --model is a hub id.")
    parser.add_argument("--mtp-bits", type=int, default=None, choices=MTP_BITS,
                        help="Precision of the head: 4, 8, or 16 (floating point). Default: "
                             "the model's own quantization (floating point if it has none).")
    parser.add_argument("--force", action="store_true",
                        help="Replace a head the model already has.")
    return parser


def run(args) -> int:
    if args.output is not None:
        return run_guarded("add-mtp", lambda: add_mtp_to_copy(
            args.model, args.source, args.output, mtp_bits=args.mtp_bits, force=args.force))
    return run_guarded("add-mtp", lambda: add_mtp(args.model, args.source, mtp_bits=args.mtp_bits,
                                                  force=args.force))


def hub_mtp_source(spec: str, workdir: Path) -> Path:
    """A directory (in ``workdir``) holding the config of hub model ``spec`` and only the
    safetensors files that hold its ``mtp.*`` tensors, as the safetensors index names
    them (checksummed). Downloads nothing else."""
    import json

    parsed = hub.parse_repo_id(spec)
    if parsed is None:
        raise hub.HubError(f"{spec!r} is not a hub id (expected org/name or org/name@revision).")
    repo_id, revision = parsed
    config = hub.download_file(repo_id, "config.json", revision)
    revision = config.parent.name  # the snapshot's commit: every file from the same one
    is_mtp_key = mtp_key_predicate(json.loads(config.read_text()))  # key names differ per family
    index = hub.download_file(repo_id, "model.safetensors.index.json", revision, missing_ok=True)
    if index is None:
        shards = ["model.safetensors"]  # a single-file checkpoint holds everything
    else:
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        shards = sorted({f for k, f in weight_map.items() if is_mtp_key(k)})
        if not shards:  # some releases keep the head in a file the index does not name
            shards = ["mtp.safetensors"]
    out = Path(workdir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").symlink_to(config)
    for name in shards:
        path = hub.download_file(repo_id, name, revision, verify=True, missing_ok=True)
        if path is None:
            raise hub.HubError(f"{spec} has no MTP weights: its safetensors index names no mtp.* "
                           "tensor. Use the original release (e.g. Qwen/Qwen3.6-27B) as --from: "
                           "conversions made by other tools strip the head.")
        (out / Path(name).name).symlink_to(path)
    return out
