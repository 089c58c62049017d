"""The columns of batch caches (``kv.BatchKVCache`` and its kinds): which slots rows use,
left-padding rows to a common length, squeezing holes out, and giving back the leading
columns no row uses once rows leave.

A batch's rows are right-aligned at one write pointer, so a short row beside a long one is
left-padded to the long one's length. When rows leave, ``filter`` drops the leading
columns none of the kept rows uses (mlx-lm's ``BatchKVCache.filter`` shifts by the
smallest left padding the same way): otherwise the rows a departed long row leaves behind
would attend over its padding, and hold its memory, until their buffer next grows. Each
batch cache keeps ``first``, every row's first column in use, on the host (set where rows
are padded, written and squeezed), so the count needs no sync; caches written alike (the
trunk's layers, which share one mask; a DSA layer's latents and indexer keys) hold the same
``first`` and drop the same columns, so they stay aligned. A state loaded from disk has no
``first`` (None) until its buffer next grows: nothing is given back before then.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def stack_left_padded(caches: list):
    """The single-row caches' (``KVCache``) stored keys and values as rows of one batch,
    left-padded to the longest, the (B, L) mask of real slots and each row's first real
    slot; all None while every cache is empty."""
    ref = next((c for c in caches if c.keys is not None), None)
    if ref is None:
        return None, None, None, None
    L = max(c.stored for c in caches)
    H, D, Dv = ref.keys.shape[1], ref.keys.shape[3], ref.values.shape[3]
    ks, vs = [], []
    for c in caches:
        pad = L - c.stored
        zk = mx.zeros((1, H, pad, D), ref.keys.dtype)
        zv = mx.zeros((1, H, pad, Dv), ref.values.dtype)
        k, v = c.state
        ks.append(zk if k is None else mx.concatenate([zk, k], axis=2))
        vs.append(zv if v is None else mx.concatenate([zv, v], axis=2))
    first = [L - c.stored for c in caches]
    valid = mx.arange(L)[None] >= mx.array(first)[:, None]
    return mx.concatenate(ks), mx.concatenate(vs), valid, first


def squeeze_index(valid: mx.array, idx: int):
    """(gather (B, 1, L, 1), valid (B, L), L, first): each row's valid slots below ``idx``,
    in order, left-padded to the longest row (what a growing buffer keeps), and where each
    row's first one lands."""
    valid = np.array(valid[:, :idx])
    counts = valid.sum(axis=1)
    L = int(counts.max()) if counts.size else 0
    order = np.argsort(~valid, axis=1, kind="stable")  # valid slots first, in order
    index = np.zeros((len(counts), L), np.int32)
    for b, n in enumerate(counts):
        index[b, L - n :] = order[b, :n]
    new_valid = mx.arange(L)[None] >= mx.array(L - counts)[:, None]
    return mx.array(index)[:, None, :, None], new_valid, L, (L - counts).tolist()


def first_after_write(cache, S: int):
    """``cache.first`` after a chunk of ``S`` columns at its write pointer (called before
    ``idx`` and ``pos`` move): a row that held no token starts at its first real one."""
    if cache.first is None:
        return None
    return [cache.idx + S - n if p == 0 and n else f
            for f, p, n in zip(cache.first, cache.pos, cache.chunk_lengths(S))]


def first_after_padding(L: int, *caches):
    """The ``first`` of ``caches``' rows, one after the other, each cache left-padded to ``L``
    columns (``extend``)."""
    if any(c.first is None for c in caches):
        return None
    return [f + L - c.idx for c in caches for f in c.first]


def without_leading(a: mx.array, n: int, idx: int, axis: int) -> mx.array:
    """``a`` without its ``n`` leading columns along ``axis``, in a new buffer (so the old
    one is freed) with the same room past the write pointer ``idx``; ``a`` itself if n is 0."""
    if not n:
        return a
    head = (slice(None),) * axis
    room = list(a.shape)
    room[axis] -= idx
    return mx.concatenate([a[head + (slice(n, idx),)], mx.zeros(room, a.dtype)], axis=axis)
