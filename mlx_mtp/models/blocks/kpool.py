"""GLM-5.3-Flash's DSA indexer over pooled keys ("k-pool").

The indexer keeps, per position, a normed key and a gate vector (its own cache). Complete
groups of ``index_kpool`` keys are pooled by a softmax over the group of (gate + a learned
per-slot bias); a query at position p scores the complete pools among positions 0..p,
sum over heads of weight_h · relu(q_h · pool) / sqrt(d), and attends to the tokens of the
``index_topk / index_kpool`` best plus the incomplete tail (p's own group). Every row is
computed from its own position alone, so a verify pass selects what one-token decoding
selects, and batch rows with holes pool their own tokens; exact score ties are broken by pool order (``qsa.tie_broken``), where transformers'
topk breaks them its own way (references are recorded away from ties). The cache keeps each
row's complete pools (``cache.index.PooledKeyCache``, as Qwen4-Exp's QSA blocks), so a pass
pools only the pools its positions complete.
Reference: transformers 5.24 ``Glm5NextTextIndexer`` (no RoPE: the MLA is NoPE).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..cache.index import key_rows
from .qsa import row_order, tie_broken


class KPoolIndexer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_heads, self.head_dim, c = args.index_n_heads, args.index_head_dim, args.index_kpool
        self.pool, self.top_pools = c, args.index_topk // c
        if not args.index_kpool_always_select_tail:
            raise ValueError("glm5_next: an indexer without its tail pool is not supported")
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(args.hidden_size, self.n_heads, bias=False)
        self.index_kpool_compress_ape = mx.zeros((c, self.head_dim))
        self.index_kpool_compress_gate = mx.zeros((self.head_dim, args.hidden_size))

    def __call__(self, x, q_resid, cache=None):
        """(B or 1, 1, L, T) boolean: which cached positions each of the L new rows attends
        to. A batch cache's rows are pooled in their own token order (``qsa.row_order``)."""
        B, L, _ = x.shape
        q = self.wq_b(q_resid).reshape(B, L, self.n_heads, self.head_dim)
        packed = mx.concatenate([self.k_norm(self.wk(x)),
                                 x @ self.index_kpool_compress_gate.T], axis=-1)[:, None]
        visible = cache.make_mask(L, return_array=True) if cache is not None else None
        offset = cache.offset if cache is not None else 0
        pos = mx.array(offset).reshape(-1, 1) + mx.arange(L)  # (1 or B, L)
        packed = cache.write_keys(packed) if cache is not None else packed[:, 0]
        order, index = row_order(visible, packed.shape[1])
        if visible is None or visible.ndim != 4:  # one row: causal over its positions
            visible = index[:, None] <= pos[:, :, None]
        else:
            visible = visible[:, 0]
        return self.select(x, q, packed, order, index, pos, visible, cache)[:, None]

    def select(self, x, q, packed, order, index, pos, visible, cache=None):
        """``packed``: each position's key and gate as stored (B, T, 2d; ``--kv-bits``:
        ``cache.index.QuantizedKeys``, its rows dequantized to pool); ``order``: each
        row's slots in its own token order and ``index``: each slot's place in its row
        (B or 1, T); ``pos``: the queries' places (B or 1, L); ``cache``: keeps the complete
        pools between passes (``cache.index.PooledKeyCache``)."""
        c = self.pool
        complete = (pos + 1) // c
        tail = index[:, None] >= (complete * c)[..., None]
        n = packed.shape[1] // c
        if n == 0:
            return visible & tail

        def pool(first, width: int) -> mx.array:
            """(B or 1, width, d): each row's pools ``first[b] ..``, its keys weighted by a
            softmax of gate + slot bias over the pool (slots past the last read as the last)."""
            slots = mx.minimum(first * c + mx.arange(width * c), packed.shape[1] - 1)
            rows = key_rows(packed, mx.take_along_axis(order, slots, axis=1))
            keys, gates = mx.split(rows.reshape(rows.shape[0], width, c, -1), 2, axis=-1)
            weights = mx.softmax(gates.astype(mx.float32)
                                 + self.index_kpool_compress_ape.astype(mx.float32), axis=2)
            return (weights.astype(keys.dtype) * keys).sum(axis=2)

        pooled = pool(mx.zeros((1, 1), mx.int32), n) if cache is None else \
            cache.pooled_blocks(n, c, pool)
        scores = self.pool_scores(x, q, pooled)
        scores = mx.where(mx.arange(n) < complete[..., None], scores, -mx.inf)
        k = min(self.top_pools, n)
        best = mx.argpartition(tie_broken(scores), n - k, axis=-1)[..., n - k:]
        chosen = (best[..., None] == mx.arange(n)).any(axis=-2)  # (B, L, n)
        pool_of = mx.minimum(index // c, n - 1)
        in_pool = mx.take_along_axis(
            chosen, mx.broadcast_to(pool_of[:, None], (*chosen.shape[:2], index.shape[-1])),
            axis=-1)
        return visible & (in_pool | tail)

    def pool_scores(self, x, q, pooled):
        """(B, L, n): each query's score of each complete pool (``pooled``: (B, n, d))."""
        d = self.head_dim
        scores = q.astype(mx.float32) @ pooled.astype(mx.float32)[:, None].swapaxes(-1, -2)
        scores = nn.relu(scores * d**-0.5)  # (B, L, heads, n)
        head_weights = self.weights_proj(x).astype(mx.float32) * self.n_heads**-0.5
        return (head_weights[..., None, :] @ scores).squeeze(-2)
