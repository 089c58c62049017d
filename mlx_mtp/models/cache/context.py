"""A block drafter's context cache (``drafters/block/``): the K/V of every emitted row's
taps, projected once per drafter layer, for one or many rows.

It is a ``BatchKVCache`` (rows of different lengths, per-row RoPE positions, holes for
padding and rejected rows, merge/filter/extract) that a block's own K/V never enter: a
drafter pass reads the context beside its transient block (``attend``), so nothing of a
pass needs rolling back. After a verify the step appends the taps of every verified row
and ``accept(n_keep)`` drops the rows past each row's accepted ones, as for the trunk.

``ContextChainCache`` is a context that lags the trunk by one row (EAGLE-3's first layer
pairs row t's taps with token t + 1): a ``ChainCache`` over a ``ContextCache``, whose
pending input is the last emitted row's projected taps, saved under its own kind.
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx

from .chain import ChainCache
from .kv import CACHE_KINDS, BatchKVCache


class ContextCache(BatchKVCache):
    kind = "block_context"
    row_kind = ""  # rows join as context caches of one row (``valid`` included)
    free_axes = (0, 1, 2)  # rows and positions: axis 2 of k/v, axis 1 of ``valid``
    last_write = 0  # positions the pass ``prepare`` announced wrote (0: none yet)

    @classmethod
    def empty(cls, B: int = 1) -> "ContextCache":
        return cls([0] * B)

    @classmethod
    def merge(cls, caches) -> "ContextCache":
        out = None
        for c in caches:
            if out is None:
                out = c._share()
            else:
                out.extend(c)
        return out

    def _share(self) -> "ContextCache":
        c = ContextCache(self.pos, self.keys, self.values, self.valid)
        c.idx, c.first = self.idx, self.first
        return c

    def extract(self, row: int) -> "ContextCache":
        c = self.copy()
        c.filter([row])
        return c

    def select(self, rows: List[int]) -> "ContextCache":
        """A cache of ``rows`` only, over the same arrays (a drafter pass over some rows)."""
        c = self._share()
        c.filter(rows)
        return c

    def prepare(self, S: int, lengths=None):
        super().prepare(S, lengths)
        self.last_write = 0  # a pass may defer its taps (``taps.DeferredTaps``): none here

    def accept(self, n_keep):
        """As ``BatchKVCache.accept``, for a pass that wrote here (else nothing to keep)."""
        if self.last_write:
            super().accept(n_keep)

    def prefixes(self, rows: List[int], lengths: List[int]) -> "ContextCache":
        """Training (``train/dflash.py``): a cache whose row i is the first ``lengths[i]``
        positions of this cache's row ``rows[i]``, its block's anchor at ``lengths[i]``, so
        one context pass over a sequence serves a block at each of many anchors. This cache
        must hold whole sequences (no holes: slot j is position j)."""
        ix = mx.array(rows)
        seen = mx.arange(self.idx)[None] < mx.array(lengths)[:, None]
        return ContextCache(lengths, self.keys[ix][..., : self.idx, :],
                            self.values[ix][..., : self.idx, :], self.valid[ix, : self.idx] & seen)

    def positions(self) -> mx.array:
        """(B,) each row's next position: where a block's anchor stands."""
        return mx.array(self.pos)

    def attend(self, keys: mx.array, values: mx.array, causal: bool = False,
               window: Optional[int] = None):
        """The context's K/V followed by a block's ``keys``/``values`` (B, H, L, D), which
        are not stored, and the (B, 1, L, idx + L) boolean mask of what each block slot
        sees: every context row (within ``window`` positions, when set) and the block,
        bidirectionally unless ``causal``."""
        B, L = keys.shape[0], keys.shape[2]
        block = mx.ones((L, L), mx.bool_) if not causal else mx.tril(mx.ones((L, L), mx.bool_))
        block = mx.broadcast_to(block[None], (B, L, L))
        if self.keys is None or self.idx == 0:
            return keys, values, block[:, None]
        valid = self.valid[:, : self.idx]
        seen = mx.broadcast_to(valid[:, None, :], (B, L, self.idx))
        if window is not None:
            # a slot's position: the row's next one minus the valid slots at or after it
            after = valid.sum(axis=1, keepdims=True) - mx.cumsum(valid.astype(mx.int32), axis=1)
            slot_pos = self.positions()[:, None] - 1 - after  # (B, idx)
            query_pos = self.positions()[:, None] + mx.arange(L)[None]  # (B, L)
            seen = seen & (query_pos[:, :, None] - slot_pos[:, None, :] < window)
        k = mx.concatenate([self.keys[..., : self.idx, :], keys], axis=2)
        v = mx.concatenate([self.values[..., : self.idx, :], values], axis=2)
        return k, v, mx.concatenate([seen, block], axis=2)[:, None]


class ContextChainCache(ChainCache):
    kind = "block_context_chain"
    state_names = ("k", "v", "valid", "pending")  # a ContextCache's, then the pending input

    @classmethod
    def empty(cls, B: int = 1) -> "ContextChainCache":
        return cls(ContextCache.empty(B))

    def prepare(self, S: int, lengths=None):
        super().prepare(S, lengths)
        self.taken = None  # a pass that defers its taps takes none: ``accept`` keeps the pending

    def select(self, rows: List[int]) -> "ContextChainCache":
        """A cache of ``rows`` only, over the same arrays (a drafter pass over some rows)."""
        pending = None if self.pending is None else self.pending[mx.array(rows)]
        return type(self)(self.inner.select(rows), pending, [self.has_pending[r] for r in rows])


CACHE_KINDS[ContextCache.kind] = ContextCache
CACHE_KINDS[ContextChainCache.kind] = ContextChainCache
