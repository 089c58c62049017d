"""``mlx-mtp inspect MODEL``: what a checkpoint holds, read from config.json and the
safetensors headers only (no tensor data is read, so it is instant on a 50 GB model).

Reports the family, the layout (Hugging Face original, MLX conversion, or a split MTP
drafter as mlx-vlm publishes them), the MTP layers declared and present (which files,
precision, size), whether the head was stripped by a conversion and the command that
grafts one back, the draft-vocabulary file, and the memory the model needs to run.

A checkpoint the loader would refuse (a damaged config or header, counts the weight files
cannot hold, a config no model can be built from) is refused here too, with the loader's
message and exit 2, as is a model type whose MTP head mlx-mtp cannot run yet
(``models.NOT_YET``: the message says what it lacks); any other model_type mlx-mtp does not
run is reported (exit 0) with advice, its config's JSON types checked only.
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from ..drafters.block import load as block_drafter
from ..models import MODEL_TYPES, refuse_not_yet
from ..models.draft import vocab as draft_vocab
from ..models.blocks.attention_trunk import count_checkpoint_mtp_layers, mtp_key_predicate
from ..models.cache.quantized import KVQuantization
from ..models.cache_growth import cache_growth
from ..models.io.layout import (VISION_PREFIXES, CheckpointError, config_mtp_layers,
                                config_quantization, count_mtp_layers, family)
from ..models.io.config_checks import check_fits_weights
from ..models.io.files import read_safetensors_header
from ..models.io.loader import (build_model, check_tokenizer_files, load_config,
                                resolve_model_path, weight_files)
from ..models.vision.encoder import VISION_FAMILIES

LAYOUT_HF, LAYOUT_MLX, LAYOUT_SPLIT = "hf", "mlx", "split"
LAYOUT_NAMES = {
    LAYOUT_HF: "Hugging Face original (raw names, zero-centred norms)",
    LAYOUT_MLX: "MLX conversion",
    LAYOUT_SPLIT: "split MTP drafter (mlx-vlm layout: the head alone, for a trunk beside it)",
}
DTYPE_BYTES = {"F64": 8, "F32": 4, "I32": 4, "U32": 4, "BF16": 2, "F16": 2, "I16": 2,
               "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}
DTYPE_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64",
               "F8_E4M3": "fp8 (e4m3)", "F8_E5M2": "fp8 (e5m2)"}
# A split drafter's tensors are the head's own, with the ``mtp.`` prefix stripped.
_SPLIT_KEYS = ("fc.weight", "pre_fc_norm_hidden.weight", "pre_fc_norm_embedding.weight")


@dataclass
class Tensor:
    file: str
    dtype: str
    shape: List[int]
    nbytes: int


def read_tensors(path: Path) -> Dict[str, Tensor]:
    """Every tensor's file, dtype, shape and size, from the safetensors headers."""
    out = {}
    for f in sorted(weight_files(path)):
        for name, e in read_safetensors_header(f).items():
            start, end = e["data_offsets"]
            out[name] = Tensor(f.name, e["dtype"], list(e["shape"]), int(end) - int(start))
    return out


def detect_layout(config: dict, tensors: Dict[str, Tensor]) -> str:
    if any(k in tensors for k in _SPLIT_KEYS) or (
            str(config.get("model_type", "")).endswith("_mtp")
            and not any("embed_tokens" in k for k in tensors)):
        return LAYOUT_SPLIT
    convs = [t.shape for k, t in tensors.items() if k.endswith("conv1d.weight") and len(t.shape) == 3]
    if convs:  # Hugging Face stores depthwise convs as (C, 1, K), MLX as (C, K, 1)
        return LAYOUT_MLX if convs[0][-1] == 1 else LAYOUT_HF
    if config_quantization(config) or any(k.startswith("language_model.") for k in tensors) \
            or any(k.endswith(".scales") for k in tensors):
        return LAYOUT_MLX
    return LAYOUT_HF


def _module_precision(name: str, tensors: Dict[str, Tensor], quant: Optional[dict]) -> str:
    """``4-bit (group 64)`` for a quantized weight, else its float dtype."""
    module = name[: -len(".weight")] if name.endswith(".weight") else name
    if module + ".scales" not in tensors:
        return DTYPE_NAMES.get(tensors[name].dtype, tensors[name].dtype)
    default = quant or {}
    own = default.get(module)
    if isinstance(own, dict):  # a per-module entry, as our and mlx-lm's converters write
        return f"{own.get('bits')}-bit (group {own.get('group_size')})"
    group = default.get("group_size", 64)
    # Packed uint32 columns hold 32/bits values each; scales hold one value per group.
    cols, groups = tensors[name].shape[-1], tensors[module + ".scales"].shape[-1]
    bits = 32 * cols / (groups * group)
    bits = int(bits) if bits in (2, 3, 4, 5, 6, 8) else default.get("bits")
    return f"{bits}-bit (group {group})"


def precision_counts(config: dict, tensors: Dict[str, Tensor], keys: List[str]) -> Dict[str, int]:
    """Weight matrices among ``keys`` by precision, most common first."""
    counts: Dict[str, int] = {}
    quant = config_quantization(config)
    for k in keys:
        if k.endswith(".weight") and len(tensors[k].shape) >= 2:
            p = _module_precision(k, tensors, quant)
            counts[p] = counts.get(p, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def mtp_summary(config: dict, tensors: Dict[str, Tensor], layout_name: str) -> dict:
    """Declared and present MTP layers, the files holding them, precision and bytes."""
    if layout_name == LAYOUT_SPLIT:
        keys = list(tensors)
        present = count_mtp_layers(["mtp." + k for k in keys])
    else:  # ``mtp.*``, or a family's own prefix (``model.layers.{N+i}.*``, ...)
        is_head = mtp_key_predicate(config)
        keys = [k for k in tensors if is_head(k)]
        present = count_mtp_layers(keys) or count_checkpoint_mtp_layers(config, keys)
    return {
        "declared_layers": config_mtp_layers(config),
        "present_layers": present,
        "tensors": len(keys),
        "bytes": sum(tensors[k].nbytes for k in keys),
        "files": sorted({tensors[k].file for k in keys}),
        "key_prefix": _common_prefix(keys),
        "precision": precision_counts(config, tensors, keys),
    }


def _common_prefix(keys: List[str]) -> str:
    if not keys:
        return ""
    first = min(keys).split(".")
    last = max(keys).split(".")
    common = []
    for a, b in zip(first, last):
        if a != b:
            break
        common.append(a)
    return ".".join(common) + "." if common else ""


def memory_estimate(tensors: Dict[str, Tensor], model=None,
                    kv_bits: Optional[int] = None, kv_group_size: int = 64) -> dict:
    """Bytes the text weights take once loaded, and what one sequence's caches (trunk and MTP
    head) hold as a 16-bit model's: per 1k tokens (``kv_bits``: also quantized so) and per
    sequence whatever its length, with the cache kinds holding that, in words. Measured from
    the caches of ``model`` (built lazily from the config; None: a type mlx-mtp does not
    run, no cache figures) on shapes alone (``models.cache_growth``)."""
    weights = sum(t.nbytes for k, t in tensors.items() if not k.startswith(VISION_PREFIXES))
    out = {"weights_bytes": weights, "kv_bytes_per_1k_tokens": None,
           "kv_bytes_per_1k_tokens_quantized": None, "state_bytes_per_sequence": None,
           "state_caches": []}
    if model is None:
        return out
    full = cache_growth(model)
    out.update(kv_bytes_per_1k_tokens=full.per_1k_tokens,
               state_bytes_per_sequence=full.per_sequence,
               state_caches=[STATE_WORDS.get(k) or CACHE_WORDS.get(k, k) for k in full.kinds])
    if kv_bits is not None:
        try:
            out["kv_bytes_per_1k_tokens_quantized"] = cache_growth(
                model, KVQuantization(kv_bits, kv_group_size)).per_1k_tokens
        except ValueError:  # refused: ``kv_quantization_caches`` says why
            pass
    return out


def _draft_vocab_info(path: Path) -> Optional[dict]:
    f = path / draft_vocab.FILE
    if not f.exists():
        return None
    try:
        data = json.loads(f.read_text())
        return {"file": f.name, "ranked_tokens": len(data.get("ranking", [])),
                "default_size": data.get("default_size")}
    except (ValueError, AttributeError) as e:
        return {"file": f.name, "error": f"unreadable ({e})"}


def _advice(path: Path, layout_name: str, mtp: dict, supported: bool = True) -> Optional[str]:
    """What to do next, when the checkpoint cannot draft as it is."""
    if not supported:
        return ("mlx-mtp cannot run this model_type, with or without MTP: run it with mlx-lm "
                "(`mlx_lm.generate`, `mlx_lm.server`), or pick a model of a supported family "
                "(docs/model-families.md).")
    if layout_name == LAYOUT_SPLIT:
        return ("A drafter alone: load it next to its trunk conversion "
                f"(`--mtp-model {path}` with `--model TRUNK`).")
    if mtp["present_layers"]:
        return None
    if mtp["declared_layers"] and layout_name == LAYOUT_MLX:
        return ("The config declares an MTP head but the weights have none: a conversion "
                "(mlx-lm's convert drops mtp.*) stripped it. Graft it back from the original: "
                f"`mlx-mtp add-mtp --model {path} --source ORIGINAL_HF_CHECKPOINT`.")
    if mtp["declared_layers"]:
        return ("The config declares an MTP head but the weights lack it (an incomplete "
                "download, or a tool that drops mtp.*). Graft it from the original: "
                f"`mlx-mtp add-mtp --model {path} --source ORIGINAL_HF_CHECKPOINT`, or run "
                "with --no-mtp.")
    return "No MTP head: the model runs with --no-mtp only (plain decoding)."


def check_loadable(where: Path, config: dict, layout_name: str) -> None:
    """The loader's refusals of a model_type it runs, from the config, the file sizes and
    the tokenizer files (the model is built lazily: nothing is allocated); a model type
    whose head mlx-mtp cannot run yet (``NOT_YET``) is refused with what it lacks."""
    refuse_not_yet(config.get("model_type"))
    if config.get("model_type") not in MODEL_TYPES:
        return None  # the report says mlx-mtp cannot run it, and what can
    split = layout_name == LAYOUT_SPLIT  # a drafter borrows its trunk's tokenizer...
    if not split:  # ...and its config describes its trunk's weights too
        check_fits_weights(config, weight_files(where), where / "config.json")
    check_tokenizer_files(where, required=not split)
    return build_model(copy.deepcopy(config), where / "config.json")


# What each cache kind holds, in words (``inspect --kv-bits``: what is quantized, what not).
CACHE_WORDS = {"quantized_kv": "attention K/V or MLA latents", "kv": "attention K/V",
               "quantized_index_kv": "DSA indexer keys", "index_kv": "DSA indexer keys",
               "pooled_index_kv": "pooled indexer keys",
               "quantized_pooled_index_kv": "pooled indexer keys", "rec": "recurrent states",
               "window_kv": "sliding windows", "short": "short windows",
               "chain": "chained MTP layers",
               "dsv4": "DeepSeek-V4 windows and compressed entries",
               "quantized_dsv4": "DeepSeek-V4 windows and compressed entries"}
# What a kind holds whatever the sequence's length, where its words above say more.
STATE_WORDS = {"rec": "recurrent states (float32 at any weight precision)",
               "chain": "chained MTP layers' windows",
               "dsv4": "DeepSeek-V4 windows and compressors' pending rows",
               "quantized_dsv4": "DeepSeek-V4 windows and compressors' pending rows"}
# Quantized kinds that keep a part in its precision: that part, in words.
KEPT_PARTS = {"quantized_dsv4": "DeepSeek-V4 compressors' pending rows"}


def kv_quantization_caches(model, bits: Optional[int], group_size: int) -> dict:
    """``refused``: why the model refuses ``--kv-bits`` (None: it takes it, or no bits
    asked); else ``quantized`` and ``kept``: the caches it makes then, in words."""
    out = {"refused": None, "quantized": [], "kept": []}
    if bits is None or model is None:
        return out
    try:
        model.use_kv_quantization(KVQuantization(bits, group_size))
    except ValueError as e:
        return dict(out, refused=str(e))
    for c in model.make_cache() + model.make_mtp_cache():
        for key, words in (("kept" if c.quantization is None else "quantized",
                            CACHE_WORDS.get(c.kind, c.kind)), ("kept", KEPT_PARTS.get(c.kind))):
            if words is not None and words not in out[key]:
                out[key].append(words)
    return out


def inspect_model(path: Optional[str], kv_bits: Optional[int] = None,
                  kv_group_size: int = 64) -> dict:
    """The report for the checkpoint at ``path`` (None: the embedded demo model);
    ``kv_bits``: the KV cache figures at that quantization too."""
    where = resolve_model_path(path)
    config = load_config(where)
    tensors = read_tensors(where)
    drafter = block_drafter.describe(config)
    if drafter is not None:  # a block drafter: it runs beside a trunk (--draft-model)
        return {"path": str(where), "block_drafter": drafter,
                "weights_bytes": sum(t.nbytes for t in tensors.values())}
    layout_name = detect_layout(config, tensors)
    model = check_loadable(where, config, layout_name)
    mtp = mtp_summary(config, tensors, layout_name)
    is_head = mtp_key_predicate(config)
    trunk = [k for k in tensors if not is_head(k) and not k.startswith(VISION_PREFIXES)]
    model_type = config.get("model_type")
    return {
        "path": str(where),
        "model_type": model_type,
        "family": family(config),
        "supported": model_type in MODEL_TYPES,
        "layout": layout_name,
        "trunk_precision": None if layout_name == LAYOUT_SPLIT
        else precision_counts(config, tensors, trunk),
        "vision_tensors": sum(1 for k in tensors if k.startswith(VISION_PREFIXES)),
        "mtp": mtp,
        "head_stripped": (layout_name != LAYOUT_SPLIT and mtp["declared_layers"] > 0
                          and mtp["present_layers"] == 0),
        "advice": _advice(where, layout_name, mtp, model_type in MODEL_TYPES),
        "draft_vocab": _draft_vocab_info(where),
        "own_block_drafter": block_drafter.describe_own(config),
        "memory": memory_estimate(tensors, model, kv_bits, kv_group_size),
        "kv_quantization": None if kv_bits is None else {
            "bits": kv_bits, "group_size": kv_group_size,
            **kv_quantization_caches(model, kv_bits, kv_group_size),
            "recurrent_states": "kept in their own precision (DeltaNet, Mamba-2)"},
    }


def _size(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _precision(counts: Dict[str, int]) -> str:
    return ", ".join(f"{p} ×{n}" if len(counts) > 1 else p for p, n in counts.items()) or "-"


def _drafter_precision(quantization: Optional[dict]) -> str:
    if not quantization:
        return "floating point"
    return (f"{quantization['bits']}-bit {quantization.get('mode', 'affine')} "
            f"(group size {quantization['group_size']}; norms and tables as stored)")


def _render_block_drafter(report: dict) -> str:
    d = report["block_drafter"]
    return "\n".join([
        f"drafter  {report['path']}",
        f"kind     {d['kind']} block drafter (for --draft-model, beside its trunk)",
        f"taps     after trunk layers {d['taps']} (0-based)",
        f"block    {d['max_draft']} drafts, one pass each" if d["autoregressive"] else
        f"block    {d['block_size']} positions per pass ({d['max_draft']} drafts)",
        f"fits     hidden size {d['hidden_size']}, vocabulary {d['vocab_size']}",
        f"weights  {_drafter_precision(d['quantization'])}",
        f"memory   weights {_size(report['weights_bytes'])} as stored"])


def render(report: dict) -> str:
    if "block_drafter" in report:
        return _render_block_drafter(report)
    mtp, mem = report["mtp"], report["memory"]
    rows = [("model", report["path"]),
            ("family", f"{report['family'] or '?'} (model_type {report['model_type']!r}"
                       f"{'' if report['supported'] else ', not supported by mlx-mtp'})"),
            ("layout", LAYOUT_NAMES[report["layout"]])]
    if report["trunk_precision"]:
        rows.append(("trunk", _precision(report["trunk_precision"])))
    if report["vision_tensors"]:
        use = ("read at the first image, or at start with --vision"
               if report["family"] in VISION_FAMILIES else "not used by mlx-mtp")
        rows.append(("vision", f"{report['vision_tensors']} tensors ({use})"))
    head = f"{mtp['declared_layers']} layer(s) declared, {mtp['present_layers']} present"
    if mtp["tensors"]:
        head += (f": {mtp['tensors']} tensors, {_size(mtp['bytes'])} in "
                 f"{', '.join(mtp['files'])} under {mtp['key_prefix'] or '(top level)'}; "
                 f"{_precision(mtp['precision'])}")
    own = report["own_block_drafter"]
    if own is not None:  # DeepSeek-V4's DSpark stages: mtp.* holds them, not a head
        head = (f"none: mtp.* holds {own['kind']} stages (taps after layers {own['taps']}, "
                f"{own['block_size']} positions per pass, {own['max_draft']} drafts), drafted "
                "with as a block drafter (--draft-source block)")
    rows.append(("MTP head", head))
    dv = report["draft_vocab"]
    rows.append(("draft vocab", "none" if dv is None else dv.get("error") or
                 f"{dv['file']}: {dv['ranked_tokens']} ranked tokens"
                 + (f", default size {dv['default_size']}" if dv["default_size"] else "")))
    memory = f"weights {_size(mem['weights_bytes'])} as stored"
    if mem["kv_bytes_per_1k_tokens"] is not None:
        memory += f"; KV cache {_size(mem['kv_bytes_per_1k_tokens'])} per 1k tokens"
    if mem["state_bytes_per_sequence"]:
        memory += (f"; {_size(mem['state_bytes_per_sequence'])} per sequence at any length: "
                   f"{', '.join(mem['state_caches'])}")
    rows.append(("memory", memory))
    if "ranks" in report:
        from .inspect_ranks import render_plan

        rows += render_plan(report["ranks"], _size)
    kvq = report["kv_quantization"]
    if kvq is not None:
        rows.append(("kv cache", _kv_quantization(kvq, mem)))
    if report["advice"]:
        rows.append(("next", report["advice"]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _kv_quantization(kvq: dict, mem: dict) -> str:
    if kvq["refused"]:
        return f"--kv-bits {kvq['bits']} refused: {kvq['refused']}"
    line = f"--kv-bits {kvq['bits']} (group {kvq['group_size']}): quantized " + (
        ", ".join(kvq["quantized"]) or "attention K/V")
    kept = [k for k in kvq["kept"] if k != "recurrent states"]  # said below, with their kinds
    if kept:
        line += f" (kept in their precision: {', '.join(kept)})"
    q, full = mem["kv_bytes_per_1k_tokens_quantized"], mem["kv_bytes_per_1k_tokens"]
    if q is not None:
        line += f", {_size(q)} per 1k tokens ({q / full:.2f}x of 16-bit)"
    if "recurrent states" in kvq["kept"]:
        line += f"; recurrent states {kvq['recurrent_states']}"
    return line


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model", nargs="?", default=None,
                        help="Checkpoint directory (default: the embedded demo model)")
    parser.add_argument("--json", action="store_true", help="Print the report as JSON")
    parser.add_argument("--kv-bits", type=int, choices=[4, 8], default=None,
                        help="Also report the KV cache quantized to these bits (--kv-bits of "
                             "generate and serve), or why this model refuses it")
    parser.add_argument("--kv-group-size", type=int, choices=[32, 64, 128], default=64)
    parser.add_argument("--ranks", type=int, default=None,
                        help="Also print the memory plan of a --distributed run over this "
                             "many ranks: each rank's layers, weights and caches")
    parser.add_argument("--distributed", choices=["pipeline", "tensor", "expert"], default=None,
                        help="With --ranks: the split to plan (default: the one "
                             "--distributed picks)")
    return parser


def run(args) -> int:
    report = inspect_model(args.model, args.kv_bits, args.kv_group_size)
    if args.distributed and args.ranks is None:
        raise CheckpointError("inspect --distributed needs --ranks N")
    drafter = "block_drafter" in report or report["layout"] == LAYOUT_SPLIT
    if args.ranks is not None and drafter:
        raise CheckpointError(f"inspect --ranks: {report['path']} is a drafter alone; plan "
                              "the model it drafts for (a split drafter's head is placed as "
                              "the model's own)")
    if args.ranks is not None:
        from .inspect_ranks import rank_plan

        where = Path(report["path"])
        report["ranks"] = rank_plan(where, load_config(where), report["memory"], args.ranks,
                                    args.distributed, report["mtp"]["present_layers"] > 0)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0
