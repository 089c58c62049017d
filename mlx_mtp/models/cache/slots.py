"""The columns of batch caches (``kv.BatchKVCache`` and its kinds): which slots rows use,
squeezing holes out, and giving back the leading columns no row uses once rows leave.

A batch's rows are right-aligned at one write pointer, so a short row beside a long one is
left-padded to the long one's length. ``filter_caches`` keeps some rows of every cache of a
batch, then drops the leading columns none of the kept rows uses (mlx-lm's
``BatchKVCache.filter`` shifts by the smallest left padding the same way): otherwise the
rows left behind by a departed long row would attend over its padding, and hold its
memory, until their buffer next grows. Each cache counts its own unused columns, so caches
written alike (the trunk's layers, which share one mask; a DSA layer's latents and
indexer keys) drop the same count and stay aligned; the counts of every cache are read in
one host sync. A batch loses a row rarely (not every step), so that sync is off the decode
step's path.
"""

from __future__ import annotations

from typing import List

import mlx.core as mx
import numpy as np


def stack_left_padded(caches: list):
    """The single-row caches' (``KVCache``) stored keys and values as rows of one batch,
    left-padded to the longest, and the (B, L) mask of real slots; all None while every
    cache is empty."""
    ref = next((c for c in caches if c.keys is not None), None)
    if ref is None:
        return None, None, None
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
    valid = mx.arange(L)[None] >= mx.array([L - c.stored for c in caches])[:, None]
    return mx.concatenate(ks), mx.concatenate(vs), valid


def squeeze_index(valid: mx.array, idx: int):
    """(gather (B, 1, L, 1), valid (B, L), L): each row's valid slots below ``idx``, in
    order, left-padded to the longest row (what a growing buffer keeps)."""
    valid = np.array(valid[:, :idx])
    counts = valid.sum(axis=1)
    L = int(counts.max()) if counts.size else 0
    order = np.argsort(~valid, axis=1, kind="stable")  # valid slots first, in order
    index = np.zeros((len(counts), L), np.int32)
    for b, n in enumerate(counts):
        index[b, L - n :] = order[b, :n]
    new_valid = mx.arange(L)[None] >= mx.array(L - counts)[:, None]
    return mx.array(index)[:, None, :, None], new_valid, L


def unused_leading(valid: mx.array) -> mx.array:
    """How many leading columns of ``valid`` (B, L) no row uses (a scalar, not evaluated)."""
    used = valid.any(axis=0)
    return mx.where(used.any(), mx.argmax(used.astype(mx.int32)), used.shape[0])


def without_leading(a: mx.array, n: int, idx: int, axis: int) -> mx.array:
    """``a`` without its ``n`` leading columns along ``axis``, in a new buffer (so the old
    one is freed) with the same room past the write pointer ``idx``."""
    head = (slice(None),) * axis
    room = list(a.shape)
    room[axis] -= idx
    return mx.concatenate([a[head + (slice(n, idx),)], mx.zeros(room, a.dtype)], axis=axis)


def filter_caches(caches: list, rows: List[int]):
    """Keep ``rows`` (in that order) of every cache, then drop each cache's leading columns
    that none of them uses, all counts read in one sync (see the module doc)."""
    for c in caches:
        c.keep_rows(rows)
    counted = [(c, n) for c in caches for n in [c.unused_columns()] if n is not None]
    if counted:
        counts = mx.stack([n for _, n in counted]).tolist()
        for (c, _), n in zip(counted, counts):
            c.drop_columns(n)
