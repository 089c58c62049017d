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
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import ctypes.util
import json
import os
import re
import shutil
import signal
import struct
import sys
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_map_with_path, tree_unflatten
from tqdm import tqdm

from .loader import ModelLoadError, load_config, quantize_like_checkpoint, weight_files
from .models import UnsupportedModelError, get_model_module
from .models.hybrid import HybridArgs, MissingMTPWeightsError

INDEX_FILE = "model.safetensors.index.json"
MTP_SHARD = "mtp.safetensors"
DEFAULT_MAX_SHARD_GB = 5.0
Q_BITS = (2, 3, 4, 5, 6, 8)
Q_GROUP_SIZES = (32, 64, 128)
MTP_BITS = (4, 8, 16)  # 16 = keep the head in floating point
DEFAULT_MTP_BITS = 8  # when quantizing and --mtp-bits is not given
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
ROUTER_QUANT = {"group_size": 64, "bits": 8}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "LICENSE",
)
# Checkpoint formats whose packed weights mlx-mtp cannot read.
FOREIGN_QUANT_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".input_scale", ".qweight",
                          ".qzeros", ".g_idx")
STAGING_TAG = ".mlx-mtp-"

_MTP_LAYER_RE = re.compile(r"(?:^|\.)mtp\.layers\.(\d+)\.")


class ConversionError(ValueError):
    """A conversion that cannot go ahead; the message says what is wrong and how to fix it."""


# --------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------

def is_mtp_key(key: str) -> bool:
    """``mtp.*`` (raw HF), ``model.mtp.*`` or ``language_model.mtp.*`` (MLX)."""
    return key.startswith("mtp.") or ".mtp." in key


def _text(config: dict) -> dict:
    return config.get("text_config", config)


def _family(config: dict) -> str:
    model_type = config.get("model_type") or _text(config).get("model_type", "")
    return model_type[: -len("_text")] if model_type.endswith("_text") else model_type


def _is_router(path: str) -> bool:
    return path.endswith("mlp.gate") or path.endswith("shared_expert_gate")


def _config_quantization(config: dict) -> Optional[dict]:
    return config.get("quantization") or _text(config).get("quantization")


def _config_mtp_layers(config: dict) -> int:
    text = _text(config)
    if _family(config) == "qwen3_next":
        return int(text.get("mtp_num_hidden_layers", text.get("num_nextn_predict_layers", 1)))
    return int(text.get("mtp_num_hidden_layers", 0))


def _set_config_mtp_layers(config: dict, n: int):
    text = _text(config)
    if _family(config) == "qwen3_next" and "mtp_num_hidden_layers" not in text:
        if n != 1 or "num_nextn_predict_layers" in text:
            text["num_nextn_predict_layers"] = n
    else:
        text["mtp_num_hidden_layers"] = n


def _count_mtp_layers(keys: Iterable[str]) -> int:
    found = [int(m.group(1)) for k in keys if (m := _MTP_LAYER_RE.search(k))]
    return max(found) + 1 if found else 0


def _build_model(config: dict, mtp_layers: int):
    """Our model for ``config`` with ``mtp_layers`` MTP layers (parameters stay lazy)."""
    config = copy.deepcopy(config)
    _text(config)["mtp_num_hidden_layers"] = mtp_layers
    _text(config)["num_nextn_predict_layers"] = mtp_layers
    model_type = config.get("model_type")
    if model_type is None:
        raise ConversionError("config.json has no model_type; is this a Hugging Face checkpoint?")
    try:
        module = get_model_module(model_type)
    except UnsupportedModelError as e:
        raise ConversionError(str(e)) from e
    return module.Model(module.ModelArgs.from_dict(config))


def _check_model_dir(path: Path, role: str) -> Path:
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ConversionError(
            f"{role} {path} does not exist or is not a directory. Pass the local directory "
            "of a checkpoint (config.json + *.safetensors); download it first if needed, "
            "e.g. `huggingface-cli download Qwen/Qwen3.6-27B --local-dir DIR`."
        )
    if not (path / "config.json").exists():
        raise ConversionError(f"{role} {path} has no config.json; is it a model directory?")
    if not weight_files(path):
        raise ConversionError(
            f"{role} {path} has no *.safetensors weight files. Only safetensors checkpoints "
            "are supported (not .bin, .gguf or .pt)."
        )
    return path


def read_safetensors_header(path: Path) -> Dict[str, dict]:
    """Tensor names -> {"dtype", "shape"} of a safetensors file, without reading the data."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ConversionError(f"{path} is not a safetensors file (truncated header).")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise ConversionError(f"{path} is not a valid safetensors file: {e}") from e
    header.pop("__metadata__", None)
    return header


def _checkpoint_tensors(path: Path) -> Dict[str, Tuple[Path, dict]]:
    """Every tensor of a checkpoint -> (file, header entry), from headers only."""
    out = {}
    for f in weight_files(path):
        if not f.exists():
            raise ConversionError(
                f"{path / INDEX_FILE} names {f.name}, which is missing. The checkpoint is "
                "incomplete: download it again."
            )
        for k, entry in read_safetensors_header(f).items():
            out[k] = (f, entry)
    return out


def _check_foreign_quant(keys: Iterable[str], path: Path):
    bad = [k for k in keys if k.endswith(FOREIGN_QUANT_SUFFIXES)]
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


def _cast(model: nn.Module, dtype: mx.Dtype):
    """Cast floating-point parameters to ``dtype``, except those the model keeps (A_log)."""
    keep = getattr(model, "cast_predicate", None) or (lambda p: not p.endswith("A_log"))

    def cast(path, v):
        if keep(path) and mx.issubdtype(v.dtype, mx.floating):
            return v.astype(dtype)
        return v

    model.update(tree_map_with_path(cast, model.parameters()))


@dataclass
class _Source:
    model: nn.Module
    config: dict  # config.json as stored (mtp count fixed up if needed)
    mtp_layers: int
    quantized: bool
    files: List[Path]


def _load_source(src: Path, verbose: bool) -> _Source:
    config = load_config(src)
    files = weight_files(src)
    weights = {}
    total = sum(f.stat().st_size for f in files)
    with tqdm(total=total, desc="reading", unit="B", unit_scale=True,
              disable=not verbose) as bar:
        for f in files:
            weights.update(mx.load(str(f)))  # lazy: data is read when written
            bar.update(f.stat().st_size)
    _check_foreign_quant(weights, src)

    n_keys = _count_mtp_layers(k for k in weights if is_mtp_key(k))
    n_config = _config_mtp_layers(config)
    if n_keys == 0 and any(is_mtp_key(k) for k in weights):
        n_keys = max(n_config, 1)
    if n_keys and n_keys != n_config:
        _warn(f"{src}/config.json says {n_config} MTP layer(s) but the weights hold "
              f"{n_keys}; keeping {n_keys}.", verbose)
        _set_config_mtp_layers(config, n_keys)

    model = _build_model(config, n_keys)
    try:
        weights = model.sanitize(weights)
    except MissingMTPWeightsError as e:
        raise ConversionError(_incomplete_head(src, e, "The checkpoint looks damaged; "
                                                        "download it again.")) from e
    quantized = any(k.endswith(".scales") for k in weights)
    if quantized:
        quantize_like_checkpoint(model, weights, _config_quantization(config))
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ConversionError(
            f"The weights in {src} do not match its config.json: {e}. Check that the "
            "download is complete and config.json belongs to these weights."
        ) from e
    return _Source(model, config, n_keys, quantized, files)


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


# --------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------

def _save_shard(path: Path, tensors: Dict[str, mx.array], bar) -> None:
    """Compute (quantize/cast) and write one shard. Tests patch this to simulate a crash."""
    for v in tensors.values():
        mx.eval(v)
        bar.update(v.nbytes)
    mx.save_safetensors(str(path), tensors, metadata={"format": "mlx"})


def _make_shards(weights: Dict[str, mx.array], max_bytes: int) -> List[Dict[str, mx.array]]:
    shards: List[Dict[str, mx.array]] = []
    size = 0
    for k, v in weights.items():
        if not shards or (size + v.nbytes > max_bytes and shards[-1]):
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += v.nbytes
    return shards


def _write_weights(out: Path, weights: Dict[str, mx.array], max_shard_bytes: int,
                   verbose: bool) -> Dict[str, str]:
    """Trunk shards + ``mtp.safetensors``; returns the weight map. Consumes ``weights``."""
    trunk = {k: v for k, v in weights.items() if not is_mtp_key(k)}
    head = {k: v for k, v in weights.items() if is_mtp_key(k)}
    weights.clear()
    shards = _make_shards(trunk, max_shard_bytes)
    if head:
        shards.append(head)
    n_trunk = len(shards) - (1 if head else 0)
    total = sum(_param_bytes(s) for s in shards)
    trunk.clear()
    weight_map = {}
    with tqdm(total=total, desc="writing", unit="B", unit_scale=True,
              disable=not verbose) as bar:
        for i in range(len(shards)):
            shard, shards[i] = shards[i], None
            if i >= n_trunk:
                name = MTP_SHARD
            elif n_trunk == 1:
                name = "model.safetensors"
            else:
                name = f"model-{i + 1:05d}-of-{n_trunk:05d}.safetensors"
            _save_shard(out / name, shard, bar)
            weight_map.update({k: name for k in shard})
            del shard
    return weight_map


def _write_json(path: Path, data: dict):
    # Never write through an existing name: in add-mtp staging it is a hard link
    # to the live target's file.
    if path.exists() or path.is_symlink():
        path.unlink()
    with open(path, "w") as f:
        json.dump(data, f, indent=4)
        f.write("\n")


def _write_index(out: Path, weight_map: Dict[str, str], total_size: int):
    _write_json(out / INDEX_FILE, {
        "metadata": {"total_size": total_size},
        "weight_map": dict(sorted(weight_map.items())),
    })


def _finalize_config(config: dict, quantization: Optional[dict]) -> dict:
    """config.json for the output: same structure, quantization recorded as mlx-lm does."""
    config = copy.deepcopy(config)
    config.pop("_name_or_path", None)
    config.pop("vision_config", None)  # the vision tower is not converted
    for c in (config, _text(config)):
        c.pop("quantization", None)
        c.pop("quantization_config", None)
    if quantization:
        config["quantization"] = quantization
        config["quantization_config"] = copy.deepcopy(quantization)
    return config


def _copy_tokenizer(src: Path, out: Path) -> List[str]:
    copied = []
    for name in TOKENIZER_FILES:
        f = src / name
        if f.is_file():
            shutil.copy2(f, out / name)
            copied.append(name)
    for f in src.glob("*.tiktoken"):
        shutil.copy2(f, out / f.name)
        copied.append(f.name)
    return copied


# --------------------------------------------------------------------------
# Staging and atomic publication
# --------------------------------------------------------------------------

def _staging_name(target: Path, kind: str) -> Path:
    return target.parent / f".{target.name}{STAGING_TAG}{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _recover_stale(target: Path, restore: bool, verbose: bool = True):
    """Clean up after a run on ``target`` that was killed (SIGKILL, power loss) half-way.

    Staging copies of dead runs are deleted. An ``old`` directory is the original
    target moved aside by a non-atomic swap: deleted once the new target is in
    place, put back (``restore``, add-mtp) or left alone with a warning otherwise.
    """
    if not target.parent.is_dir():
        return
    pattern = re.compile(re.escape(f".{target.name}{STAGING_TAG}")
                         + r"(tmp|old)-(\d+)-[0-9a-f]{8}$")
    for entry in target.parent.iterdir():
        m = pattern.match(entry.name)
        if not m or _pid_alive(int(m.group(2))):
            continue  # not ours, or still in use (this process included)
        if m.group(1) == "tmp" or target.exists():
            shutil.rmtree(entry, ignore_errors=True)
        elif restore:
            entry.rename(target)
            _warn(f"restored {target} from an interrupted add-mtp.", verbose)
        else:
            _warn(f"{entry} holds the original {target.name} from an interrupted add-mtp; "
                  f"rename it to {target} to recover it.", verbose)


@contextlib.contextmanager
def _staging(target: Path, verbose: bool = True, restore: bool = False):
    """A fresh hidden directory next to ``target``; removed whatever happens."""
    _recover_stale(target, restore, verbose)
    tmp = _staging_name(target, "tmp")
    tmp.mkdir()
    try:
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directories (Linux renameat2 / macOS renamex_np)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        if sys.platform.startswith("linux") and hasattr(libc, "renameat2"):
            at_fdcwd, rename_exchange = -100, 2
            fn = libc.renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                           ctypes.c_uint]
            return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0
        if sys.platform == "darwin" and hasattr(libc, "renamex_np"):
            rename_swap = 0x2
            fn = libc.renamex_np
            fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint]
            return fn(os.fsencode(a), os.fsencode(b), rename_swap) == 0
    except OSError:
        pass
    return False


def _swap_into_place(new: Path, target: Path) -> Path:
    """Make ``new`` the ``target``; returns where the old target now lives (to delete)."""
    if _exchange(new, target):
        return new
    old = _staging_name(target, "old")
    os.rename(target, old)
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(old, target)
        raise
    return old


def _link_tree(src: Path, dst: Path):
    """Hard-link ``src``'s files into ``dst`` (copy where links are not possible)."""
    def link(s, d):
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)

    shutil.copytree(src, dst, copy_function=link, dirs_exist_ok=True, symlinks=True)


@contextlib.contextmanager
def _terminate_as_interrupt():
    """While converting from the CLI, let SIGTERM/SIGHUP clean up like Ctrl-C does."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    saved = {}
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            saved[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, h in saved.items():
            signal.signal(sig, h)


# --------------------------------------------------------------------------
# convert
# --------------------------------------------------------------------------

def _config_dtype(config: dict) -> Optional[str]:
    for c in (config, _text(config)):
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
    verbose: bool = True,
) -> dict:
    """Convert a local Hugging Face (or MLX) checkpoint to MLX, keeping its MTP head.

    ``mtp_bits``: precision of the MTP head (4, 8, or 16 = float). Default: 8 bits
    when quantizing, else float. Router gates are always kept at 8 bits.
    ``dtype``: cast floating-point weights (``A_log`` excepted) before quantizing;
    default: the config's ``torch_dtype``/``dtype`` (as mlx-lm), else the stored dtypes. ``dequantize``: the reverse direction, for an
    MLX-quantized source. Returns a summary dict.
    """
    _validate_quant_args(quantize, q_bits, q_group_size, mtp_bits, dequantize)
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"--dtype must be one of {sorted(DTYPES)} (got {dtype!r}).")
    if max_shard_size_gb <= 0:
        raise ConversionError("The maximum shard size must be positive.")
    src = _check_model_dir(hf_path, "Source")
    dst = Path(mlx_path).expanduser()
    if dst.exists() or dst.is_symlink():
        raise ConversionError(
            f"Cannot write to {dst}: it already exists. Delete it or pick a new --mlx-path "
            "(convert never overwrites; to add an MTP head to an existing model use "
            "`mlx-mtp add-mtp`)."
        )
    if not dst.parent.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)

    try:
        source = _load_source(src, verbose)
    except (ModelLoadError, UnsupportedModelError) as e:
        raise ConversionError(str(e)) from e
    model, config = source.model, source.config

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
    if source.mtp_layers == 0:
        _warn(
            f"{src} has no MTP weights (mtp.*): converting the trunk only. Graft the head "
            f"later with `mlx-mtp add-mtp --model {dst} --source ORIGINAL_HF_CHECKPOINT`.",
            verbose,
        )

    if dequantize:
        _dequantize(model)
    if dtype is None:
        dtype = _config_dtype(config)  # as mlx-lm does: the dtype the config declares
    if dtype is not None:
        _cast(model, DTYPES[dtype])

    quantization = None
    if dequantize:
        quantization = None
    elif source.quantized:
        quantization = _config_quantization(config)  # passed through unchanged
    else:
        if mtp_bits is None:
            mtp_bits = DEFAULT_MTP_BITS if quantize else 16
        scheme = QuantScheme(
            bits=q_bits if quantize else None,
            group_size=q_group_size,
            mtp_bits=None if (mtp_bits == 16 or source.mtp_layers == 0) else mtp_bits,
            mtp_group_size=q_group_size,
        )
        if scheme.active:
            record = scheme.apply(model, verbose=verbose)
            quantization = dict(scheme.default(), **record)

    out_config = _finalize_config(config, quantization)
    if dtype is not None:
        for c in (out_config, _text(out_config)):
            for key in ("torch_dtype", "dtype"):
                if key in c:
                    c[key] = dtype

    weights = dict(tree_flatten(model.parameters()))
    rows = _summarize(weights, model)
    total_size = _param_bytes(weights)
    # Hand the tensors to the writer only, so each shard is freed once written.
    model.update(tree_map(lambda _: mx.array([]), model.parameters()))

    with _staging(dst, verbose) as tmp:
        weight_map = _write_weights(tmp, weights, int(max_shard_size_gb * (1 << 30)), verbose)
        _write_index(tmp, weight_map, total_size)
        _write_json(tmp / "config.json", out_config)
        tokenizer_files = _copy_tokenizer(src, tmp)
        try:
            os.rename(tmp, dst)
        except OSError as e:
            raise ConversionError(f"Could not move the converted model into {dst}: {e}") from e

    summary = {
        "path": str(dst),
        "mtp_layers": source.mtp_layers,
        "quantization": quantization,
        "files": sorted(set(weight_map.values())),
        "tokenizer_files": tokenizer_files,
        "parts": rows,
        "total_size": total_size,
    }
    if verbose:
        extra = [f"MTP head: {source.mtp_layers} layer(s) kept in {MTP_SHARD}"
                 if source.mtp_layers else "MTP head: none in the source (trunk only)"]
        if not tokenizer_files:
            extra.append("no tokenizer files found in the source")
        _print_summary(f"[mlx-mtp] wrote {dst} ({_fmt_bytes(total_size)}):", rows, extra)
    return summary


# --------------------------------------------------------------------------
# add-mtp
# --------------------------------------------------------------------------

# Text-config fields that must agree for a head to fit a trunk.
_SHAPE_FIELDS = (
    "hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size",
)


def _config_mismatches(dst_cfg: dict, src_cfg: dict) -> List[str]:
    # Compare effective values (e.g. head_dim derived when absent).
    a = HybridArgs.from_dict(_text(dst_cfg))
    b = HybridArgs.from_dict(_text(src_cfg))
    out = []
    for k in _SHAPE_FIELDS:
        if k == "intermediate_size" and a.num_experts:
            continue  # MoE heads have no dense MLP
        if getattr(a, k) != getattr(b, k):
            out.append(f"{k}: model {getattr(a, k)} vs source {getattr(b, k)}")
    return out


def _source_is_raw_hf(tensors: Dict[str, Tuple[Path, dict]], mtp_keys: List[str]) -> bool:
    conv = [e["shape"] for k, (_, e) in tensors.items() if k.endswith("conv1d.weight")]
    if conv:
        return any(s[-1] != 1 for s in conv)
    # A head-only source: MLX conversions use language_model.mtp.* or switch_mlp.
    return not any(k.startswith("language_model.") or ".switch_mlp." in k for k in mtp_keys)


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
    wanted = set(mtp_keys)
    weights = {}
    total = sum(f.stat().st_size for f in files)
    with tqdm(total=total, desc="reading", unit="B", unit_scale=True,
              disable=not verbose) as bar:
        for f in files:
            weights.update({k: v for k, v in mx.load(str(f)).items() if k in wanted})
            bar.update(f.stat().st_size)
    _check_foreign_quant(weights, src)

    model = _build_model(dst_cfg, n_layers)
    try:
        weights = model.sanitize(weights, raw_hf=_source_is_raw_hf(tensors, mtp_keys))
    except MissingMTPWeightsError as e:
        raise ConversionError(_incomplete_head(src, e, "Use a complete original checkpoint "
                                                        "as --source.")) from e
    head = model.text.mtp
    prefix = next(k for k in weights if is_mtp_key(k)).split("mtp.")[0] + "mtp."
    head_weights = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
    if any(k.endswith(".scales") for k in head_weights):
        q = copy.deepcopy(_config_quantization(src_cfg) or {})
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
    _recover_stale(Path(model_path).expanduser().absolute(), restore=True, verbose=verbose)
    dst = _check_model_dir(model_path, "Model").resolve()  # swap the real directory
    src = _check_model_dir(source_path, "Source")
    if dst.resolve() == src.resolve():
        raise ConversionError("--model and --source are the same directory.")
    dst_cfg, src_cfg = load_config(dst), load_config(src)
    dst_family, src_family = _family(dst_cfg), _family(src_cfg)
    try:
        get_model_module(dst_cfg.get("model_type", ""))
    except UnsupportedModelError as e:
        raise ConversionError(str(e)) from e
    if dst_family != src_family:
        raise ConversionError(
            f"The source is a {src_family!r} model but {dst} is {dst_family!r}: its MTP head "
            "cannot fit. Use the original checkpoint this model was converted from."
        )

    dst_tensors = _checkpoint_tensors(dst)
    existing = sorted(k for k in dst_tensors if is_mtp_key(k))
    if existing and not force:
        files = sorted({dst_tensors[k][0].name for k in existing})
        raise ConversionError(
            f"{dst} already has an MTP head ({len(existing)} mtp.* tensors in "
            f"{', '.join(files)}). Pass --force to replace it."
        )
    src_tensors = _checkpoint_tensors(src)
    mtp_keys = sorted(k for k in src_tensors if is_mtp_key(k))
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
    n_layers = _count_mtp_layers(mtp_keys) or max(_config_mtp_layers(src_cfg), 1)

    model, head, prefix, packed = _load_mtp_head(src, src_cfg, dst_cfg, src_tensors,
                                                  mtp_keys, n_layers, verbose)
    dst_dtype = _float_dtype_of(dst_tensors)
    if dst_dtype is not None:
        _cast(head, dst_dtype)

    # Precision: like the model, unless --mtp-bits says otherwise.
    dst_quant = _config_quantization(dst_cfg)
    dst_quantized = any(k.endswith(".scales") for k in dst_tensors if not is_mtp_key(k))
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
    same = [(p, packed[p]) for p, m in head.named_modules() if p in packed and hasattr(m, "bits")
            and (m.bits, m.group_size, m.mode) == (packed[p].bits, packed[p].group_size,
                                                   packed[p].mode)]
    if same:
        head.update_modules(tree_unflatten(same))
        if dst_dtype is not None:
            _cast(head, dst_dtype)  # their scales/biases

    head_params = {prefix + k: v for k, v in tree_flatten(head.parameters())}
    rows = _summarize(head_params, model)

    # New config: MTP layer count, and the head's quantization entries.
    new_cfg = copy.deepcopy(dst_cfg)
    _set_config_mtp_layers(new_cfg, n_layers)
    quant = None
    if dst_quant:
        quant = {k: v for k, v in copy.deepcopy(dst_quant).items()
                 if not is_mtp_key(k + ".")}
        quant.update(record)
    elif bits is not None:
        quant = dict(scheme.default(), **record)
    for c in (new_cfg, _text(new_cfg)):
        c.pop("quantization", None)
        c.pop("quantization_config", None)
    if quant is not None:
        new_cfg["quantization"] = quant
        new_cfg["quantization_config"] = copy.deepcopy(quant)

    with _staging(dst, verbose, restore=True) as tmp:
        _link_tree(dst, tmp)
        # Drop the old head (--force): whole mtp-only files, or mtp.* keys of mixed files.
        weight_map = {k: f.name for k, (f, _) in dst_tensors.items()}
        sizes = {k: _entry_nbytes(e) for k, (_, e) in dst_tensors.items()}
        for fname in sorted({weight_map[k] for k in existing}):
            keep = [k for k, f in weight_map.items() if f == fname and not is_mtp_key(k)]
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

    summary = {"path": str(dst), "mtp_layers": n_layers, "replaced": bool(existing),
               "mtp_bits": bits or 16, "quantization": quant, "parts": rows}
    if verbose:
        what = f"{bits}-bit" if bits else "floating point"
        _print_summary(
            f"[mlx-mtp] {'replaced' if existing else 'added'} the MTP head of {src} in {dst} "
            f"({n_layers} layer(s), {what}, in {MTP_SHARD}):", rows, [])
    return summary


def _entry_nbytes(entry: dict) -> int:
    start, end = entry.get("data_offsets", (0, 0))
    return int(end) - int(start)


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------

def add_convert_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--hf-path", "--model", dest="hf_path", required=True,
                        help="Local Hugging Face checkpoint (single file or sharded), or an "
                             "MLX model for --dequantize.")
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
    parser.add_argument("--max-shard-size", type=float, default=DEFAULT_MAX_SHARD_GB,
                        metavar="GB", help="Maximum size of a weight file in GB (default: 5).")
    return parser


def add_add_mtp_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", required=True,
                        help="MLX model to add the head to (e.g. an mlx-lm conversion).")
    parser.add_argument("--source", required=True,
                        help="Original checkpoint holding mtp.* weights (only the shards "
                             "holding them are read).")
    parser.add_argument("--mtp-bits", type=int, default=None, choices=MTP_BITS,
                        help="Precision of the head: 4, 8, or 16 (floating point). Default: "
                             "the model's own quantization (floating point if it has none).")
    parser.add_argument("--force", action="store_true",
                        help="Replace a head the model already has.")
    return parser


def _run(command: str, fn) -> int:
    try:
        with _terminate_as_interrupt():
            fn()
    except (ConversionError, ModelLoadError, UnsupportedModelError) as e:
        print(f"mlx-mtp {command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"mlx-mtp {command}: interrupted; nothing was changed.", file=sys.stderr)
        return 130
    except OSError as e:  # disk full, permissions...: nothing was changed either
        print(f"mlx-mtp {command}: error: {e}. Nothing was changed.", file=sys.stderr)
        return 1
    return 0


def run_convert(args) -> int:
    return _run("convert", lambda: convert(
        args.hf_path, args.mlx_path, quantize=args.quantize, q_bits=args.q_bits,
        q_group_size=args.q_group_size, mtp_bits=args.mtp_bits, dtype=args.dtype,
        dequantize=args.dequantize,
        max_shard_size_gb=getattr(args, "max_shard_size", DEFAULT_MAX_SHARD_GB),
    ))


def run_add_mtp(args) -> int:
    return _run("add-mtp", lambda: add_mtp(args.model, args.source, mtp_bits=args.mtp_bits,
                                           force=args.force))
