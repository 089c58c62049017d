"""The cache of one layer of chained MTP layers (``blocks/mtp_chain.py``).

Layer j >= 1 takes layer j-1's output at a position once the token there is known, so it
lags one position behind layer j-1: between calls it holds layer j-1's newest output, its
*pending* input, one (1, H) row per sequence. ``ChainCache`` is an attention cache of any
kind (``inner``: single-row or batch, full or windowed) plus that pending row, and carries
it through the whole protocol: save/load, snapshot/restore, merge/extract/filter, copy. A
row that has no pending yet (a new sequence) takes zeros, as it always did.

It speaks the protocol under the kind ``chain``: ``state`` is the inner cache's arrays then
``pending`` (zeros of width 1 while no row has one), ``meta_state`` the inner cache's with
its kind and the per-row pending flags after the offset. Saved caches are single-row, so
``state_names`` are a single-row inner cache's and ``pending``.
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx

from .kv import CACHE_KINDS, BatchKVCache, KVCache, _Cache


class ChainCache(_Cache):
    """An attention cache (``inner``) and each row's pending input (see the module doc)."""

    kind = "chain"
    state_names = ("k", "v", "pending")

    def __init__(self, inner, pending: Optional[mx.array] = None,
                 has_pending: Optional[List[bool]] = None):
        self.inner = inner
        self.pending = pending  # (B, 1, H); None while no row has one
        self.has_pending = list(has_pending) if has_pending is not None else [False] * inner.size()
        self.drafts: List[mx.array] = []  # this step's draft tokens d_1.. (a step's, not state)

    # --- the chain's own part ---------------------------------------------
    def pending_rows(self, B: int, H: int, dtype) -> mx.array:
        """(B, 1, H): each row's pending input, zeros where a row has none yet."""
        return self.pending if self.pending is not None else mx.zeros((B, 1, H), dtype)

    def take(self, outputs: mx.array, lengths: List[int]):
        """Layer j-1 ran on a right-aligned chunk (``outputs`` (B, S, H), ``lengths[b]`` real
        positions per row). Returns this layer's inputs, each row's pending then its new
        outputs, right-aligned (B, S + 1, H), and how many of them it can run on now (the
        newest stays pending)."""
        B, S, H = outputs.shape
        pend = self.pending_rows(B, H, outputs.dtype)
        x = mx.concatenate([pend, outputs], axis=1)
        if any(n < S for n in lengths):  # move each row's pending next to its new outputs
            i = mx.arange(S + 1)[None]
            ix = mx.where(i >= (S + 1 - mx.array(lengths))[:, None], i, 0)
            x = mx.take_along_axis(x, ix[..., None], axis=1)
        has_new = [n > 0 for n in lengths]
        self.pending = mx.where(mx.array(has_new)[:, None, None], x[:, S:], pend)
        runnable = [n + had - 1 if n else 0 for n, had in zip(lengths, self.has_pending)]
        self.has_pending = [had or new for had, new in zip(self.has_pending, has_new)]
        return x, runnable

    def chunk(self, x: mx.array, tokens: mx.array, lengths: List[int]):
        """The inputs (B, S, H) and tokens (B, S), right-aligned with ``lengths`` real per
        row, as this cache takes them: announced with per-row lengths (a batch), or cut to
        the real positions (one row has no padding)."""
        if isinstance(self.inner, BatchKVCache):
            self.inner.prepare(x.shape[1], lengths)
            return x, tokens
        n = lengths[0]
        return x[:, x.shape[1] - n:], tokens[:, tokens.shape[1] - n:]

    def note_draft(self, depth: int, token: mx.array) -> mx.array:
        """Record the step's depth-``depth`` draft (B, 1); returns drafts 1..depth (B, depth)."""
        self.drafts = self.drafts[: depth - 1] + [token]
        return mx.concatenate(self.drafts, axis=1)

    def chunk_lengths(self, S: int) -> List[int]:
        """Real positions per row of the chunk announced by ``prepare``."""
        return self.inner.chunk_lengths(S)

    # --- attention, as the inner cache ------------------------------------
    @property
    def offset(self):
        return self.inner.offset

    def update_and_fetch(self, keys, values):
        return self.inner.update_and_fetch(keys, values)

    def make_mask(self, *args, **kwargs):
        return self.inner.make_mask(*args, **kwargs)

    def prepare(self, S: int, lengths=None):
        self.inner.prepare(S, lengths)

    def trim(self, n: int) -> int:
        return self.inner.trim(n)

    def accept(self, n_keep):
        self.inner.accept(n_keep)

    def lengths(self) -> List[int]:
        return self.inner.lengths()

    def size(self) -> int:
        return self.inner.size()

    def is_trimmable(self) -> bool:
        return self.inner.is_trimmable()

    def max_positions(self):
        return self.inner.max_positions()

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes + (0 if self.pending is None else self.pending.nbytes)

    # --- the protocol -----------------------------------------------------
    @classmethod
    def empty(cls, B: int = 1, inner: type = KVCache, **settings) -> "ChainCache":
        return cls(inner.empty(B, **settings))

    @property
    def state(self):
        inner = tuple(self.inner.state)
        pending = self.pending
        if pending is None and inner[0] is not None:
            pending = mx.zeros((self.size(), 1, 1))
        return (*inner, pending)

    @property
    def meta_state(self):
        offset, *more = self.inner.meta_state
        flags = "".join("1" if p else "0" for p in self.has_pending)
        return (offset, self.inner.kind, flags, *more)

    @classmethod
    def from_state(cls, state, meta_state) -> "ChainCache":
        offset, kind, flags, *more = meta_state
        inner = CACHE_KINDS[kind].from_state(None if state is None else tuple(state[:-1]),
                                             (offset, *more))
        has_pending = [f == "1" for f in flags]
        pending = state[-1] if state is not None and any(has_pending) else None
        return cls(inner, pending, has_pending)

    def snapshot(self):
        return self.inner.snapshot(), self.pending, list(self.has_pending)

    def restore(self, snap):
        inner, self.pending, has_pending = snap
        self.inner.restore(inner)
        self.has_pending = list(has_pending)

    def check_joins(self, row):
        """The inner caches', then the pending inputs' width and dtype."""
        if not isinstance(row, ChainCache):
            raise ValueError(f"a {row.kind!r} cache cannot join {self.kind!r} rows")
        self.inner.check_joins(row.inner)
        if len(row.has_pending) != 1 or (row.pending is None and any(row.has_pending)):
            raise ValueError("a chain cache's pending input does not match its flags")
        if self.pending is not None and row.pending is not None and (
                row.pending.shape[:2] != (1, 1) or row.pending.shape[2] != self.pending.shape[2]
                or row.pending.dtype != self.pending.dtype):
            raise ValueError(f"pending input {tuple(row.pending.shape)} {row.pending.dtype} "
                             f"does not fit beside {tuple(self.pending.shape)}")

    @classmethod
    def merge(cls, caches: List["ChainCache"]) -> "ChainCache":
        """The caches' rows in order; rows without a pending input take zeros."""
        inner = type(caches[0].inner).merge([c.inner for c in caches])
        ref = next((c.pending for c in caches if c.pending is not None), None)
        if ref is None:
            return cls(inner)
        pending = mx.concatenate([c.pending_rows(c.size(), ref.shape[-1], ref.dtype)
                                  for c in caches])
        return cls(inner, pending, [p for c in caches for p in c.has_pending])

    def filter(self, rows: List[int]):
        self.inner.filter(rows)
        self.has_pending = [self.has_pending[r] for r in rows]
        if self.pending is not None:
            self.pending = self.pending[mx.array(rows)]
        self.drafts = []

    def extract(self, row: int) -> "ChainCache":
        pending = self.pending[row : row + 1] if self.has_pending[row] else None
        return ChainCache(self.inner.extract(row), pending, [self.has_pending[row]])

    def copy(self) -> "ChainCache":
        return ChainCache(self.inner.copy(), self.pending, self.has_pending)


CACHE_KINDS[ChainCache.kind] = ChainCache
