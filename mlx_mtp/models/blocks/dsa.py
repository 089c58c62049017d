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

With ``--kv-bits`` both caches hold quantized triples, which mlx-lm's DSA layers cannot read:
every pass is then ours. One-token steps and verify rows run ``verify_attention`` (so a verify
row is a one-token step by construction), reading the triples through ``mx.quantized_matmul``
(scores, absorbed attention); prompt rows run ``prompt_attention``, mlx-lm's multi-token
formula (sparse mask, expanded MLA) over the dequantized cache.
"""

from __future__ import annotations

import mlx.core as mx

from .attention_trunk import quantized_latent_attention


def _quant(cache, held):
    """``mx.quantized_matmul``'s settings if ``held`` (what ``cache`` returned) is a quantized
    triple (``--kv-bits``), else None."""
    return dict(group_size=cache.group_size, bits=cache.bits) if isinstance(held, tuple) else None


def _times_keys(q, keys, quant):
    """``q @ keys^T``, the keys in full precision or quantized (``quant``)."""
    if quant is None:
        return q @ keys.swapaxes(-1, -2)
    return mx.quantized_matmul(q, *keys, transpose=True, **quant)


def index_scores(indexer, x, qr, cache, latent_cache):
    """The indexer's scores (B, 1, L, T) for L queries over all T cached keys (one-token
    path's head reduction); writes the indexer cache (``cache.index.IndexKeyCache``)."""
    b, s, _ = x.shape
    q = indexer.wq_b(qr).reshape(b, s, indexer.n_heads, indexer.head_dim).swapaxes(1, 2)
    k = indexer.k_norm(indexer.wk(x)).reshape(b, 1, s, indexer.head_dim)
    offset = cache.offset
    q, k = indexer.rope(q, offset=offset), indexer.rope(k, offset=offset)
    k = cache.update_keys(k, latent_cache)
    scores = mx.maximum(_times_keys(q, k, _quant(cache, k)), 0)
    weights = indexer.weights_proj(x) * (indexer.n_heads**-0.5 * indexer.softmax_scale)
    scores = scores * weights.swapaxes(-1, -2)[..., None]
    return scores.sum(axis=1, keepdims=True)


def verify_attention(attn, x, mask, caches):
    """mlx-lm's DSA attention for a verify pass: every row as one-token decoding selects
    (its own top-k of the keys up to its position) and computes (absorbed formula, the
    row's own attention call)."""
    B, L, _ = x.shape
    q_nope, q_pe, latent, k_pe, scores, quant = _project_and_cache(attn, x, caches)
    T = scores.shape[-1]
    mask = mask if mask is not None else mx.arange(T - L, T)[:, None] >= mx.arange(T)
    q_abs = attn.embed_q(q_nope)  # (B, H, L, R)
    # Row i has the keys up to its position: plain decoding attends to all of them while
    # they are at most top-k (mlx-lm's indexer returns nothing), else to its top-k.
    dense = max(0, min(L, attn.indexer.index_topk - (T - L)))
    parts = []
    if dense:
        parts.append(_dense_rows(attn, q_abs[:, :, :dense], q_pe[:, :, :dense], latent, k_pe,
                                 mask[..., :dense, :], quant))
    if dense < L:
        parts.append(_sparse_rows(attn, q_abs[:, :, dense:], q_pe[:, :, dense:], latent, k_pe,
                                  mask[..., dense:, :], scores[:, :, dense:], quant))
    out = attn.unembed_out(parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2))
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def prompt_attention(attn, x, mask, caches):
    """Prompt rows over caches held quantized (``--kv-bits``): mlx-lm's multi-token DSA (each
    row's top-k as a sparse mask, expanded MLA) over the dequantized latents."""
    B, L, _ = x.shape
    q_nope, q_pe, latent, k_pe, scores, quant = _project_and_cache(attn, x, caches)
    if quant is not None:
        latent, k_pe = (mx.dequantize(*a, **quant) for a in (latent, k_pe))
    T, k = latent.shape[2], attn.indexer.index_topk
    mask = mask if mask is not None else mx.arange(T - L, T)[:, None] >= mx.arange(T)
    if T > k:
        top = mx.argpartition(mx.where(mask, scores, -float("inf")), kth=-k, axis=-1)[..., -k:]
        mask = mask & mx.put_along_axis(mx.zeros(scores.shape, mx.bool_), top, mx.array(True),
                                        axis=-1)
    pe = _masked((q_pe * attn.scale) @ k_pe.swapaxes(-1, -2), mask)
    out = mx.fast.scaled_dot_product_attention(
        q_nope, attn.embed_q(latent, transpose=False), attn.unembed_out(latent),
        scale=attn.scale, mask=pe)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def _project_and_cache(attn, x, caches):
    """The queries (nope and RoPE parts), every cached latent and RoPE key (this pass's
    written), the indexer's scores (B, 1, L, T) and the cache's quantization (None: full
    precision)."""
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
    return q_nope, q_pe, latent, k_pe, scores, _quant(latent_cache, latent)


def _masked(scores, mask):
    return mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))


def _dense_rows(attn, q_abs, q_pe, latent, k_pe, mask, quant):
    """Rows attending to every key up to their position (mlx-lm's absorbed one-token call)."""
    pe = _masked(_times_keys(q_pe * attn.scale, k_pe, quant), mask)
    if quant is not None:
        return quantized_latent_attention(q_abs, latent, pe, attn.scale, quant)
    return mx.fast.scaled_dot_product_attention(q_abs, latent, latent, scale=attn.scale,
                                                mask=pe)


def _sparse_rows(attn, q_abs, q_pe, latent, k_pe, mask, scores, quant):
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

    def picked(a):  # (B, 1, T, d) -> each row's top-k keys, in top's order: (B*L, 1, k, d)
        out = mx.take_along_axis(a[:, :, None], top[..., None], axis=3)  # (B, 1, L, k, d)
        return out.reshape(B * L, 1, k, a.shape[-1])

    def rows(held):  # a quantized triple: each of its arrays (positions stand alone)
        return tuple(map(picked, held)) if quant is not None else picked(held)

    gathered, pe_keys = rows(latent), rows(k_pe)
    per_row = lambda a: a.transpose(0, 2, 1, 3).reshape(B * L, H, 1, a.shape[-1])
    pe = _times_keys(per_row(q_pe) * attn.scale, pe_keys, quant)  # (B*L, H, 1, k)
    keep = mx.take_along_axis(mx.broadcast_to(mask, (B, 1, L, mask.shape[-1])), top, axis=-1)
    pe = _masked(pe, keep.reshape(B * L, 1, 1, k))
    if quant is not None:
        out = quantized_latent_attention(per_row(q_abs), gathered, pe, attn.scale, quant)
    else:
        out = mx.fast.scaled_dot_product_attention(per_row(q_abs), gathered, gathered,
                                                   scale=attn.scale, mask=pe)
    return out.reshape(B, L, H, R).transpose(0, 2, 1, 3)
