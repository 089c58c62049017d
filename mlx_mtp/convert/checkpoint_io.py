"""Checkpoint files on disk: THE checkpoint writer (``write_checkpoint``: safetensors
shards, index, config, tokenizer files, published atomically) used by convert, add-mtp,
train export and the tests' tiny checkpoints, and the staging directories that make
them atomic (swap, recovery of killed runs, SIGTERM/SIGHUP as Ctrl-C).
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
import sys
import threading
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
from tqdm import tqdm

from .common import ConversionError, _param_bytes, _warn
from ..models import UnsupportedModelError
from ..models.io.layout import CheckpointError, is_mtp_key, mlx_config, text_config
from ..models.io.files import load_safetensors, read_safetensors_header
from ..models.io.loader import INDEX_FILE, weight_files


def read_tensors(files: List[Path], wanted=None, verbose: bool = True) -> Dict[str, mx.array]:
    """Load safetensors files (lazily) with a progress bar; only ``wanted`` keys if given."""
    weights = {}
    total = sum(f.stat().st_size for f in files)
    with tqdm(total=total, desc="reading", unit="B", unit_scale=True,
              disable=not verbose) as bar:
        for f in files:
            part = load_safetensors(f)  # lazy: data is read when used
            weights.update(part if wanted is None else
                           {k: v for k, v in part.items() if k in wanted})
            bar.update(f.stat().st_size)
    return weights


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

def _checkpoint_tensors(path: Path) -> Dict[str, Tuple[Path, dict]]:
    """Every tensor of a checkpoint -> (file, header entry), from headers only."""
    out = {}
    for f in weight_files(path):  # checks that the index's shards exist
        for k, entry in read_safetensors_header(f).items():
            out[k] = (f, entry)
    return out


# --------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------

def _save_shard(path: Path, tensors: Dict[str, mx.array], bar, fmt: str = "mlx") -> None:
    """Compute (quantize/cast) and write one shard. Tests patch this to simulate a crash."""
    for v in tensors.values():
        mx.eval(v)
        bar.update(v.nbytes)
    mx.save_safetensors(str(path), tensors, metadata={"format": fmt})


def _make_shards(weights: Dict[str, mx.array], max_bytes: Optional[int],
                 num_shards: Optional[int]) -> List[Dict[str, mx.array]]:
    """Split by size (``max_bytes``), into ``num_shards`` by tensor count, or not at all."""
    if num_shards:
        keys = list(weights)
        per = -(-len(keys) // num_shards)
        return [{k: weights[k] for k in keys[i * per:(i + 1) * per]} for i in range(num_shards)
                if keys[i * per:(i + 1) * per]]
    shards: List[Dict[str, mx.array]] = []
    size = 0
    for k, v in weights.items():
        if not shards or (max_bytes and size + v.nbytes > max_bytes and shards[-1]):
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += v.nbytes
    return shards


def _write_weights(out: Path, weights: Dict[str, mx.array], max_shard_bytes: Optional[int],
                   verbose: bool, num_shards: Optional[int] = None, mtp_file: bool = True,
                   fmt: str = "mlx", is_head=is_mtp_key) -> Dict[str, str]:
    """Weight shards (the head's tensors, ``is_head``, in ``mtp.safetensors`` when
    ``mtp_file``, else after the trunk's); returns the weight map. Consumes ``weights``."""
    head = {k: v for k, v in weights.items() if is_head(k)} if mtp_file else {}
    if mtp_file:
        trunk = {k: v for k, v in weights.items() if not is_head(k)}
    else:  # as released checkpoints tend to: the head in the last shard
        trunk = {k: weights[k] for k in sorted(weights, key=lambda k: (is_head(k), k))}
    weights.clear()
    shards = _make_shards(trunk, max_shard_bytes, num_shards)
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
            _save_shard(out / name, shard, bar, fmt)
            weight_map.update({k: name for k in shard})
            del shard
    return weight_map


def write_checkpoint(out, weights: Dict[str, mx.array], config: dict, *,
                     tokenizer_from: Optional[Path] = None,
                     tokenizer_files: Tuple[str, ...] = None,
                     extra_files: Optional[Dict[str, str]] = None,
                     dtype: Optional[mx.Dtype] = None, max_shard_bytes: Optional[int] = None,
                     num_shards: Optional[int] = None, mtp_file: bool = True,
                     fmt: str = "mlx", verbose: bool = False,
                     is_head=is_mtp_key) -> Dict[str, str]:
    """Write a checkpoint directory and publish it atomically; returns the weight map.

    Weights go into shards (by ``max_shard_bytes`` or ``num_shards``; with ``mtp_file``
    the head gets its own ``mtp.safetensors``, which plain mlx-lm never opens), with an
    index when there is more than one file, then config.json, the tokenizer files of
    ``tokenizer_from`` and ``extra_files`` (name -> text). ``dtype`` casts floating-point
    weights except ``A_log``. ``fmt`` is the safetensors ``format`` metadata ("pt" for
    the Hugging Face layout). ``is_head``: which keys are the MTP head's. An existing
    ``out`` is replaced as a whole, never mixed. Consumes ``weights``.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if dtype is not None:
        for k, v in weights.items():
            if mx.issubdtype(v.dtype, mx.floating) and not k.endswith("A_log"):
                weights[k] = v.astype(dtype)
    total_size = _param_bytes(weights)
    with _staging(out, verbose) as tmp:
        weight_map = _write_weights(tmp, weights, max_shard_bytes, verbose, num_shards,
                                    mtp_file, fmt, is_head)
        if len(set(weight_map.values())) > 1:
            _write_index(tmp, weight_map, total_size)
        _write_json(tmp / "config.json", config)
        if tokenizer_from is not None:
            _copy_tokenizer(Path(tokenizer_from), tmp, tokenizer_files or TOKENIZER_FILES)
        for name, content in (extra_files or {}).items():
            (tmp / name).write_text(content)
        _publish(tmp, out)
    return weight_map


def _publish(tmp: Path, out: Path):
    try:
        if out.exists():
            shutil.rmtree(_swap_into_place(tmp, out), ignore_errors=True)
        else:
            os.rename(tmp, out)
    except OSError as e:
        raise ConversionError(f"Could not move the new checkpoint into {out}: {e}") from e


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
    """config.json for an MLX output (one plain mlx-lm loads), quantization recorded as
    mlx-lm does."""
    config = mlx_config(config)
    for c in (config, text_config(config)):
        c.pop("quantization", None)
        c.pop("quantization_config", None)
    if quantization:
        config["quantization"] = quantization
        config["quantization_config"] = copy.deepcopy(quantization)
    return config


def _copy_tokenizer(src: Path, out: Path, names: Tuple[str, ...] = TOKENIZER_FILES) -> List[str]:
    copied = []
    for name in names:
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
    except (ConversionError, CheckpointError, UnsupportedModelError) as e:
        print(f"mlx-mtp {command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"mlx-mtp {command}: interrupted; nothing was changed.", file=sys.stderr)
        return 130
    except OSError as e:  # disk full, permissions...: nothing was changed either
        print(f"mlx-mtp {command}: error: {e}. Nothing was changed.", file=sys.stderr)
        return 1
    return 0
