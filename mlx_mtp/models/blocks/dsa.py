"""DeepSeek sparse attention (DSA: DeepSeek-V3.2 ``deepseek_v32``, GLM-5 ``glm_moe_dsa``).

An indexer scores the cached keys per query; once more than ``index_topk`` keys are
cached, attention reads only the top-k. Each attention layer keeps two caches (the MLA
latents and the indexer's keys), both trimmed on rollback: the trunk's cache list holds
two per layer, and so does the MTP layer's.

mlx-lm selects and attends differently for one token (heads of the indexer summed in one
reduction, top-k gathered, absorbed MLA) and for several (heads summed one by one, a sparse
mask, expanded MLA); at near-ties the two select different keys. Plain decoding runs the
one-token path; a verify pass (``capture``) computes every row as that path does
(``verify_attention``): the one-token head reduction, the row's own argpartition over
exactly the keys up to its position (the order of the selected keys follows the row's
length, and the attention sum follows that order), and the row's own absorbed attention
call (each row a batch entry of one query over its gathered keys); rows with at most top-k
keys attend densely, as mlx-lm's indexer then selects nothing. Verify rows are bit-equal
to plain decoding's (reference BLAS).
"""

from __future__ import annotations

import mlx.core as mx


def index_scores(indexer, x, qr, cache, latent_cache):
    """The indexer's scores (B, 1, L, T) for L queries over all T cached keys (one-token
    path's head reduction); writes the indexer cache (``cache.index.IndexKeyCache``)."""
    b, s, _ = x.shape
    q = indexer.wq_b(qr).reshape(b, s, indexer.n_heads, indexer.head_dim).swapaxes(1, 2)
    k = indexer.k_norm(indexer.wk(x)).reshape(b, 1, s, indexer.head_dim)
    offset = cache.offset
    q, k = indexer.rope(q, offset=offset), indexer.rope(k, offset=offset)
    k = cache.update_keys(k, latent_cache)
    scores = mx.maximum(q @ k.swapaxes(-1, -2), 0)
    weights = indexer.weights_proj(x) * (indexer.n_heads**-0.5 * indexer.softmax_scale)
    scores = scores * weights.swapaxes(-1, -2)[..., None]
    return scores.sum(axis=1, keepdims=True)


def verify_attention(attn, x, mask, caches):
    """mlx-lm's DSA attention for a verify pass: every row as one-token decoding selects
    (its own top-k of the keys up to its position) and computes (absorbed formula, the
    row's own attention call)."""
    B, L, _ = x.shape
    latent_cache, index_cache = caches
    qr = attn.q_a_layernorm(attn.q_a_proj(x))
    q = attn.q_b_proj(qr).reshape(B, L, attn.num_heads, attn.q_head_dim).transpose(0, 2, 1, 3)
    q_nope, q_pe = mx.split(q, [attn.qk_nope_head_dim], axis=-1)
    latent, k_pe = mx.split(attn.kv_a_proj_with_mqa(x), [attn.kv_lora_rank], axis=-1)
    k_pe = k_pe.reshape(B, L, 1, attn.qk_rope_head_dim).transpose(0, 2, 1, 3)
    latent = mx.expand_dims(attn.kv_a_layernorm(latent), axis=1)
    offset = latent_cache.offset
    q_pe, k_pe = attn.rope(q_pe, offset), attn.rope(k_pe, offset)
    latent, k_pe = latent_cache.update_and_fetch(latent, k_pe)  # (B, 1, T, R), (B, 1, T, dr)
    scores = index_scores(attn.indexer, x, qr, index_cache, latent_cache)  # (B, 1, L, T)
    T = latent.shape[2]
    mask = mask if mask is not None else mx.arange(T - L, T)[:, None] >= mx.arange(T)
    q_abs = attn.embed_q(q_nope)  # (B, H, L, R)
    # Row i has the keys up to its position: plain decoding attends to all of them while
    # they are at most top-k (mlx-lm's indexer returns nothing), else to its top-k.
    dense = max(0, min(L, attn.indexer.index_topk - (T - L)))
    parts = []
    if dense:
        parts.append(_dense_rows(attn, q_abs[:, :, :dense], q_pe[:, :, :dense], latent, k_pe,
                                 mask[..., :dense, :]))
    if dense < L:
        parts.append(_sparse_rows(attn, q_abs[:, :, dense:], q_pe[:, :, dense:], latent, k_pe,
                                  mask[..., dense:, :], scores[:, :, dense:]))
    out = attn.unembed_out(parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2))
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def _masked(scores, mask):
    return mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))


def _dense_rows(attn, q_abs, q_pe, latent, k_pe, mask):
    """Rows attending to every key up to their position (mlx-lm's absorbed one-token call)."""
    pe = _masked((q_pe * attn.scale) @ k_pe.swapaxes(-1, -2), mask)
    return mx.fast.scaled_dot_product_attention(q_abs, latent, latent, scale=attn.scale,
                                                mask=pe)


def _sparse_rows(attn, q_abs, q_pe, latent, k_pe, mask, scores):
    """Rows attending to their own top-k keys: each row is its own batch entry of one query
    over its gathered keys, the call mlx-lm's one-token path makes."""
    B, H, L, R = q_abs.shape
    k = attn.indexer.index_topk
    # Each row's selection over exactly the keys up to it (the last L rows of the pass): the
    # order argpartition returns depends on the row's length, and the attention sum follows it.
    scores = mx.where(mask, scores, -float("inf"))
    T = scores.shape[-1]
    top = mx.concatenate([mx.argpartition(scores[:, :, i:i + 1, :T - L + 1 + i], kth=-k,
                                          axis=-1)[..., -k:] for i in range(L)], axis=2)

    def rows(a):  # (B, 1, T, d) -> each row's top-k keys, in top's order: (B*L, 1, k, d)
        picked = mx.take_along_axis(a[:, :, None], top[..., None], axis=3)  # (B, 1, L, k, d)
        return picked.reshape(B * L, 1, k, a.shape[-1])

    gathered, pe_keys = rows(latent), rows(k_pe)
    per_row = lambda a: a.transpose(0, 2, 1, 3).reshape(B * L, H, 1, a.shape[-1])
    pe = (per_row(q_pe) * attn.scale) @ pe_keys.swapaxes(-1, -2)  # (B*L, H, 1, k)
    keep = mx.take_along_axis(mx.broadcast_to(mask, (B, 1, L, mask.shape[-1])), top, axis=-1)
    pe = _masked(pe, keep.reshape(B * L, 1, 1, k))
    out = mx.fast.scaled_dot_product_attention(per_row(q_abs), gathered, gathered,
                                               scale=attn.scale, mask=pe)
    return out.reshape(B, L, H, R).transpose(0, 2, 1, 3)
