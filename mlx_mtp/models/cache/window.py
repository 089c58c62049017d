"""KV caches for sliding-window attention layers, with exact rollback.

mlx-lm's ``RotatingKVCache`` keeps exactly ``window`` entries in a ring: once it has
wrapped, the entries a rejected draft overwrote are gone and it cannot be trimmed.
These caches instead keep the window plus a margin for rollback and mask by the
window: a query at position q sees keys at positions k with ``q - window < k <= q``,
which is what mlx-lm's rotating cache and ``create_causal_mask(window_size=)`` give.

* ``WindowKVCache`` (one sequence): a ``KVCache`` that drops entries older than
  ``window + margin`` when its buffer would grow, so memory stays bounded; ``offset``
  stays the absolute position (RoPE), ``start`` is the position of the first kept entry.
  Entries are dropped ``step`` at a time, after a write (masks are made before it).
  Rolling back up to ``margin`` positions (a verify pass's drafts) is a pointer move.
* ``BatchWindowKVCache`` (many sequences): a ``BatchKVCache`` whose masks also apply
  each row's window, counted in that row's own positions (holes skipped), and drops a
  row's entries older than ``window + margin`` when its buffer grows.

Both speak the cache protocol of ``cache.py`` under their own kinds (``window_kv``,
``batch_window_kv``): their ``meta_state`` carries the window (and a single cache's
``start`` and margin), so a saved cache comes back windowed; ``merge`` batches window
caches only with window caches of the same window.
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx

from .kv import CACHE_KINDS, BatchKVCache, KVCache
from .slots import stack_left_padded

# Positions a rollback may take back beyond the window: every draft of a step, rejected
# from the first. The longest a step verifies is a row drafter's run extended by the head
# (decode/draft_source.py): MAX_DRAFTER_TOKENS (32, drafters/base.py) + MAX_DRAFT_TOKENS
# (8, decode/__init__.py); models/ cannot import decode/ (decode imports models), so
# tests/test_window_margin.py holds the two equal.
ROLLBACK_MARGIN = 32 + 8


def _check_window(cache_window: int, window_size: Optional[int]):
    if window_size is not None and window_size != cache_window:
        raise ValueError(f"cache built for a window of {cache_window}, asked for {window_size}")


class WindowKVCache(KVCache):
    """One sequence's keys/values for a sliding-window layer (see the module doc)."""

    kind = "window_kv"

    def __init__(self, window: int, margin: Optional[int] = None):
        super().__init__()
        self.window = window
        self.margin = ROLLBACK_MARGIN if margin is None else margin
        self.start = 0  # absolute position of stored entry 0

    @classmethod
    def empty(cls, B: int = 1, window: Optional[int] = None) -> "WindowKVCache":
        if window is None:
            raise ValueError("an empty window cache needs its window")
        if B != 1:
            raise ValueError(f"a {cls.__name__} holds one row, not {B}")
        return cls(window)

    @classmethod
    def from_state(cls, state, meta_state) -> "WindowKVCache":
        if len(meta_state) != 4:
            raise ValueError(f"a window cache's meta_state is (offset, start, window, margin), "
                             f"not {tuple(meta_state)}")
        c = cls(int(meta_state[2]), int(meta_state[3]))
        if state is not None:
            c.keys, c.values = state
        c.meta_state = meta_state
        return c

    @property
    def meta_state(self):
        return tuple(str(x) for x in (self.offset, self.start, self.window, self.margin))

    @meta_state.setter
    def meta_state(self, v):
        offset, start, self.window, self.margin = (int(x) for x in v)
        held = 0 if self.keys is None else self.keys.shape[2]
        if not 0 <= start <= offset or held != offset - start or (
                self.values is not None and self.values.shape[2] != held):
            raise ValueError(f"KV length {held} != offset {offset} - start {start}")
        self.offset, self.start = offset, start

    @classmethod
    def merge(cls, caches) -> "BatchWindowKVCache":
        return BatchWindowKVCache.merge(caches)

    def snapshot(self):
        # Dropping old entries replaces the arrays and moves ``start``: keep references.
        return self.keys, self.values, self.offset, self.start

    def restore(self, snap):
        self.keys, self.values, self.offset, self.start = snap

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        # KVCache writes at ``offset``: run it on stored indices.
        self.offset -= self.start
        try:
            out = super().update_and_fetch(keys, values)
        finally:
            self.offset += self.start
        # Dropped after the write, so the mask made before it still lines up.
        if self.stored >= self.window + self.margin + self.step:
            self._drop_old()
        return out

    def _drop_old(self):
        """Keep only the newest ``window + margin`` entries."""
        drop = self.stored - (self.window + self.margin)
        end = self.stored
        self.keys = mx.contiguous(self.keys[..., drop:end, :])
        self.values = mx.contiguous(self.values[..., drop:end, :])
        self.start += drop

    def trim(self, n: int) -> int:
        n = min(self.stored, n)
        if n > self.margin:
            raise ValueError(f"cannot roll back {n} positions of a sliding window kept "
                             f"with a margin of {self.margin}")
        self.offset -= n
        return n

    def make_mask(self, n: int, return_array: bool = False, window_size: Optional[int] = None):
        """Causal and windowed over the stored entries plus the ``n`` new ones."""
        _check_window(self.window, window_size)
        stored = self.stored
        if n == 1 and stored < self.window:
            return None
        q = mx.arange(stored, stored + n)[:, None]
        k = mx.arange(stored + n)[None]
        return (k <= q) & (k > q - self.window)

    def _like(self) -> "WindowKVCache":
        return WindowKVCache(self.window, self.margin)

    def max_positions(self) -> int:
        # old entries go a step at a time, once a write brings them to a step past the margin
        return self.window + self.margin + self.step - 1

    def settings(self) -> tuple:
        return (self.window,)


class BatchWindowKVCache(BatchKVCache):
    """Rows of different lengths decoding together through a sliding-window layer.

    The window is applied by the mask, from each row's own count of valid slots. When the
    buffer grows (every ``step`` positions), each row keeps only its newest
    ``window + margin`` entries: memory stays bounded as for one sequence.
    """

    kind = "batch_window_kv"
    row_kind = "window_kv"

    def __init__(self, window: int, pos: List[int], keys=None, values=None, valid=None,
                 first=None):
        super().__init__(pos, keys, values, valid, first)
        self.window = window

    def settings(self) -> tuple:
        return (self.window,)

    @classmethod
    def empty(cls, B: int = 1, window: Optional[int] = None) -> "BatchWindowKVCache":
        if window is None:
            raise ValueError("an empty window cache needs its window")
        return cls(window, [0] * B)

    @classmethod
    def from_state(cls, state, meta_state) -> "BatchWindowKVCache":
        if len(meta_state) < 2:
            raise ValueError(f"a batch window cache's meta_state is (window, *pos), "
                             f"not {tuple(meta_state)}")
        c = cls(int(meta_state[0]), [int(p) for p in meta_state[1:]])
        if state is not None:
            c.state = state
        return c

    @property
    def meta_state(self):
        return (str(self.window), *(str(p) for p in self.pos))

    @meta_state.setter
    def meta_state(self, v):
        self.window, self.pos = int(v[0]), [int(p) for p in v[1:]]

    @classmethod
    def merge(cls, caches) -> "BatchWindowKVCache":
        windows = {getattr(c, "window", None) for c in caches}
        if len(windows) != 1 or None in windows:
            raise ValueError("window caches batch only with window caches of the same window")
        return super().merge(caches)

    def max_positions(self) -> int:
        # window + margin after a growth squeezes older entries out, then the step of room it
        # adds (a verify writes less); a joining row's cache holds less than that
        return self.window + ROLLBACK_MARGIN + self.step

    def _share(self) -> "BatchWindowKVCache":
        c = BatchWindowKVCache(self.window, self.pos, self.keys, self.values, self.valid)
        c.idx, c.first = self.idx, self.first
        return c

    def extract(self, row: int) -> WindowKVCache:
        c = WindowKVCache(self.window)
        if self.keys is not None:
            c.keys, c.values = self.row_state(row)
        c.offset = self.pos[row]
        c.start = c.offset - (0 if c.keys is None else c.keys.shape[2])
        return c

    @classmethod
    def from_single(cls, caches: List[WindowKVCache]) -> "BatchWindowKVCache":
        """Batch single-sequence window caches, left-padded to a common stored length."""
        return cls(caches[0].window, [c.offset for c in caches], *stack_left_padded(caches))

    def make_mask(self, S: int, return_array: bool = True, window_size: Optional[int] = None):
        """(B, 1, S, idx + S): causal, valid slots, and within each row's window."""
        _check_window(self.window, window_size)
        old = (self.valid[:, : self.idx] if self.valid is not None
               else mx.zeros((len(self.pos), 0), mx.bool_))
        valid = mx.concatenate([old, self._new_valid()], axis=1)  # (B, L)
        L = valid.shape[1]
        # A slot's position within its row: how many valid slots precede it.
        slot_pos = mx.cumsum(valid.astype(mx.int32), axis=1) - 1
        q_pos = slot_pos[:, self.idx:]  # (B, S)
        near = slot_pos[:, None, :] > q_pos[:, :, None] - self.window  # (B, S, L)
        causal = mx.arange(L)[None] <= (self.idx + mx.arange(S))[:, None]  # (S, L)
        return (valid[:, None, :] & causal[None] & near)[:, None]

    def _grow(self, S: int):
        """Turn each row's entries older than ``window + margin`` into holes; the base
        class squeezes holes out as it grows the buffer."""
        if self.idx:
            valid = self.valid[:, : self.idx]
            newer = mx.cumsum(valid[:, ::-1].astype(mx.int32), axis=1)[:, ::-1]
            # A new mask, not written in place: a snapshot may hold the old one.
            self.valid = mx.concatenate([valid & (newer <= self.window + ROLLBACK_MARGIN),
                                         self.valid[:, self.idx:]], axis=1)
        super()._grow(S)

    def extend(self, other: "BatchWindowKVCache"):
        if other.window != self.window:
            raise ValueError("cannot batch sliding-window caches of different windows")
        super().extend(other)


CACHE_KINDS.update({c.kind: c for c in (WindowKVCache, BatchWindowKVCache)})

