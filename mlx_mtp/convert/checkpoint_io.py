"""Checkpoint files on disk: safetensors headers, shard/index/config writing, and the
staging directories that make ``convert`` and ``add-mtp`` atomic (swap, recovery of
killed runs, SIGTERM/SIGHUP as Ctrl-C).
"""

from __future__ import annotations

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
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
from tqdm import tqdm

from .common import ConversionError, _param_bytes, _text, _warn, is_mtp_key
from ..models import UnsupportedModelError
from ..models.loader import ModelLoadError, weight_files


def read_tensors(files: List[Path], wanted=None, verbose: bool = True) -> Dict[str, mx.array]:
    """Load safetensors files (lazily) with a progress bar; only ``wanted`` keys if given."""
    weights = {}
    total = sum(f.stat().st_size for f in files)
    with tqdm(total=total, desc="reading", unit="B", unit_scale=True,
              disable=not verbose) as bar:
        for f in files:
            part = mx.load(str(f))  # lazy: data is read when used
            weights.update(part if wanted is None else
                           {k: v for k, v in part.items() if k in wanted})
            bar.update(f.stat().st_size)
    return weights

INDEX_FILE = "model.safetensors.index.json"
MTP_SHARD = "mtp.safetensors"
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
STAGING_TAG = ".mlx-mtp-"


# --------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------

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


def run_guarded(command: str, fn) -> int:
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
