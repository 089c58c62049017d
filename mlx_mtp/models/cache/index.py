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

With ``--kv-bits`` their keys are quantized too, each position on its own (kinds
``quantized_pooled_index_kv`` and ``batch_quantized_pooled_index_kv``; the values placeholder
one group wide): ``write_keys`` hands the indexer a ``QuantizedKeys``, whose rows it gathers
dequantized before pooling. A block's pool is then a function of its quantized keys alone, so
a verify row pools what a one-token step pools, a rollback stays a pointer move, and a loaded
cache pools again to the same values. The kept pools stay in the keys' float dtype (one per
complete block: a ``ratio``-th of the positions; derived, so outside ``state`` and ``nbytes``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import mlx.core as mx

from .kv import CACHE_KINDS, BatchKVCache, KVCache
from .quantized import BatchQuantizedKVCache, KVQuantization, QuantizedKVCache


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
        c = type(self)(self.pos, self.keys, self.values, self.valid)
        c.idx, c.first = self.idx, self.first
        return c

    def extract(self, row: int) -> IndexKeyCache:
        c = CACHE_KINDS[self.row_kind]()
        c.state = BatchKVCache.extract(self, row).state
        c.offset = self.pos[row]
        return c


@dataclass(frozen=True)
class QuantizedKeys:
    """Every key a quantized pooled cache holds (``write_keys``): ``triple``, each array
    (B, T, ·) as ``mx.quantize`` made it, read with ``quant``."""

    triple: tuple
    quant: KVQuantization

    @property
    def shape(self) -> tuple:
        """(B, T, d), as the full-precision keys'."""
        B, T, groups = self.triple[1].shape
        return B, T, groups * self.quant.group_size

    @property
    def dtype(self):
        return self.triple[1].dtype  # the scales': the keys' float dtype

    def take(self, at: mx.array) -> mx.array:
        """Rows ``at`` (B or 1, N) of every row, dequantized: (B, N, d)."""
        parts = [mx.take_along_axis(a, at[..., None], axis=1) for a in self.triple]
        return mx.dequantize(*parts, group_size=self.quant.group_size, bits=self.quant.bits)


def key_rows(keys, at: mx.array) -> mx.array:
    """Rows ``at`` (B or 1, N) of the keys ``write_keys`` returned, as floats (B, N, d)."""
    if isinstance(keys, QuantizedKeys):
        return keys.take(at)
    return mx.take_along_axis(keys, at[..., None], axis=1)


class _PooledBlocks:
    """The pooled keys of complete blocks, kept between passes (module doc). Rows are in
    their own token order (block ``i`` of a row pools its tokens ``i * ratio ..``); row
    ``b``'s first ``_complete[b]`` blocks are complete, so reusable."""

    _pooled = None  # (B, n, d): the last pass's blocks
    _complete: Optional[List[int]] = None  # per row; None: nothing kept
    _ratio = 1

    def write_keys(self, keys: mx.array):
        """Write the new positions' keys (B, 1, S, d); returns every cached key (B, T, d)."""
        return self.update_and_fetch(keys, keys)[0][:, 0]

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

    @property
    def state(self):
        return super().state

    @state.setter
    def state(self, v):
        super(_PooledBlocks, type(self)).state.fset(self, v)
        self._complete = None  # derived: a loaded cache pools again

    def snapshot(self):
        return super().snapshot(), self._memo()

    def restore(self, snap):
        base, memo = snap
        super().restore(base)
        self._set_memo(memo)

    def copy(self):
        c = super().copy()
        c._set_memo(self._memo())
        return c

    def trim(self, n: int) -> int:
        n = super().trim(n)
        self._uncomplete()
        return n


class _BatchPooledBlocks(_PooledBlocks):
    """Each row's kept blocks through a batch's joins, departures and rollbacks."""

    def _share(self):
        c = super()._share()
        c._set_memo(self._memo())
        return c

    def extract(self, row: int):
        c = super().extract(row)
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


class _QuantizedPooledKeys:
    """``write_keys`` of the quantized pooled caches (values: a one-group placeholder)."""

    def write_keys(self, keys: mx.array):
        """Write the new positions' keys (B, 1, S, d); returns every cached key: a
        ``QuantizedKeys`` (full precision (B, T, d) before ``--quantized-kv-start``)."""
        out, _ = self.update_and_fetch(keys, keys[..., : self.quant.group_size])
        if not isinstance(out, tuple):
            return out[:, 0]
        return QuantizedKeys(tuple(a[:, 0] for a in out), self.quant)


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

    @classmethod
    def merge(cls, caches) -> "BatchPooledKeyCache":
        return BatchPooledKeyCache.merge(caches)

    def _like(self) -> "PooledKeyCache":
        return PooledKeyCache()


class BatchPooledKeyCache(_BatchPooledBlocks, BatchIndexKeyCache):
    """Rows of different lengths' pooling indexer keys and each row's pooled complete
    blocks."""

    kind = "batch_pooled_index_kv"
    row_kind = "pooled_index_kv"

    @classmethod
    def from_single(cls, caches) -> "BatchPooledKeyCache":
        out = super().from_single(caches)
        out._set_memo(_joined_memo(caches))
        return out


class QuantizedPooledKeyCache(_QuantizedPooledKeys, _PooledBlocks, QuantizedKVCache):
    """One sequence's pooling indexer keys, quantized (``--kv-bits``), and its pooled
    complete blocks."""

    kind = "quantized_pooled_index_kv"

    @classmethod
    def merge(cls, caches) -> "BatchQuantizedPooledKeyCache":
        return BatchQuantizedPooledKeyCache.merge(caches)

    def _switch(self):
        super()._switch()
        self._complete = None  # from here on every block pools its quantized keys


class BatchQuantizedPooledKeyCache(_QuantizedPooledKeys, _BatchPooledBlocks,
                                   BatchQuantizedKVCache):
    """Rows of different lengths' quantized pooling indexer keys and each row's pooled
    complete blocks."""

    kind = "batch_quantized_pooled_index_kv"
    row_kind = QuantizedPooledKeyCache.kind

    @classmethod
    def from_single(cls, c: QuantizedPooledKeyCache) -> "BatchQuantizedPooledKeyCache":
        out = super().from_single(c)
        out._set_memo(_joined_memo([c]))
        return out


def pooled_key_cache(quant: Optional[KVQuantization]):
    """A pooling indexer's cache: quantized with ``--kv-bits`` (``quant``)."""
    return PooledKeyCache() if quant is None else QuantizedPooledKeyCache(quant)


CACHE_KINDS.update({c.kind: c for c in (IndexKeyCache, BatchIndexKeyCache, PooledKeyCache,
                                        BatchPooledKeyCache, QuantizedIndexKeyCache,
                                        BatchQuantizedIndexKeyCache, QuantizedPooledKeyCache,
                                        BatchQuantizedPooledKeyCache)})
