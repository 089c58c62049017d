"""DeepSeek sparse attention (DSA: DeepSeek-V3.2 ``deepseek_v32``, GLM-5 ``glm_moe_dsa``).

An indexer scores the cached keys per query; once more than ``index_topk`` keys are
cached, attention reads only the top-k. Each attention layer keeps two caches (the MLA
latents and the indexer's keys), both trimmed on rollback: the trunk's cache list holds
two per layer, and so does the MTP layer's.

mlx-lm selects and attends differently for one token (heads of the indexer summed in one
reduction, top-k gathered, absorbed MLA) and for several (heads summed one by one, a sparse
mask, expanded MLA); at near-ties the two select different keys. Plain decoding runs the
one-token path; a verify pass (``capture``) computes every row with the one-token path's
head reduction, its own top-k of the keys up to its position and the absorbed formula
(``verify_attention``): each row selects the keys plain decoding selects (its values
differ from plain decoding's only by the rounding of the softmax sum).
"""

from __future__ import annotations

import mlx.core as mx


def index_scores(indexer, x, qr, cache):
    """The indexer's scores (B, 1, L, T) for L queries over all T cached keys (one-token
    path's head reduction); writes the indexer cache as mlx-lm does."""
    b, s, _ = x.shape
    q = indexer.wq_b(qr).reshape(b, s, indexer.n_heads, indexer.head_dim).swapaxes(1, 2)
    k = indexer.k_norm(indexer.wk(x)).reshape(b, 1, s, indexer.head_dim)
    offset = cache.offset
    q, k = indexer.rope(q, offset=offset), indexer.rope(k, offset=offset)
    k, _ = cache.update_and_fetch(k, k)
    cache.values = mx.zeros_like(cache.keys)  # as mlx-lm: only the keys are read
    scores = mx.maximum(q @ k.swapaxes(-1, -2), 0)
    weights = indexer.weights_proj(x) * (indexer.n_heads**-0.5 * indexer.softmax_scale)
    scores = scores * weights.swapaxes(-1, -2)[..., None]
    return scores.sum(axis=1, keepdims=True)


def verify_attention(attn, x, mask, caches):
    """mlx-lm's DSA attention for a verify pass: every row as one-token decoding selects
    (its own top-k of the keys up to its position) and computes (absorbed formula)."""
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
    scores = index_scores(attn.indexer, x, qr, index_cache)  # (B, 1, L, T)
    latent_cache.keys = mx.depends(latent_cache.keys, (index_cache.keys, index_cache.values))
    T = latent.shape[2]
    mask = mask if mask is not None else mx.ones((L, T), mx.bool_)
    q_abs = attn.embed_q(q_nope)  # (B, H, L, R)
    if T <= attn.indexer.index_topk:  # no row has more keys than top-k: dense
        s = (q_pe * attn.scale) @ k_pe.swapaxes(-1, -2) + (q_abs * attn.scale) @ \
            latent.swapaxes(-1, -2)
        keep, gathered, pe = mask, latent, None
    else:
        top = mx.argpartition(mx.where(mask, scores, -float("inf")),
                              kth=-attn.indexer.index_topk, axis=-1)
        top = top[..., -attn.indexer.index_topk:]  # (B, 1, L, k)
        gathered = mx.take_along_axis(latent[:, :, None], top[..., None], axis=3)
        pe = mx.take_along_axis(k_pe[:, :, None], top[..., None], axis=3)  # (B,1,L,k,dr)
        s = ((q_pe * attn.scale)[..., None, :] * pe).sum(-1) + \
            ((q_abs * attn.scale)[..., None, :] * gathered).sum(-1)  # (B, H, L, k)
        keep = mx.take_along_axis(mx.broadcast_to(mask, (B, 1, L, T)), top, axis=-1)
    s = mx.where(keep, s, mx.array(mx.finfo(s.dtype).min, s.dtype))
    p = mx.softmax(s.astype(mx.float32), axis=-1).astype(s.dtype)
    out = p @ gathered if pe is None else (p[..., None] * gathered).sum(-2)
    out = attn.unembed_out(out)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
