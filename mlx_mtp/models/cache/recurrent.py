"""The cache of a Gated DeltaNet (recurrent) layer, with exact rollback.

A recurrence cannot be trimmed, so a verify pass (``capture=True``) keeps the pre-verify
state and the per-position recurrence inputs (references only: MLX arrays are
immutable). ``accept`` then *replays* the recurrence from the pre-verify state over the
kept prefix, with the same call plain decoding makes (bit-identical to it), as a lazy
graph; no per-position state is ever materialised. It speaks the cache protocol of
``cache.py`` under the kind ``rec``.
"""

from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Tuple

import mlx.core as mx

from .kv import CACHE_KINDS, _Cache


class VerifyRecord(NamedTuple):
    """What ``accept`` needs to recompute a Gated DeltaNet layer's state after
    a verify pass: the state before it, the pass's conv input (pre-verify
    window followed by the new positions) and the recurrence inputs."""

    conv_input: mx.array  # (B, kernel-1+T, conv_dim)
    ssm: Optional[mx.array]  # (B, Hv, Dv, Dk) before the pass (None: zeros)
    inputs: Tuple[mx.array, ...]  # per-position (q, k, v, a, b), time axis 1
    mask: Optional[mx.array]  # (B, T) mask the pass ran with
    recurrence: Callable  # (*inputs, state, mask) -> (y, state): the layer's call


class RecurrentCache(_Cache):
    """Conv window + recurrent state of one Gated DeltaNet layer (B rows).

    ``conv``: (B, kernel-1, conv_dim) in the activation dtype.
    ``ssm``:  (B, Hv, Dv, Dk) in float32.
    After a verify pass both hold the state after *all* its positions and
    ``verify_record`` what ``accept`` needs to step back.
    """

    kind = "rec"
    state_names = ("conv", "ssm")

    def __init__(self, rows: int = 1):
        self.conv: Optional[mx.array] = None  # None: no token seen yet (zeros)
        self.ssm: Optional[mx.array] = None
        self.offset = 0
        self.verify_record: Optional[VerifyRecord] = None
        self._rows = rows  # while empty

    @classmethod
    def empty(cls, B: int = 1) -> "RecurrentCache":
        return cls(B)

    @classmethod
    def zeros(cls, conv_shape: Tuple[int, int], ssm_shape: Tuple[int, ...],
              dtype) -> "RecurrentCache":
        """One row holding the zero state up front: ``conv_shape`` (kernel - 1, conv_dim) in
        ``dtype``, ``ssm_shape`` in float32 (a layer that always reads its state, Mamba-2)."""
        c = cls()
        c.state = (mx.zeros((1, *conv_shape), dtype), mx.zeros((1, *ssm_shape), mx.float32))
        return c

    def size(self) -> int:
        return self._rows if self.conv is None else self.conv.shape[0]

    # mlx-lm's ArraysCache indexing, so its kernels and helpers can read us.
    def __getitem__(self, i):
        return (self.conv, self.ssm)[i]

    def __setitem__(self, i, v):
        setattr(self, self.state_names[i], v)

    @property
    def state(self):
        return self.conv, self.ssm

    @state.setter
    def state(self, v):
        self.conv, self.ssm = v
        self.verify_record = None

    @property
    def meta_state(self):
        return (str(self.offset),)

    @meta_state.setter
    def meta_state(self, v):
        self.offset = int(v[0])

    def snapshot(self):
        return self.conv, self.ssm, self.offset, self._rows

    def restore(self, snap):
        self.conv, self.ssm, self.offset, self._rows = snap
        self.verify_record = None

    def advance(self, conv_input, new_ssm, T: int, record: Optional[VerifyRecord] = None):
        """After a pass of ``T`` positions over ``conv_input`` (old window + them); ``record``
        (a verify pass): what ``accept`` replays from."""
        self.verify_record = record
        self.conv = mx.contiguous(conv_input[:, T:])
        self.ssm = new_ssm
        self.offset += T

    def accept(self, n_keep):
        """Row ``b`` keeps its state after ``n_keep[b]`` positions of the verify pass."""
        if self.verify_record is None:
            raise RuntimeError("accept() needs a forward pass run with capture=True")
        T = self.verify_record.inputs[0].shape[1]
        self.offset -= T - max(n_keep)
        self.select_rows(list(n_keep))

    def select_rows(self, n_keep: List[int]):
        """Keep row b's state after ``n_keep[b]`` positions (offset untouched).

        One replay call for the whole batch: the recurrence over the longest kept
        prefix from the pre-verify state, with a (B, T) mask when rows differ.
        """
        rec = self.verify_record
        if rec is None:
            raise RuntimeError("select_rows() needs a forward pass run with capture=True")
        T = rec.inputs[0].shape[1]
        longest = max(n_keep)
        if not 1 <= min(n_keep) <= longest <= T or len(n_keep) != rec.conv_input.shape[0]:
            raise ValueError(f"n_keep {n_keep} does not fit a verify pass of {T} positions")
        self.verify_record = None
        if all(n == T for n in n_keep):
            return  # conv and ssm already hold the state after every position
        window = rec.conv_input.shape[1] - T
        mask = rec.mask[:, :longest] if rec.mask is not None else None
        if any(n != longest for n in n_keep):
            keep = mx.arange(longest)[None] < mx.array(n_keep)[:, None]
            mask = keep if mask is None else mask & keep
            # Row b's window is conv_input[b, n_b : n_b + window].
            ix = mx.array(n_keep)[:, None] + mx.arange(window)[None]
            self.conv = mx.take_along_axis(rec.conv_input, ix[..., None], axis=1)
        else:
            self.conv = mx.contiguous(rec.conv_input[:, longest : longest + window])
        prefix = [x[:, :longest] for x in rec.inputs]
        _, self.ssm = rec.recurrence(*prefix, rec.ssm, mask)

    @classmethod
    def merge(cls, caches: List["RecurrentCache"]) -> "RecurrentCache":
        """The caches' rows in order; an empty cache's rows hold the zero state."""
        ref = next((c for c in caches if c.conv is not None), None)
        out = cls(sum(c.size() for c in caches))
        out.offset = max(c.offset for c in caches)
        if ref is not None:
            def rows(c, a, like):
                return a if a is not None else mx.zeros((c.size(), *like.shape[1:]), like.dtype)
            out.conv = mx.concatenate([rows(c, c.conv, ref.conv) for c in caches])
            out.ssm = mx.concatenate([rows(c, c.ssm, ref.ssm) for c in caches])
        return out
    concat = merge  # the older name

    def filter(self, rows: List[int]):
        self.verify_record = None  # its rows no longer line up
        self._rows = len(rows)
        if self.conv is not None:
            ix = mx.array(rows)
            self.conv, self.ssm = self.conv[ix], self.ssm[ix]

    def extract(self, row: int) -> "RecurrentCache":
        c = RecurrentCache()
        if self.conv is not None:
            c.conv, c.ssm = self.conv[row : row + 1], self.ssm[row : row + 1]
        c.offset = self.offset
        return c

    def is_trimmable(self) -> bool:
        return False

    def copy(self) -> "RecurrentCache":
        c = RecurrentCache(self._rows)
        c.conv, c.ssm = (None if a is None else mx.array(a) for a in (self.conv, self.ssm))
        c.offset = self.offset
        return c


CACHE_KINDS[RecurrentCache.kind] = RecurrentCache
