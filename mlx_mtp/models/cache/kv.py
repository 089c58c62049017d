"""Caches for hybrid (Gated DeltaNet + attention) models, with exact rollback.

Two kinds of per-layer state:

* ``KVCache`` for full-attention layers (trunk and MTP head). Rolling back
  ``n`` speculative positions is a pointer move (``trim``); the stale rows are
  overwritten by the next write.
* ``BatchKVCache``: the same for rows of different lengths decoding together.
* ``RecurrentCache`` (``recurrent.py``) for Gated DeltaNet and Mamba-2 layers: a
  convolution window and the recurrent (SSM) state, rolled back by replaying the
  recurrence; sliding-window caches live in ``window.py``, chained MTP layers' caches
  (an attention cache and a pending input) in ``chain.py``, the DSA indexer's keys in
  ``index.py``.

Every cache answers ``accept(n_keep)`` after a speculative (verify) pass:
``n_keep[b]`` is how many of that pass's positions row ``b`` keeps (>= 1, the
first verified token is always committed). The decode step calls it on every
layer without knowing which kind of layer it is.

Every cache speaks one protocol (mlx-lm's shape, ``_Cache`` here), so nothing outside the
cache modules reads a cache field: ``state`` / ``meta_state`` / ``from_state`` (save and load; ``kind``,
``state_names`` name them on disk), ``snapshot()`` / ``restore(snap)`` (undo a step,
by reference), ``merge(caches)`` into a batch (``check_joins(row)`` first: does a row's
cache fit beside ours, ``fit.py``), ``extract(row)``, ``filter(rows)`` (which gives back the
leading columns no kept row uses, ``slots.py``), ``empty(B)``, ``lengths()``
(tokens per row), ``nbytes`` / ``row_nbytes`` (what ``state`` holds) and ``max_positions()``.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_causal_mask
from mlx.utils import tree_map

from .fit import check_array_joins
from .slots import (first_after_padding, first_after_write, squeeze_index, stack_left_padded,
                    without_leading)


def _no_window(window_size: Optional[int]):
    if window_size is not None:
        raise ValueError("sliding-window attention is not supported by mlx-mtp's KV caches")


class _Cache:
    """The protocol's shared part (see the module doc)."""

    kind = ""  # the name a saved cache carries
    state_names: Tuple[str, ...] = ()  # the name of each ``state`` array
    row_kind = ""  # a batch kind: the kind of its rows ("" : this cache's own kind)
    free_axes: Tuple[int, ...] = (0,)  # state axes rows may differ in: rows (and positions)

    @classmethod
    def from_state(cls, state, meta_state):
        """A cache from what ``state`` and ``meta_state`` returned (``state`` None: empty)."""
        c = cls.empty(1)
        if state is not None:
            c.state = state
        c.meta_state = meta_state
        return c

    @classmethod
    def empty(cls, B: int = 1):
        if B != 1:
            raise ValueError(f"a {cls.__name__} holds one row, not {B}")
        return cls()

    def prepare(self, S: int, lengths=None):
        """The next chunk is ``S`` positions (``lengths``: each row's, right-aligned); a
        kind that masks per row records it, others need nothing."""

    def size(self) -> int:
        """Rows held."""
        return 1

    def filter(self, rows: List[int]):
        if list(rows) != [0]:
            raise ValueError(f"a single-row cache cannot keep rows {rows}")

    def extract(self, row: int):
        self.filter([row])
        return self.copy()

    def is_trimmable(self) -> bool:
        return True  # attention caches; a recurrence cannot step back

    def arrays(self) -> List[mx.array]:
        return [a for a in self.state if a is not None]

    def settings(self) -> tuple:
        """What a cache of this kind is built with (a window), equal across a batch."""
        return ()

    @property
    def quantization(self):
        """A quantized kind's ``KVQuantization`` (``--kv-bits``); None: its own precision."""
        return None

    def check_joins(self, row):
        """Raise ValueError unless ``row``, one sequence's cache, can join this cache's rows
        (or an empty cache of the model's): same kind and settings, one row, and each state
        array of our shape (bar ``free_axes``) and dtype (values: ``nonfinite_arrays``)."""
        if (row.row_kind or row.kind) != (self.row_kind or self.kind):
            raise ValueError(f"a {row.kind!r} cache cannot join {self.kind!r} rows")
        if row.size() != 1 or row.settings() != self.settings():
            raise ValueError(f"a {row.kind!r} cache of {row.size()} rows, settings "
                             f"{row.settings()}, cannot join rows of settings {self.settings()}")
        for name, ours, theirs in zip(row.state_names, self.state, row.state):
            check_array_joins(name, ours, theirs, self.free_axes)

    @property
    def nbytes(self) -> int:
        """Bytes of what ``state`` holds now (the server's memory budget reads it)."""
        return sum(a.nbytes for a in self.arrays())

    @property
    def row_nbytes(self) -> int:
        """Bytes per row: a batch's rows are all as long as its longest (holes included)."""
        return self.nbytes // max(1, self.size())

    def max_positions(self) -> Optional[int]:
        """The most positions a row's bounded part (a window) holds (None: none is bounded)."""
        return None


class KVCache(_Cache):
    """Growable key/value cache for one attention layer (one row)."""

    step = 256
    kind = "kv"
    state_names = ("k", "v")
    free_axes = (0, 2)  # rows, positions
    start = 0  # absolute position of stored entry 0 (a window cache drops old entries)

    def __init__(self):
        self.keys: Optional[mx.array] = None  # (B, n_kv_heads, capacity, head_dim)
        self.values: Optional[mx.array] = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        prev = self.offset
        n = keys.shape[2]
        if self.keys is None or prev + n > self.keys.shape[2]:
            B, H, _, Dk = keys.shape
            Dv = values.shape[3]
            grow = ((n + self.step - 1) // self.step) * self.step
            new_k = mx.zeros((B, H, grow, Dk), keys.dtype)
            new_v = mx.zeros((B, H, grow, Dv), values.dtype)
            if self.keys is not None:
                new_k = mx.concatenate([self.keys[..., :prev, :], new_k], axis=2)
                new_v = mx.concatenate([self.values[..., :prev, :], new_v], axis=2)
            self.keys, self.values = new_k, new_v
        self.keys[..., prev : prev + n, :] = keys
        self.values[..., prev : prev + n, :] = values
        self.offset += n
        self.last_write = n
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    @property
    def stored(self) -> int:
        """Entries held: positions ``start`` .. ``offset - 1``."""
        return self.offset - self.start

    @property
    def state(self):
        if self.keys is None:
            return None, None
        return self.keys[..., : self.stored, :], self.values[..., : self.stored, :]

    @state.setter
    def state(self, v):
        self.keys, self.values = v
        self.offset = self.start + (0 if self.keys is None else self.keys.shape[2])

    @property
    def meta_state(self):
        return (str(self.offset),)

    @meta_state.setter
    def meta_state(self, v):
        offset = int(v[0])
        held = 0 if self.keys is None else self.keys.shape[2]
        if held != offset or (self.values is not None and self.values.shape[2] != offset):
            raise ValueError(f"KV length {held} != offset {offset}")
        self.offset = offset

    def snapshot(self):
        # Writes land past ``offset`` (and growing copies the rows below it), so the
        # pointer is enough until something is written below it again.
        return self.keys is None, self.offset

    def restore(self, snap):
        empty, self.offset = snap
        if empty:
            self.keys = self.values = None

    def lengths(self) -> List[int]:
        return [self.offset]

    @classmethod
    def merge(cls, caches) -> "BatchKVCache":
        return BatchKVCache.merge(caches)

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    def accept(self, n_keep):
        """Keep the first ``n_keep[0]`` positions of the last write (one row)."""
        self.trim(self.last_write - n_keep[0])

    def prepare(self, S: int, lengths=None):
        """Per-row chunk lengths (``BatchKVCache``'s interface); one row has no holes."""
        if lengths is not None and list(lengths) != [S]:
            raise ValueError(f"a single-row cache cannot take a padded chunk ({lengths} of {S})")

    def chunk_lengths(self, S: int) -> List[int]:
        return [S]

    def make_mask(self, n: int, return_array: bool = False, window_size: Optional[int] = None):
        """mlx-lm's call. ``return_array``: a boolean (n, offset + n) causal mask instead of
        ``"causal"`` (MLA attention masks its scores with it)."""
        _no_window(window_size)
        if return_array and n > 1:
            return create_causal_mask(n, self.offset)
        return "causal" if n > 1 else None

    def _like(self) -> "KVCache":
        """An empty cache of this kind and settings."""
        return KVCache()

    def copy(self) -> "KVCache":
        c = self._like()
        if self.keys is not None:
            k, v = self.state
            c.keys, c.values = mx.array(k), mx.array(v)
        c.offset, c.start = self.offset, self.start
        return c


# What can be saved, by kind; each cache module adds its kinds, and the package imports
# every module, so importing any cache module fills it.
CACHE_KINDS = {KVCache.kind: KVCache}


def cache_state_arrays(caches) -> List[mx.array]:
    """Every array that makes up the live state (for mx.eval and comparisons)."""
    return [a for c in caches for a in c.arrays()]


def snapshot_caches(caches) -> list:
    return [(c, c.snapshot()) for c in caches]


def restore_caches(snaps):
    for c, snap in snaps:
        c.restore(snap)


class BatchKVCache(_Cache):
    """KV cache for a batch of sequences of different lengths, with per-row rollback.

    All rows write at a shared pointer ``idx``; a (B, capacity) ``valid`` mask marks
    which slots hold a row's tokens (padding and rejected drafts become holes), and
    ``pos`` (B,) is each row's own token count, i.e. its next RoPE position. A chunk
    of S new tokens per row is right-aligned: ``prepare(S, lengths)`` says how many
    of the S are real for each row. Holes are squeezed out when the buffer grows; the
    leading columns no row uses any more are given back when rows leave (``filter``),
    found from ``first`` (``slots.py``), so without a sync.
    """

    step = 256

    def __init__(self, pos: List[int], keys=None, values=None, valid=None, first=None):
        self.keys, self.values = keys, values  # (B, H, cap, D) or None while empty
        self.valid = valid  # (B, cap) bool
        self.idx = keys.shape[2] if keys is not None else 0
        self.pos = list(pos)
        # each row's first column in use (none before it); None: not known (a loaded state)
        self.first = list(first) if first is not None else [0] * len(self.pos)
        self._lengths: Optional[List[int]] = None
        self._S = 0

    kind = "batch_kv"
    row_kind = "kv"
    state_names = ("k", "v", "valid")
    free_axes = (0, 2)  # rows, positions

    @classmethod
    def empty(cls, B: int = 1) -> "BatchKVCache":
        return cls([0] * B)

    def size(self) -> int:
        return len(self.pos)

    def lengths(self) -> List[int]:
        return list(self.pos)

    @property
    def state(self):
        if self.keys is None:
            return None, None, None
        i = self.idx
        return self.keys[..., :i, :], self.values[..., :i, :], self.valid[:, :i]

    @state.setter
    def state(self, v):
        self.keys, self.values, self.valid = v
        self.idx = 0 if self.keys is None else self.keys.shape[2]
        self.first = None  # until the buffer next grows

    @property
    def meta_state(self):
        return tuple(str(p) for p in self.pos)

    @meta_state.setter
    def meta_state(self, v):
        self.pos = [int(p) for p in v]

    def snapshot(self):
        # Writes land past ``idx`` and ``drop_last`` makes a new mask: references suffice.
        return self.idx, list(self.pos), self.first, self.valid, self.keys, self.values

    def restore(self, snap):
        self.idx, pos, self.first, self.valid, self.keys, self.values = snap
        self.pos = list(pos)

    @classmethod
    def merge(cls, caches) -> "BatchKVCache":
        """The rows of single-row and batch caches, in order, in one new batch cache."""
        out = None
        for c in caches:
            b = cls.from_single([c]) if isinstance(c, KVCache) else c._share()
            if out is None:
                out = b
            else:
                out.extend(b)
        return out

    def _share(self) -> "BatchKVCache":
        """A new cache object over the same arrays (they are only ever replaced)."""
        c = BatchKVCache(self.pos, self.keys, self.values, self.valid)
        c.idx, c.first = self.idx, self.first
        return c

    def extract(self, row: int) -> KVCache:
        c = KVCache()
        if self.keys is not None:
            c.state = self.row_state(row)
        c.offset = self.pos[row]
        return c

    @classmethod
    def from_single(cls, caches: List[KVCache]) -> "BatchKVCache":
        """Batch single-sequence caches, left-padded to a common length."""
        return cls([c.offset for c in caches], *stack_left_padded(caches))

    def prepare(self, S: int, lengths: Optional[List[int]] = None):
        """Announce the next chunk (before the forward, so masks see final positions)."""
        self._S = S
        self._lengths = lengths
        if self.keys is not None and self.idx + S > self.keys.shape[2]:
            self._grow(S)

    def chunk_lengths(self, S: int) -> List[int]:
        """Real tokens per row of the chunk ``prepare`` announced (right-aligned in ``S``)."""
        return list(self._lengths) if self._lengths else [S] * len(self.pos)

    @property
    def offset(self) -> mx.array:
        """Per-row RoPE offsets so a row's real tokens continue at its ``pos``."""
        lengths = self.chunk_lengths(self._S)
        return mx.array([p - (self._S - n) for p, n in zip(self.pos, lengths)])

    def _new_valid(self) -> mx.array:
        S = self._S
        if self._lengths is None:
            return mx.ones((len(self.pos), S), mx.bool_)
        return mx.arange(S)[None] >= mx.array([S - n for n in self._lengths])[:, None]

    def update_and_fetch(self, keys, values):
        S = keys.shape[2]
        if self.keys is None:
            B, H, _, D = keys.shape
            self.keys = mx.zeros((B, H, 0, D), keys.dtype)
            self.values = mx.zeros((B, H, 0, values.shape[3]), values.dtype)
            self.valid = mx.zeros((B, 0), mx.bool_)
        if self.idx + S > self.keys.shape[2]:
            self._grow(S)  # first write; later growth happens in prepare()
        self.keys[..., self.idx : self.idx + S, :] = keys
        self.values[..., self.idx : self.idx + S, :] = values
        self.valid[:, self.idx : self.idx + S] = self._new_valid()
        self.first = first_after_write(self, S)
        self.idx += S
        self.last_write = S
        self.pos = [p + n for p, n in zip(self.pos, self.chunk_lengths(S))]
        return self.keys[..., : self.idx, :], self.values[..., : self.idx, :]

    def make_mask(self, S: int, return_array: bool = True, window_size: Optional[int] = None):
        """(B, 1, S, idx + S) boolean: causal and each row's valid slots (always an array)."""
        _no_window(window_size)
        L = self.idx + S
        old = self.valid[:, : self.idx] if self.valid is not None else mx.zeros((len(self.pos), 0), mx.bool_)
        valid = mx.concatenate([old, self._new_valid()], axis=1)
        causal = mx.arange(L)[None] <= (self.idx + mx.arange(S))[:, None]  # (S, L)
        return valid[:, None, None, :] & causal[None, None]

    def drop_last(self, counts: List[int]):
        """Invalidate each row's last ``counts[b]`` written tokens (rejected drafts)."""
        if not any(counts):
            return
        # A row's newest tokens sit just below the shared write pointer.
        i = mx.arange(self.valid.shape[1])[None]
        cut = mx.array([self.idx - c for c in counts])[:, None]
        self.valid = self.valid & ~((i >= cut) & (i < self.idx))
        self.pos = [p - c for p, c in zip(self.pos, counts)]

    def accept(self, n_keep):
        """Row ``b`` keeps the first ``n_keep[b]`` positions of the last write."""
        self.drop_last([self.last_write - n for n in n_keep])

    def trim(self, n: int) -> int:
        """Drop every row's last ``n`` tokens (``KVCache.trim`` for a batch)."""
        self.drop_last([n] * len(self.pos))
        return n

    def _grow(self, S: int):
        """Squeeze out holes (left-pad to the longest row), then add room."""
        gather, new_valid, L, self.first = squeeze_index(self.valid, self.idx)
        k = mx.take_along_axis(self.keys[..., : self.idx, :], gather, axis=2)
        v = mx.take_along_axis(self.values[..., : self.idx, :], gather, axis=2)
        room = ((S + self.step - 1) // self.step) * self.step
        B, H, _, D = k.shape
        self.keys = mx.concatenate([k, mx.zeros((B, H, room, D), k.dtype)], axis=2)
        self.values = mx.concatenate([v, mx.zeros((B, H, room, v.shape[3]), v.dtype)], axis=2)
        self.valid = mx.concatenate([new_valid, mx.zeros((B, room), mx.bool_)], axis=1)
        self.idx = L

    def filter(self, rows: List[int]):
        """Keep ``rows`` and give back the leading columns none of them uses (a new buffer
        with the same room past ``idx``, so the old one is freed)."""
        self.pos = [self.pos[r] for r in rows]
        first = None if self.first is None else [self.first[r] for r in rows]
        self.first = first
        if self.keys is None:
            return
        ix = mx.array(rows)
        n = min(min(first, default=0), self.idx) if first is not None else 0
        self.keys, self.values = tree_map(lambda a: without_leading(a[ix], n, self.idx, 2),
                                          (self.keys, self.values))  # quantized: triples
        self.valid = without_leading(self.valid[ix], n, self.idx, 1)
        self.idx -= n
        self.first = None if first is None else [f - n for f in first]

    def _padded(self, L: int, like: "BatchKVCache"):
        B = len(self.pos)
        src = self if self.keys is not None else like
        H, D, Dv = src.keys.shape[1], src.keys.shape[3], src.values.shape[3]
        p = L - self.idx
        k = mx.zeros((B, H, p, D), src.keys.dtype)
        v = mx.zeros((B, H, p, Dv), src.values.dtype)
        m = mx.zeros((B, p), mx.bool_)
        if self.keys is not None:
            k = mx.concatenate([k, self.keys[..., : self.idx, :]], axis=2)
            v = mx.concatenate([v, self.values[..., : self.idx, :]], axis=2)
            m = mx.concatenate([m, self.valid[:, : self.idx]], axis=1)
        return k, v, m

    def extend(self, other: "BatchKVCache"):
        """Append the rows of ``other``, both right-aligned at the write pointer."""
        L = max(self.idx, other.idx)
        self.first = first_after_padding(L, self, other)
        if self.keys is None and other.keys is None:
            self.pos += other.pos
            return
        ka, va, ma = self._padded(L, other)
        kb, vb, mb = other._padded(L, self)
        self.keys, self.values = tree_map(lambda a, b: mx.concatenate([a, b]),
                                          (ka, va), (kb, vb))  # quantized: triples
        self.valid = mx.concatenate([ma, mb])
        self.idx = L
        self.pos = self.pos + other.pos

    def row_state(self, b: int):
        """(keys, values) of row ``b``'s valid tokens, in order (for tests)."""
        m = np.array(self.valid[b, : self.idx])
        ix = mx.array(np.nonzero(m)[0].astype(np.int32))
        return self.keys[b : b + 1][:, :, ix], self.values[b : b + 1][:, :, ix]

    def copy(self) -> "BatchKVCache":
        c = self._share()
        if self.keys is not None:
            c.keys, c.values, c.valid = (mx.array(a) for a in (c.keys, c.values, c.valid))
        return c
