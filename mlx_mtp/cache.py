"""Caches for hybrid (Gated DeltaNet + attention) models, with exact rollback.

Two kinds of per-layer state:

* ``KVCache`` for full-attention layers (trunk and MTP head). Rolling back
  ``n`` speculative positions is a pointer move (``trim``); the stale rows are
  overwritten by the next write.
* ``RecurrentCache`` for Gated DeltaNet layers: a convolution window and the
  recurrent (SSM) state. A recurrence cannot be trimmed, so a verify pass
  asks the layer to *capture* the state after every position; after the accept
  decision ``select(n)`` keeps the state after the ``n``-th verified token.
  Nothing is re-run.

``rollback(caches, n_keep, n_total)`` applies the right operation to every
layer, so the engine never needs to know which layer is which.
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx


class KVCache:
    """Growable key/value cache for one attention layer (batch size B)."""

    step = 256

    def __init__(self):
        self.keys: Optional[mx.array] = None  # (B, n_kv_heads, capacity, head_dim)
        self.values: Optional[mx.array] = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        prev = self.offset
        n = keys.shape[2]
        if self.keys is None or prev + n > self.keys.shape[2]:
            B, H, _, Dk = keys.shape
            Dv = values.shape[3]
            grow = ((n + self.step - 1) // self.step) * self.step
            new_k = mx.zeros((B, H, grow, Dk), keys.dtype)
            new_v = mx.zeros((B, H, grow, Dv), values.dtype)
            if self.keys is not None:
                new_k = mx.concatenate([self.keys[..., :prev, :], new_k], axis=2)
                new_v = mx.concatenate([self.values[..., :prev, :], new_v], axis=2)
            self.keys, self.values = new_k, new_v
        self.keys[..., prev : prev + n, :] = keys
        self.values[..., prev : prev + n, :] = values
        self.offset += n
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    @property
    def state(self):
        if self.keys is None:
            return None, None
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    def is_trimmable(self) -> bool:
        return True

    def make_mask(self, n: int):
        return "causal" if n > 1 else None

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes

    def copy(self) -> "KVCache":
        c = KVCache()
        if self.keys is not None:
            k, v = self.state
            c.keys, c.values = mx.array(k), mx.array(v)
            c.offset = self.offset
        return c


class RecurrentCache:
    """Conv window + recurrent state of one Gated DeltaNet layer.

    ``conv``: (B, kernel-1, conv_dim) in the activation dtype.
    ``ssm``:  (B, Hv, Dv, Dk) in float32.
    """

    def __init__(self):
        self.conv: Optional[mx.array] = None
        self.ssm: Optional[mx.array] = None
        self.offset = 0
        # Per-position states from the last verify pass (lists indexed by
        # position, state *after* that position), set by the layer when asked.
        self.captured_conv: Optional[List[mx.array]] = None
        self.captured_ssm: Optional[List[mx.array]] = None

    # mlx-lm's ArraysCache indexing, so its kernels and helpers can read us.
    def __getitem__(self, i):
        return (self.conv, self.ssm)[i]

    def __setitem__(self, i, v):
        if i == 0:
            self.conv = v
        else:
            self.ssm = v

    @property
    def state(self):
        return self.conv, self.ssm

    def select(self, n_keep: int):
        """Keep the state after the first ``n_keep`` tokens of the captured pass."""
        if self.captured_ssm is None:
            raise RuntimeError("select() needs a forward pass run with capture=True")
        self.conv = self.captured_conv[n_keep - 1]
        self.ssm = self.captured_ssm[n_keep - 1]
        self.offset -= len(self.captured_ssm) - n_keep
        self.clear_captured()

    def clear_captured(self):
        self.captured_conv = self.captured_ssm = None

    def is_trimmable(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.conv, self.ssm) if a is not None)

    def copy(self) -> "RecurrentCache":
        c = RecurrentCache()
        c.conv = None if self.conv is None else mx.array(self.conv)
        c.ssm = None if self.ssm is None else mx.array(self.ssm)
        c.offset = self.offset
        return c


def rollback(caches, n_keep: int, n_total: int):
    """Undo the last ``n_total - n_keep`` positions of a verify pass of ``n_total``.

    Recurrent layers take their captured state after ``n_keep`` tokens; attention
    layers drop the rejected rows. ``n_keep`` >= 1 always (the first verified
    token is the committed one).
    """
    n_drop = n_total - n_keep
    for c in caches:
        if isinstance(c, RecurrentCache):
            if c.captured_ssm is not None:
                if n_drop:
                    c.select(n_keep)
                else:
                    c.clear_captured()
        elif n_drop:
            c.trim(n_drop)


def cache_state_arrays(caches) -> List[mx.array]:
    """Every array that makes up the live state (for mx.eval and comparisons)."""
    out = []
    for c in caches:
        if isinstance(c, RecurrentCache):
            out.extend(a for a in (c.conv, c.ssm) if a is not None)
        else:
            out.extend(a for a in c.state if a is not None)
    return out


def cache_nbytes(caches) -> int:
    return sum(c.nbytes for c in caches)
