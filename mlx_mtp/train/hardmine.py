"""Hard copy tokens (issue 41): weigh up the copy tokens the model currently gets wrong.

A model that copies 95 % of a module can still lose a whole module at one token it finds
likelier than the source's (the merged ``):\\n`` where the source has ``):  # note``;
``merged`` where it has ``merge_settings``): more copy rows rarely show it that spot. With
``--hard-weight W`` a copy document's *copyable* answer tokens (the token and the
``context`` tokens before it also occur in the document's given part) weigh ``W`` times in
the loss wherever the model's top-1 at that position is not the token: hard-token mining
done in the training step's own forward pass, so it costs no extra pass and follows the
model as it learns (a separate mining pass cost ~20 s a window on the shared CPU).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def _runs(ids: np.ndarray, n: int) -> np.ndarray:
    """One int64 key per run of ``n`` consecutive ids (ids < 2**15, n <= 4)."""
    keys = np.zeros(len(ids) - n + 1, np.int64)
    for k in range(n):
        keys = (keys << 15) | ids[k:len(ids) - n + 1 + k].astype(np.int64)
    return keys


def copyable_flags(ids: np.ndarray, starts: np.ndarray, answer: np.ndarray, context: int = 3
                   ) -> np.ndarray:
    """(len(ids),) uint8: 1 on each document's answer tokens whose run of (``context``
    tokens before, token) also occurs in that document's given part (its tokens before the
    answer), i.e. tokens the answer copies."""
    n = context + 1
    out = np.zeros(len(ids), np.uint8)
    for s, e in zip(starts, list(starts[1:]) + [len(ids)]):
        if e - s < n:
            continue
        keys = _runs(ids[s:e], n)
        ends_in_answer = answer[s + n - 1:e].astype(bool)
        hit = np.isin(keys, keys[~ends_in_answer]) & ends_in_answer
        out[s + n - 1:e] = hit
    return out


def hard_weights(logits: mx.array, targets: mx.array, weights: mx.array, hard: mx.array,
                 hard_weight: float) -> mx.array:
    """``weights`` times ``hard_weight`` where ``hard`` flags the target and the model's
    top-1 misses it (no gradient through the choice)."""
    miss = (mx.argmax(logits, axis=-1) != targets) & (hard > 0)
    return mx.stop_gradient(mx.where(miss, weights * hard_weight, weights))
