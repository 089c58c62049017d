"""The cache of a DeepSeek sparse attention indexer (``blocks/dsa.py``): its keys.

A DSA layer keeps two caches, the MLA latents (a ``KVCache``) and the indexer's keys
(this one), trimmed together on rollback. Only the keys are read: as in mlx-lm, the values
are a zero placeholder, and the latent cache's keys are made to depend on these arrays so
that evaluating the layer's caches evaluates them (their graph never grows unevaluated).
mlx-lm's own DSA layers (plain decoding) write both fields themselves; our verify pass
calls ``update_keys``. Kinds ``index_kv`` (one row) and ``batch_index_kv``.
"""

from __future__ import annotations

import mlx.core as mx

from .kv import CACHE_KINDS, BatchKVCache, KVCache


class _IndexKeys:
    """``update_keys`` for the single-row and batch index caches."""

    def update_keys(self, keys: mx.array, latent_cache) -> mx.array:
        """Write the new positions' keys (B, 1, S, D); returns every cached key."""
        out, _ = self.update_and_fetch(keys, keys)
        self.values = mx.zeros_like(self.keys)
        latent_cache.keys = mx.depends(latent_cache.keys, (self.keys, self.values))
        return out


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


CACHE_KINDS.update({c.kind: c for c in (IndexKeyCache, BatchIndexKeyCache)})
