"""The cache of a DeepSeek sparse attention indexer (``blocks/dsa.py``): its keys.

A DSA layer keeps two caches, the MLA latents (a ``KVCache``) and the indexer's keys
(this one), trimmed together on rollback. Only the keys are read: as in mlx-lm, the values
are a zero placeholder, and the latent cache's keys are made to depend on these arrays so
that evaluating the layer's caches evaluates them (their graph never grows unevaluated).
mlx-lm's own DSA layers (plain decoding) write both fields themselves; our verify pass
calls ``update_keys``. Kinds ``index_kv`` (one row) and ``batch_index_kv``.

With ``--kv-bits`` the keys are quantized as the latents are (``quantized.py``: each position
on its own, so rollback stays exact), and every pass runs our DSA attention (``blocks/dsa.py``),
mlx-lm's layers reading no quantized cache. The values placeholder is then one quantization
group wide, never read. Kinds ``quantized_index_kv`` and ``batch_quantized_index_kv``.

Qwen4-Exp's QSA indexer (``blocks/qsa.py``) and GLM-5.3's k-pool indexer (``blocks/kpool.py``)
keep their keys the same way and, beside them, the pooled keys of the blocks each row has
completed (``pooled_blocks``; the indexer passes its own pooling), so a pass pools only the
blocks its positions complete. A rollback un-completes the blocks whose
keys it drops (a rejected verify row may have completed one). The pooled keys are derived
from the keys: ``state`` leaves them out (a loaded cache pools again); snapshots, copies,
merge, extract and filter carry each row's. Kinds ``pooled_index_kv`` and
``batch_pooled_index_kv``.
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx

from .kv import CACHE_KINDS, BatchKVCache, KVCache
from .quantized import BatchQuantizedKVCache, QuantizedKVCache


class _IndexKeys:
    """``update_keys`` for the single-row and batch index caches."""

    def update_keys(self, keys: mx.array, latent_cache) -> mx.array:
        """Write the new positions' keys (B, 1, S, D); returns every cached key."""
        out, _ = self.update_and_fetch(keys, keys)
        self.values = mx.zeros_like(self.keys)
        latent_cache.keys = mx.depends(latent_cache.keys, (self.keys, self.values))
        return out


class _QuantizedIndexKeys:
    """``update_keys`` for the quantized index caches: keys as quantized triples, values a
    one-group placeholder (the values are never read)."""

    def update_keys(self, keys: mx.array, latent_cache) -> tuple:
        """Write the new positions' keys (B, 1, S, D); returns every cached key (a quantized
        triple, or full precision before ``--quantized-kv-start``)."""
        out, _ = self.update_and_fetch(keys, keys[..., : self.quant.group_size])
        held = self.arrays()
        k = latent_cache.keys  # evaluated on every step: so are the arrays written here
        if isinstance(k, tuple):
            latent_cache.keys = (mx.depends(k[0], held), *k[1:])
        else:
            latent_cache.keys = mx.depends(k, held)
        return out


class QuantizedIndexKeyCache(_QuantizedIndexKeys, QuantizedKVCache):
    """One sequence's indexer keys, quantized (``--kv-bits``)."""

    kind = "quantized_index_kv"

    @classmethod
    def merge(cls, caches) -> "BatchQuantizedIndexKeyCache":
        return BatchQuantizedIndexKeyCache.merge(caches)


class BatchQuantizedIndexKeyCache(_QuantizedIndexKeys, BatchQuantizedKVCache):
    """Rows of different lengths' quantized indexer keys."""

    kind = "batch_quantized_index_kv"
    row_kind = QuantizedIndexKeyCache.kind


class IndexKeyCache(_IndexKeys, KVCache):
    """One sequence's indexer keys."""

    kind = "index_kv"

    @classmethod
    def merge(cls, caches) -> "BatchIndexKeyCache":
        return BatchIndexKeyCache.merge(caches)

    def _like(self) -> "IndexKeyCache":
        return IndexKeyCache()


class BatchIndexKeyCache(_IndexKeys, BatchKVCache):
    """Rows of different lengths' indexer keys."""

    kind = "batch_index_kv"
    row_kind = "index_kv"

    def _share(self) -> "BatchIndexKeyCache":
        c = BatchIndexKeyCache(self.pos, self.keys, self.values, self.valid)
        c.idx, c.first = self.idx, self.first
        return c

    def extract(self, row: int) -> IndexKeyCache:
        c = IndexKeyCache()
        c.state = super().extract(row).state
        c.offset = self.pos[row]
        return c


class _PooledBlocks:
    """The pooled keys of complete blocks, kept between passes (module doc). Rows are in
    their own token order (block ``i`` of a row pools its tokens ``i * ratio ..``); row
    ``b``'s first ``_complete[b]`` blocks are complete, so reusable."""

    _pooled = None  # (B, n, d): the last pass's blocks
    _complete: Optional[List[int]] = None  # per row; None: nothing kept
    _ratio = 1

    def pooled_blocks(self, n_blocks: int, ratio: int, pool) -> mx.array:
        """Blocks ``0 .. n_blocks - 1`` of every row, after this pass's keys were written:
        each row's kept blocks, then ``pool(first, width)``: (B, width, d), row ``b``'s
        blocks ``first[b] ..`` (past a row's own complete blocks: any finite values, which
        its queries never read)."""
        kept = self._complete or [0] * self.size()
        own = [min(n_blocks, n // ratio) for n in self.lengths()]
        reuse = any(kept)
        width = max([o - k for o, k in zip(own, kept)] + [0 if reuse else 1])
        first, i = mx.array(kept)[:, None], mx.arange(n_blocks)
        pooled = None
        if width:
            new = pool(first, width)
            at = mx.clip(i[None] - first, 0, width - 1)
            pooled = mx.take_along_axis(new, at[..., None], axis=1)
        if reuse:
            old = self._pooled[:, mx.minimum(i, self._pooled.shape[1] - 1)]
            pooled = old if pooled is None else mx.where((i[None] < first)[..., None], old,
                                                         pooled)
        self._pooled, self._complete, self._ratio = pooled, own, ratio
        return pooled

    def _uncomplete(self):
        """After a rollback: a row's blocks whose keys it dropped are no longer complete."""
        if self._complete is not None:
            self._complete = [min(k, n // self._ratio)
                              for k, n in zip(self._complete, self.lengths())]

    def _memo(self) -> tuple:
        return self._pooled, self._complete, self._ratio

    def _set_memo(self, memo: tuple):
        self._pooled, self._complete, self._ratio = memo

    def snapshot(self):
        return super().snapshot(), self._memo()

    def restore(self, snap):
        base, memo = snap
        super().restore(base)
        self._set_memo(memo)


def _joined_memo(parts: list) -> tuple:
    """The kept blocks of ``parts``' rows, in order, as one batch's (rows without: none)."""
    held = [p for p in parts if p._complete is not None]
    if not held:
        return None, None, 1
    width = max(p._pooled.shape[1] for p in held)
    d, dtype = held[0]._pooled.shape[2], held[0]._pooled.dtype
    arrays, complete = [], []
    for p in parts:
        B = p.size()
        a = p._pooled if p._complete is not None else mx.zeros((B, width, d), dtype)
        arrays.append(mx.pad(a, [(0, 0), (0, width - a.shape[1]), (0, 0)]))
        complete += p._complete if p._complete is not None else [0] * B
    return mx.concatenate(arrays), complete, held[0]._ratio


class PooledKeyCache(_PooledBlocks, IndexKeyCache):
    """One sequence's pooling indexer keys (QSA, k-pool) and pooled complete blocks."""

    kind = "pooled_index_kv"

    @IndexKeyCache.state.setter
    def state(self, v):
        IndexKeyCache.state.fset(self, v)
        self._complete = None

    @classmethod
    def merge(cls, caches) -> "BatchPooledKeyCache":
        return BatchPooledKeyCache.merge(caches)

    def _like(self) -> "PooledKeyCache":
        return PooledKeyCache()

    def copy(self) -> "PooledKeyCache":
        c = super().copy()
        c._set_memo(self._memo())
        return c

    def trim(self, n: int) -> int:
        n = super().trim(n)
        self._uncomplete()
        return n


class BatchPooledKeyCache(_PooledBlocks, BatchIndexKeyCache):
    """Rows of different lengths' pooling indexer keys and each row's pooled complete
    blocks."""

    kind = "batch_pooled_index_kv"
    row_kind = "pooled_index_kv"

    @BatchIndexKeyCache.state.setter
    def state(self, v):
        BatchIndexKeyCache.state.fset(self, v)
        self._complete = None

    def _share(self) -> "BatchPooledKeyCache":
        c = BatchPooledKeyCache(self.pos, self.keys, self.values, self.valid)
        c.idx, c.first = self.idx, self.first
        c._set_memo(self._memo())
        return c

    @classmethod
    def from_single(cls, caches) -> "BatchPooledKeyCache":
        out = super().from_single(caches)
        out._set_memo(_joined_memo(caches))
        return out

    def extract(self, row: int) -> PooledKeyCache:
        c = PooledKeyCache()
        c.state = BatchKVCache.extract(self, row).state
        c.offset = self.pos[row]
        if self._complete is not None:
            c._set_memo((self._pooled[row:row + 1], self._complete[row:row + 1], self._ratio))
        return c

    def drop_last(self, counts):
        super().drop_last(counts)
        self._uncomplete()

    def extend(self, other):
        memo = _joined_memo([self, other])
        super().extend(other)
        self._set_memo(memo)

    def filter(self, rows):
        super().filter(rows)
        if self._complete is not None:
            self._pooled = self._pooled[mx.array(rows)]
            self._complete = [self._complete[r] for r in rows]


CACHE_KINDS.update({c.kind: c for c in (IndexKeyCache, BatchIndexKeyCache, PooledKeyCache,
                                        BatchPooledKeyCache, QuantizedIndexKeyCache,
                                        BatchQuantizedIndexKeyCache)})
