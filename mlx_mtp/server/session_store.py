"""Prompt-prefix states on disk (``serve --prompt-cache-dir``): sessions survive restarts.

Each entry is one safetensors file holding a ``DecoderState`` (trunk KV cache, Gated
DeltaNet conv + recurrent state, MTP cache, the owed MTP pairs and the last prompt
hidden), its key tokens, and metadata naming the model it was computed with. Nothing
is unpickled: a cache directory can only feed arrays in, and only into the model whose
fingerprint it carries.

* Content-addressed: the file name is a hash of the model fingerprint and the key tokens;
  the stored tokens and fingerprint are checked again when a file is read.
* Atomic: written to a fresh temp file (``mkstemp``: created exclusively, never through
  a link) then fsync + ``os.replace`` + directory fsync, so a crash leaves a stray temp
  file (swept later, whatever it is) and never a readable half entry.
* Proven: the metadata carries a SHA-256 of the header and the data section (an HMAC
  under a key kept outside the directory with ``key``: ``session_proof.py``), checked
  before any array is built (entries are read without following links); a truncated,
  corrupted or unverifiable file is dropped with a log line and the prompt runs cold.
  A state that proves but does not fit the model (NaN or infinite values here; caches of
  the wrong kind or shape when restored or joined, ``decode/batch.py``) is deleted too.
* Size-bounded LRU over this model's entries: a file's mtime is its last use (touched on
  every hit), the oldest go first.
* Writes never stall the scheduler: the engine hands over arrays it has already evaluated
  (as zero-copy NumPy views) and a background thread writes them; when its bounded queue
  is full the entry is skipped (the in-memory cache still has it).

Only the engine thread calls ``lookup``/``put``/``touch``; the writer thread only writes
files and updates the index under a lock.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import stat
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..decode.sequence import check_state_fits
from ..decode.speculative import DecoderState
from ..decode.step import OwedPairs
from ..models.cache.fit import nonfinite_arrays
from ..models.cache.kv import CACHE_KINDS
from .session_proof import check_digest, entry_digest

log = logging.getLogger("mlx_mtp.server")

FORMAT = "mlx-mtp-prefix-state-1"
SUFFIX = ".safetensors"
STALE_TMP_SECONDS = 600.0  # older temp files are left over from a crash
# Safetensors dtype codes; bfloat16 is written from its uint16 bits.
_CODES = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.uint32: "U32",
          mx.int32: "I32", mx.uint16: "U16", mx.int64: "I64", mx.uint8: "U8"}


def model_fingerprint(model) -> str:
    """Identity of the weights a state was computed with (and of how they are run).

    Parameter names, shapes, dtypes and the first values of each (cheap: no full pass
    over the weights), plus the MLX version, BLAS routing and KV-cache quantization
    (``--kv-bits``), which decide the bits and kinds of a recomputed state.
    """
    from mlx.utils import tree_flatten

    kv = "" if model.kv_quantization is None else f"|kv {model.kv_quantization}"
    h = hashlib.sha256(f"{FORMAT}|mlx {mx.__version__}|blas "
                       f"{os.environ.get('MLX_MTP_BLAS', '')}{kv}".encode())
    params = tree_flatten(model.parameters())
    heads = [p.reshape(-1)[:16] for _, p in params]
    heads = [p.view(mx.uint16) if p.dtype == mx.bfloat16 else p for p in heads]
    mx.eval(heads)
    for (name, p), head in zip(params, heads):
        h.update(f"|{name}:{p.dtype}:{tuple(p.shape)}:".encode())
        h.update(np.asarray(head).tobytes())
    return h.hexdigest()[:32]


@dataclass
class DiskEntry:
    path: Path
    nbytes: int
    has_mtp: bool
    mtime: float


def _state_tensors(state: DecoderState) -> Tuple[Dict[str, mx.array], dict]:
    """The state's arrays by name, and the layout needed to rebuild it."""
    tensors: Dict[str, mx.array] = {}
    layout = {"n_processed": state.n_processed, "trunk": [], "mtp": None,
              "owed": len(state.owed.hidden), "last_hidden": state.last_hidden is not None}

    def add_layers(caches, prefix):
        kinds = []
        for i, c in enumerate(caches):
            if CACHE_KINDS.get(type(c).kind) is not type(c):
                raise TypeError(f"cannot store a {type(c).__name__} on disk")
            arrays = c.state
            filled = arrays[0] is not None
            offset, *more_meta = c.meta_state  # more: e.g. a window cache's window
            kinds.append([c.kind, int(offset), filled, *more_meta])
            if filled:
                for name, a in zip(c.state_names, arrays):
                    tensors[f"{prefix}.{i}.{name}"] = a
        return kinds

    layout["trunk"] = add_layers(state.cache, "c")
    if state.mtp_cache is not None:
        layout["mtp"] = add_layers(state.mtp_cache, "m")
    for i, (h, t) in enumerate(zip(state.owed.hidden, state.owed.tokens)):
        tensors[f"o.h.{i}"], tensors[f"o.t.{i}"] = h, t
    if state.last_hidden is not None:
        tensors["last_hidden"] = state.last_hidden
    return tensors, layout


def _state_from_tensors(t: Dict[str, mx.array], layout: dict) -> DecoderState:
    def layers(kinds, prefix):
        out = []
        for i, (kind, offset, filled, *more_meta) in enumerate(kinds):
            cls = CACHE_KINDS.get(kind)
            if cls is None:
                raise ValueError(f"unknown cache kind {kind!r}")
            arrays = tuple(t[f"{prefix}.{i}.{n}"] for n in cls.state_names) if filled else None
            try:
                out.append(cls.from_state(arrays, (str(int(offset)), *map(str, more_meta))))
            except ValueError as e:
                raise ValueError(f"layer {prefix}.{i}: {e}") from e
        return out

    n_owed = int(layout["owed"])
    return DecoderState(
        n_processed=int(layout["n_processed"]),
        cache=layers(layout["trunk"], "c"),
        mtp_cache=None if layout["mtp"] is None else layers(layout["mtp"], "m"),
        owed=OwedPairs([t[f"o.h.{i}"] for i in range(n_owed)],
                       [t[f"o.t.{i}"] for i in range(n_owed)]),
        last_hidden=t["last_hidden"] if layout["last_hidden"] else None,
    )


# Safetensors dtype codes -> the NumPy dtype their bytes are read as (bf16: its bits).
_NP = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "U32": "<u4", "I32": "<i4", "U16": "<u2",
       "I64": "<i8", "U8": "u1"}
_READ_CHUNK = 8 << 20


def _open_entry(path: Path):
    """An entry opened for reading without following a link; (file, size)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ValueError("not a regular file")
    return os.fdopen(fd, "rb"), st.st_size


def _parse_header(f, size: int) -> Tuple[dict, int]:
    raw = f.read(8)
    if len(raw) != 8:
        raise ValueError("truncated header")
    (n,) = struct.unpack("<Q", raw)
    if n > min(size - 8, 64 << 20):
        raise ValueError("header longer than the file")
    header = json.loads(f.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
              default=0)
    if 8 + n + end != size:
        raise ValueError(f"size {size} != {8 + n + end} (truncated or padded)")
    return header, 8 + n


def read_header(path: Path) -> Tuple[dict, int]:
    """A safetensors file's header and data start; ValueError if it is not whole."""
    f, size = _open_entry(path)
    with f:
        return _parse_header(f, size)


def read_entry(path: Path, key: Optional[bytes] = None) -> Tuple[Dict[str, mx.array], dict]:
    """An entry's arrays and metadata, read once and proven against its digest (keyed with
    ``key``) before any array is built; ValueError on any mismatch."""
    f, size = _open_entry(path)
    with f:
        header, start = _parse_header(f, size)
        data = bytearray(size - start)
        view, got = memoryview(data), 0
        while got < len(data):
            n = f.readinto(view[got : got + _READ_CHUNK])
            if not n:
                raise ValueError("file shrank while read")
            got += n
    meta = dict(header.get("__metadata__") or {})
    want = meta.pop("digest", "")
    check_digest(dict(header, __metadata__=meta), [data], want, key)
    header.pop("__metadata__", None)
    arrays = {}
    for name, spec in header.items():
        a, b = spec["data_offsets"]
        dtype = np.dtype(_NP[spec["dtype"]])
        values = np.frombuffer(data, dtype, (b - a) // dtype.itemsize, a).reshape(spec["shape"])
        arr = mx.array(values)
        arrays[name] = arr.view(mx.bfloat16) if spec["dtype"] == "BF16" else arr
    return arrays, meta


def write_safetensors(f, arrays: Dict[str, np.ndarray], codes: Dict[str, str],
                      metadata: Dict[str, str], key: Optional[bytes] = None):
    """Write to the open file ``f`` (with the entry's digest, keyed with ``key``, in its
    metadata) and fsync."""
    header, offset = {"__metadata__": dict(metadata)}, 0
    for name, a in arrays.items():
        header[name] = {"dtype": codes[name], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    arrays = {k: np.ascontiguousarray(a) for k, a in arrays.items()}
    header["__metadata__"]["digest"] = entry_digest(header, [a.data for a in arrays.values()],
                                                    key)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for a in arrays.values():
        f.write(a.data)
    f.flush()
    os.fsync(f.fileno())


def _sweep_tmp(path: Path, now: float):
    """Delete a temp file left by a crash: any kind (file, link, FIFO) once stale; a link
    at once (this store never makes one)."""
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode) or now - st.st_mtime > STALE_TMP_SECONDS:
            if stat.S_ISDIR(st.st_mode):
                return
            os.unlink(path)
    except OSError:
        pass


class SessionStore:
    def __init__(self, directory, model_id: str, max_bytes: int = 10 << 30,
                 min_tokens: int = 1024, queue_size: int = 4, key: Optional[bytes] = None,
                 reference: Optional[DecoderState] = None):
        """``key``: entries are proven by an HMAC under it (``session_proof.py``);
        ``reference``: a state the model computed here, which entries' caches must fit."""
        self.key, self.reference = key, reference
        self.dir = Path(directory).expanduser()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.model_id = model_id
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self.index: Dict[Tuple[int, ...], DiskEntry] = {}
        self.nbytes = 0
        self.hits = 0  # restores
        self.written = 0
        self.skipped = 0  # writes dropped because the queue was full
        self.on_restore = None  # called with the number of tokens restored
        self._lock = threading.Lock()
        self._queue: "queue.Queue" = queue.Queue(maxsize=queue_size)
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="mlx-mtp-prompt-cache",
                                        daemon=True)
        self._writer.start()

    def file_for(self, key: Sequence[int]) -> Path:
        h = hashlib.sha256(self.model_id.encode() + b"|")
        h.update(np.asarray(key, np.uint32).tobytes())
        return self.dir / (h.hexdigest()[:40] + SUFFIX)

    # -- index ------------------------------------------------------------------------
    def _scan(self):
        now = time.time()
        foreign = 0
        for path in self.dir.iterdir():
            if path.name.endswith(".tmp"):  # a crashed write (or one still running)
                _sweep_tmp(path, now)
                continue
            if not path.name.endswith(SUFFIX):
                continue
            try:
                key, has_mtp = self._check(path)
            except ForeignEntry:
                foreign += 1
                continue
            except Exception as e:
                log.warning("Prompt cache: ignoring unreadable %s (%s)", path.name, e)
                continue
            st = os.lstat(path)
            self._add(key, DiskEntry(path, st.st_size, has_mtp, st.st_mtime))
        if foreign:
            log.info("Prompt cache: %d entries in %s belong to another model (ignored)",
                     foreign, self.dir)
        self._evict()
        log.info("Prompt cache: %d entries (%.1f MB) restorable from %s", len(self.index),
                 self.nbytes / 1e6, self.dir)

    def _check(self, path: Path) -> Tuple[Tuple[int, ...], bool]:
        """The key tokens of a well-formed entry of this model."""
        header, start = read_header(path)
        meta = header.get("__metadata__") or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}")
        if meta.get("model") != self.model_id:
            raise ForeignEntry(path.name)
        spec = header["tokens"]
        if spec["dtype"] != "U32" or len(spec["shape"]) != 1:
            raise ValueError("bad tokens tensor")
        a, b = spec["data_offsets"]
        f, _ = _open_entry(path)
        with f:
            f.seek(start + a)
            key = tuple(int(x) for x in np.frombuffer(f.read(b - a), np.dtype("<u4")))
        if self.file_for(key).name != path.name:
            raise ValueError("name does not match its content")
        return key, json.loads(meta["layout"])["mtp"] is not None

    def _add(self, key, entry: DiskEntry):
        old = self.index.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes
        self.index[key] = entry
        self.nbytes += entry.nbytes

    def discard(self, key):
        """Delete an entry found unusable after it was restored."""
        self._drop(tuple(key), delete=True)

    def _drop(self, key, delete: bool):
        with self._lock:
            e = self.index.pop(key, None)
            if e is not None:
                self.nbytes -= e.nbytes
        if e is not None and delete:
            try:
                e.path.unlink()
            except OSError:
                pass

    def __len__(self):
        return len(self.index)

    def __contains__(self, key) -> bool:
        return tuple(key) in self.index

    # -- engine side ------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int], need_mtp: bool,
               longer_than: int = 0) -> Optional[Tuple[Tuple[int, ...], DecoderState]]:
        """The longest stored prefix of ``tokens`` longer than ``longer_than``, loaded.

        An entry that fails to load is dropped (and deleted) with a log line; the next
        best one is tried.
        """
        tokens = tuple(tokens)
        with self._lock:
            # The last-token check first: most keys differ there, and it costs no slice.
            candidates = sorted((k for k, e in self.index.items()
                                 if longer_than < len(k) <= len(tokens)
                                 and k[-1] == tokens[len(k) - 1]
                                 and (e.has_mtp or not need_mtp) and tokens[:len(k)] == k),
                                key=len, reverse=True)
        for key in candidates:
            try:
                state = self._load(key)
            except Exception as e:
                log.warning("Prompt cache: dropping unreadable entry %s (%s)",
                            self.file_for(key).name, e)
                self._drop(key, delete=True)
                continue
            self.hits += 1
            self.touch(key)
            if self.on_restore is not None:
                self.on_restore(state.n_processed)
            return key, state
        return None

    def _load(self, key) -> DecoderState:
        path = self.index[key].path
        arrays, meta = read_entry(path, self.key)  # whole, and its bytes proven
        if meta.get("format") != FORMAT or meta.get("model") != self.model_id:
            raise ValueError("not this model's entry")
        if tuple(np.asarray(arrays["tokens"]).tolist()) != key:
            raise ValueError("stored tokens differ from the key")
        layout = json.loads(meta["layout"])
        state = _state_from_tensors(arrays, layout)
        if state.n_processed != len(key) - 1:
            raise ValueError("state length does not match its key")
        if nonfinite_arrays(state.arrays() + [a for a in [state.last_hidden] if a is not None]):
            raise ValueError("NaN or infinite values in the state")
        ref = self.reference
        if ref is not None:  # shapes and dtypes too, not only kinds
            check_state_fits(state, ref.cache, ref.mtp_cache if state.mtp_cache else None)
        return state

    def touch(self, key):
        e = self.index.get(tuple(key))
        if e is None:
            return
        e.mtime = time.time()
        try:
            os.utime(e.path, (e.mtime, e.mtime), follow_symlinks=False)
        except OSError:  # evicted by another process sharing the directory
            self._drop(tuple(key), delete=False)

    def put(self, key: Sequence[int], state: DecoderState, has_mtp: bool) -> bool:
        """Queue an evaluated state for writing; False when skipped."""
        key = tuple(key)
        if len(key) < self.min_tokens:
            return False
        old = self.index.get(key)
        if old is not None and (old.has_mtp or not has_mtp):
            self.touch(key)
            return False
        tensors, layout = _state_tensors(state)
        tensors["tokens"] = mx.array(key, mx.uint32)
        # Zero-copy NumPy views of evaluated arrays: the writer thread makes no MLX calls.
        views = {k: a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
                 for k, a in tensors.items()}
        mx.eval(list(views.values()))
        job = (key, {k: np.asarray(v) for k, v in views.items()},
               {k: _CODES[a.dtype] for k, a in tensors.items()},
               {"format": FORMAT, "model": self.model_id, "layout": json.dumps(layout)},
               has_mtp)
        try:
            self._queue.put_nowait(job)
            return True
        except queue.Full:
            self.skipped += 1
            log.debug("Prompt cache: write queue full, %d-token prefix not saved", len(key))
            return False

    def flush(self, timeout: float = 60.0):
        """Wait until queued writes are on disk (tests, shutdown)."""
        deadline = time.time() + timeout
        while self._queue.unfinished_tasks and time.time() < deadline:
            time.sleep(0.01)

    # -- writer thread ----------------------------------------------------------------
    def _write_loop(self):
        while True:
            key, arrays, codes, meta, has_mtp = self._queue.get()
            try:
                self._write(key, arrays, codes, meta, has_mtp)
            except Exception as e:  # a full disk must not take the server down
                log.warning("Prompt cache: could not write a %d-token prefix (%s)",
                            len(key), e)
            finally:
                self._queue.task_done()

    def _write(self, key, arrays, codes, meta, has_mtp):
        path = self.file_for(key)
        # mkstemp: a fresh name, created exclusively (O_EXCL), never through a link
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=self.dir)
        try:
            with os.fdopen(fd, "wb") as f:
                write_safetensors(f, arrays, codes, meta, self.key)
            os.replace(tmp, path)
        finally:
            try:
                os.unlink(tmp)  # only after a failure: the rename took it otherwise
            except FileNotFoundError:
                pass
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself survives a power loss
        finally:
            os.close(fd)
        st = os.lstat(path)
        with self._lock:
            self._add(key, DiskEntry(path, st.st_size, has_mtp, st.st_mtime))
        self.written += 1
        self._evict()

    def _evict(self):
        """Delete the least recently used entries beyond ``max_bytes``."""
        with self._lock:
            victims = []
            total = self.nbytes
            for k in sorted(self.index, key=lambda k: self.index[k].mtime):
                if total <= self.max_bytes:
                    break
                total -= self.index[k].nbytes
                victims.append(k)
        for k in victims:
            self._drop(k, delete=True)


class ForeignEntry(Exception):
    """An entry written for other weights (kept: that model may come back)."""
