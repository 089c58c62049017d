"""Qwen4-Exp's indexed attention: Qwen3.5's gated attention over the keys a QSA indexer
selects for each query.

The indexer keeps one raw key per position (its own cache). For a query at position p the
complete blocks of ``compress_ratio`` keys among positions 0..p are pooled (mean, then a
norm and RoPE at the block's first position; the cache keeps each row's complete blocks,
so a pass pools only those its positions complete) and scored, relu(q_h · k) summed over
its heads; the query attends to the tokens of the ``budget / compress_ratio`` best blocks
plus the tail of the incomplete block, all of it while there are no more blocks than that.
Every row is computed from its own position alone, so a verify pass selects what one-token
decoding selects, exact score ties included (broken by block order; transformers' topk
breaks them its own way, so references are recorded away from ties).
Reference: transformers 5.24 ``Qwen4ExpTextQSAIndexer``.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..cache.index import key_rows
from .hybrid import GatedAttention


def rope_at(x, positions, dims: int, base: float):
    """Non-interleaved RoPE on the first ``dims`` features of ``x`` (..., N, D) at
    ``positions`` (..., N), broadcast against ``x``'s leading axes."""
    inv_freq = 1.0 / (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims))
    angles = positions.astype(mx.float32)[..., None] * inv_freq
    cos, sin = mx.cos(angles).astype(x.dtype), mx.sin(angles).astype(x.dtype)
    half = dims // 2
    x1, x2, rest = x[..., :half], x[..., half:dims], x[..., dims:]
    return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


class QSAIndexer(nn.Module):
    def __init__(self, args, rope_dims: int):
        super().__init__()
        self.n_heads, self.head_dim = args.indexer_n_heads, args.indexer_head_dim
        self.ratio = args.indexer_compress_ratio
        self.top_blocks = args.indexer_budget // self.ratio
        self.rope_dims, self.base = rope_dims, args.rope_theta
        self.index_qk_proj = nn.Linear(args.hidden_size, (self.n_heads + 1) * self.head_dim,
                                       bias=False)
        self.q_layernorm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_layernorm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)

    def __call__(self, x, cache=None):
        """(B, 1, L, T) boolean: which cached positions each of the L new rows attends to."""
        B, L, _ = x.shape
        d = self.head_dim
        q, raw = mx.split(self.index_qk_proj(x), [self.n_heads * d], axis=-1)
        visible = cache.make_mask(L, return_array=True) if cache is not None else None
        offset = cache.offset if cache is not None else 0
        pos = mx.array(offset).reshape(-1, 1) + mx.arange(L)  # (1 or B, L)
        q = self.q_layernorm(q.reshape(B, L, self.n_heads, d)).transpose(0, 2, 1, 3)
        q = rope_at(q, pos[:, None], self.rope_dims, self.base)
        keys = cache.write_keys(raw[:, None]) if cache is not None else raw
        order, index = row_order(visible, keys.shape[1])
        if visible is None or visible.ndim != 4:  # one row: causal over its positions
            visible = index[None] <= pos[:, :, None]
        else:
            visible = visible[:, 0]
        return self.select(q, keys, order, index, pos, visible, cache)[:, None]

    def select(self, q, keys, order, index, pos, visible, cache=None):
        """``keys`` (B, T, d) as stored (``--kv-bits``: ``cache.index.QuantizedKeys``, its
        rows dequantized to pool); ``order``: each row's slots in its own token order
        and ``index``: each slot's place in its row (B or 1, T); ``pos``: the queries'
        places (B or 1, L); ``cache``: keeps the complete blocks pooled between passes."""
        c, n_blocks = self.ratio, keys.shape[1] // self.ratio
        complete = (pos + 1) // c  # each query's complete blocks
        tail = index[:, None] >= (complete * c)[..., None]
        if n_blocks == 0:
            return visible & tail
        d = self.head_dim

        def pool(first, width: int) -> mx.array:
            """(B or 1, width, d): each row's blocks ``first[b] ..``: mean, norm, RoPE at
            the block's start (slots past the last read as the last)."""
            slots = mx.minimum(first * c + mx.arange(width * c), keys.shape[1] - 1)
            rows = key_rows(keys, mx.take_along_axis(order, slots, axis=1))
            blocks = rows.reshape(rows.shape[0], width, c, d)
            blocks = self.k_layernorm(blocks.astype(mx.float32).mean(axis=2).astype(keys.dtype))
            return rope_at(blocks, (first + mx.arange(width)) * c, self.rope_dims, self.base)

        pooled = pool(mx.zeros((1, 1), mx.int32), n_blocks) if cache is None else \
            cache.pooled_blocks(n_blocks, c, pool)
        scores = q.astype(mx.float32) @ pooled.astype(mx.float32)[:, None].swapaxes(-1, -2)
        scores = nn.relu(scores).sum(axis=1) / d ** 0.5  # (B, L, n_blocks)
        scores = mx.where(mx.arange(n_blocks) < complete[..., None], scores + 0.0, -mx.inf)
        k = min(self.top_blocks, n_blocks)
        best = mx.argpartition(tie_broken(scores), n_blocks - k, axis=-1)[..., n_blocks - k:]
        chosen = (best[..., None] == mx.arange(n_blocks)).any(axis=-2)  # (B, L, n_blocks)
        block = mx.minimum(index // c, n_blocks - 1)
        in_block = mx.take_along_axis(chosen, mx.broadcast_to(block[:, None], visible.shape),
                                      axis=-1)
        return visible & (in_block | tail)


def tie_broken(scores):
    """Distinct int64 keys in the scores' order, equal scores ranked by block (the earlier
    first): the top blocks then do not depend on how many blocks a pass holds (a verify
    row sees later, masked blocks that one-token decoding does not), even at exact ties."""
    bits = mx.view(scores, mx.int32)
    ordered = mx.where(bits < 0, bits ^ 0x7FFFFFFF, bits).astype(mx.int64)
    return ordered * (1 << 32) + ((1 << 32) - 1 - mx.arange(scores.shape[-1], dtype=mx.int64))


def row_order(visible, T: int):
    """Each row's slots in its own token order (holes last) and each slot's place in its
    row: (order (B or 1, T), index (B or 1, T)). ``visible``: a batch cache's (B, 1, L, T)
    mask (its last query sees every filled slot); else one row without holes."""
    if visible is None or visible.ndim != 4:
        t = mx.arange(T)[None]
        return t, t
    filled = visible[:, 0, -1]
    index = mx.cumsum(filled.astype(mx.int32), axis=-1) - 1
    order = mx.argsort(mx.where(filled, index, T + mx.arange(T)), axis=-1)
    return order, index


class IndexedAttention(GatedAttention):
    """Gated attention restricted to the indexer's selection. Its caches: (KV, raw keys)."""

    def __init__(self, args):
        super().__init__(args)
        self.indexer = QSAIndexer(args, int(args.head_dim * args.partial_rotary_factor))

    def __call__(self, x, mask=None, cache=None, positions=None):
        kv, keys = cache if cache is not None else (None, None)
        return super().__call__(x, self.indexer(x, keys), kv)
