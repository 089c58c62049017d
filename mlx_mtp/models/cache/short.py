"""Short per-position windows with exact rollback: the last few rows of a layer's inputs
that its next positions read (Qwen4-Exp's PLE: the dilated convolution's window and the
last n-1 token ids its hashed n-grams continue from).

A pass of ``T`` positions hands each window its old rows followed by the new ones
(``advance``); the window keeps the last rows. A verify pass (``capture``) also keeps those
inputs, so ``accept(n_keep)`` cuts row ``b``'s windows after its ``n_keep[b]`` positions:
the same rows plain decoding would hold, no recomputation. A cache that has seen no pass
(a one-token prompt runs none before it decodes) holds its layer's start values (``fills``),
made in a batch's shapes when it joins one. Kind ``short``.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import mlx.core as mx

from .kv import CACHE_KINDS, _Cache


class ShortWindowCache(_Cache):
    """A layer's convolution window (B, n, D) and token window (B, m); None until the
    first pass. ``fills``: each window's start value (zeros, the padding token), given by the
    layer that makes the cache."""

    kind = "short"
    state_names = ("conv", "tokens")

    def __init__(self, rows: int = 1, fills: Optional[Tuple[float, ...]] = None):
        self.fills = fills
        self.windows: Optional[Tuple[mx.array, ...]] = None
        self.offset = 0
        self.pending: Optional[Tuple[Tuple[mx.array, ...], int]] = None  # verify inputs, T
        self._rows = rows

    @classmethod
    def empty(cls, B: int = 1) -> "ShortWindowCache":
        return cls(B)

    def size(self) -> int:
        return self._rows if self.windows is None else self.windows[0].shape[0]

    @property
    def state(self):
        return self.windows or ()

    @state.setter
    def state(self, v):
        self.windows = tuple(v) if v else None
        self.pending = None

    def arrays(self) -> List[mx.array]:
        return list(self.windows or ())

    @property
    def meta_state(self):
        return (str(self.offset),)

    @meta_state.setter
    def meta_state(self, v):
        self.offset = int(v[0])

    def advance(self, inputs: Tuple[mx.array, ...], T: int, capture: bool):
        """After a pass of ``T`` positions: ``inputs[i]`` is window i's old rows followed by
        the pass's rows (time axis 1)."""
        self.windows = tuple(mx.contiguous(x[:, T:]) for x in inputs)
        self.pending = (inputs, T) if capture else None
        self.offset += T

    def accept(self, n_keep):
        """Row ``b`` keeps its windows after ``n_keep[b]`` positions of the verify pass."""
        if self.pending is None:
            raise RuntimeError("accept() needs a forward pass run with capture=True")
        (inputs, T), self.pending = self.pending, None
        n_keep = list(n_keep)
        if not 1 <= min(n_keep) <= max(n_keep) <= T or len(n_keep) != inputs[0].shape[0]:
            raise ValueError(f"n_keep {n_keep} does not fit a verify pass of {T} positions")
        self.offset -= T - max(n_keep)
        if all(n == T for n in n_keep):
            return
        starts = mx.array(n_keep)[:, None]
        self.windows = tuple(
            mx.take_along_axis(x, (starts + mx.arange(x.shape[1] - T)[None]).reshape(
                len(n_keep), -1, *([1] * (x.ndim - 2))), axis=1)
            for x in inputs)

    def snapshot(self):
        return self.windows, self.offset, self._rows

    def restore(self, snap):
        self.windows, self.offset, self._rows = snap
        self.pending = None

    def is_trimmable(self) -> bool:
        return False

    @classmethod
    def merge(cls, caches: List["ShortWindowCache"]) -> "ShortWindowCache":
        """The caches' rows in order; a cache that has seen no pass joins with its start
        values, shaped like the windows of one that has."""
        out = cls(sum(c.size() for c in caches), caches[0].fills)
        out.offset = max(c.offset for c in caches)
        like = next((c.windows for c in caches if c.windows is not None), None)
        if like is not None:
            out.windows = tuple(mx.concatenate(ws) for ws in zip(
                *(c.windows if c.windows is not None else c._start(like) for c in caches)))
        return out

    def _start(self, like: Tuple[mx.array, ...]) -> Tuple[mx.array, ...]:
        """This cache's rows at their start values, in ``like``'s window shapes and dtypes."""
        if self.fills is None:  # only a loaded cache, and one saved before any pass
            raise ValueError("a short-window cache without its start values joins a batch "
                             "only after a pass")
        return tuple(mx.full((self.size(), *w.shape[1:]), f, w.dtype)
                     for w, f in zip(like, self.fills))

    def filter(self, rows: List[int]):
        self.pending = None
        self._rows = len(rows)
        if self.windows is not None:
            ix = mx.array(rows)
            self.windows = tuple(w[ix] for w in self.windows)

    def extract(self, row: int) -> "ShortWindowCache":
        c = ShortWindowCache(fills=self.fills)
        if self.windows is not None:
            c.windows = tuple(w[row: row + 1] for w in self.windows)
        c.offset = self.offset
        return c

    def copy(self) -> "ShortWindowCache":
        c = ShortWindowCache(self._rows, self.fills)
        c.windows = None if self.windows is None else tuple(mx.array(w) for w in self.windows)
        c.offset = self.offset
        return c


CACHE_KINDS[ShortWindowCache.kind] = ShortWindowCache
