"""A checkpoint's files read defensively: JSON objects and safetensors headers.

Every way such a file can be unusable (missing, a directory, a symlink loop, invalid
JSON, a JSON list, a header longer than the file or than safetensors allows, an entry
without a dtype) becomes a ``ModelLoadError`` naming the file, before any tensor is read.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Dict

import mlx.core as mx

from ...errors import ModelLoadError

# The safetensors library refuses longer headers (its MAX_HEADER_SIZE): a larger length
# field is damage, and is refused before that many bytes are read.
MAX_HEADER_BYTES = 100_000_000


def read_json_object(path: Path, what: str = "") -> dict:
    """The JSON object in ``path``; ``what`` names the file's role in the message."""
    name = f"{path}{f' ({what})' if what else ''}"
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except OSError as e:  # a directory, a symlink loop, unreadable
        raise ModelLoadError(f"{name} cannot be read: {e.strerror or e}.") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{name} is not valid JSON ({e}); the file is damaged.") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{name} does not hold a JSON object; the file is damaged.")
    return data


def damaged(f: Path, why: str) -> ModelLoadError:
    return ModelLoadError(f"{f} is not a readable safetensors file ({why}). It is probably "
                          "truncated or corrupt (an interrupted download?): download it again.")


def _header_entry_ok(entry) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("dtype"), str)
            and isinstance(entry.get("shape"), list)
            and all(isinstance(d, int) and d >= 0 for d in entry["shape"])
            and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2
            and all(isinstance(o, int) and o >= 0 for o in entry["data_offsets"]))


def _header_length(fh, f: Path, size: int) -> int:
    head = fh.read(8)
    if len(head) != 8:
        raise damaged(f, "empty" if not head else "no header")
    (n,) = struct.unpack("<Q", head)
    if n > min(size - 8, MAX_HEADER_BYTES):
        raise damaged(f, f"invalid header length {n}")
    return n


def read_safetensors_header(f: Path) -> Dict[str, dict]:
    """Tensor name -> {"dtype", "shape", "data_offsets"}, checked against the file's size,
    without reading the data."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            n = _header_length(fh, f, size)
            raw = fh.read(n)
    except OSError as e:  # a directory, a symlink loop, unreadable
        raise damaged(f, e.strerror or str(e)) from e
    try:
        header = json.loads(raw)
        header.pop("__metadata__", None)
    except (ValueError, UnicodeDecodeError, AttributeError) as e:
        raise damaged(f, f"invalid header: {e}") from e
    bad = next((name for name, e in header.items() if not _header_entry_ok(e)), None)
    if bad is not None:
        raise damaged(f, f"invalid header entry for {bad!r}: needs dtype, shape and "
                         "data_offsets")
    end = max((e["data_offsets"][1] for e in header.values()), default=0)
    if 8 + n + end > size:
        raise damaged(f, f"{size} bytes, the header needs {8 + n + end}")
    return header


def load_safetensors(f: Path) -> Dict[str, mx.array]:
    """``mx.load`` (lazy) of one file, its header checked first (``read_safetensors_header``);
    a damaged file is a user error, not a traceback."""
    read_safetensors_header(f)
    try:
        return mx.load(str(f))
    except RuntimeError as e:  # mx.load checks the header and the data offsets
        raise damaged(f, str(e)) from e
