"""A block drafter's deferred taps (``drafters/block/``): the raw taps of emitted rows whose
projection into the drafter's context waits until the drafter next runs.

Projecting each decode step's taps into every drafter layer's K/V (``ContextCache``) is work
no pass reads while the drafter rests. A decode step (``decode/block_context.py``) keeps its
taps here by reference instead: they are the trunk's own residuals, evaluated with the step,
so keeping them adds no graph node. ``take`` hands every row's back as one right-aligned
chunk, in order, projected in one pass when the drafter resumes or probes (or, in a drafting
step, the previous step's kept rows).

Each deferring pass is one chunk; a verify's ``accept`` keeps each row's leading positions of
the last chunk (``prepare`` announces a pass: a pass that projected its taps instead leaves
the chunks as they are). Rows join, leave and are saved like any cache's (one compacted
chunk: ``state`` is the taps (B, P, W) and tokens (B, P), right-aligned, ``meta_state`` each
row's count).
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import mlx.core as mx

from .kv import CACHE_KINDS, _Cache


class _Chunk(NamedTuple):
    """One pass's taps (one (B, S, H) array per tapped layer, or their concatenation) and
    tokens (B, S); row b's deferred positions are columns ``lo[b]`` .. ``hi[b] - 1``."""

    taps: Tuple[mx.array, ...]
    tokens: mx.array
    lo: Tuple[int, ...]
    hi: Tuple[int, ...]
    width: int  # S


def _joined(arrays: List[mx.array], axis: int) -> mx.array:
    return arrays[0] if len(arrays) == 1 else mx.concatenate(arrays, axis=axis)


class DeferredTaps(_Cache):
    """Each row's deferred taps, as chunks of the passes that deferred them (see the module
    doc)."""

    kind = "block_taps"
    state_names = ("taps", "tokens")
    free_axes = (0, 1)  # rows, positions

    def __init__(self, B: int = 1, chunks=()):
        self.B = B
        self.chunks: List[_Chunk] = list(chunks)
        self._wrote = False  # the pass ``prepare`` announced deferred its taps here

    @classmethod
    def empty(cls, B: int = 1) -> "DeferredTaps":
        return cls(B)

    def size(self) -> int:
        return self.B

    def lengths(self) -> List[int]:
        """Deferred positions per row."""
        return [sum(c.hi[b] - c.lo[b] for c in self.chunks) for b in range(self.B)]

    def columns(self) -> int:
        """Positions held per row, rejected ones included (what the memory holds)."""
        return sum(c.width for c in self.chunks)

    def prepare(self, S: int, lengths=None):
        self._wrote = False

    def add(self, taps, tokens: mx.array):
        """A pass's taps (one (B, S, H) per tapped layer) and the tokens (B, S) it read,
        every position real for every row (the trunk's passes are)."""
        S = tokens.shape[1]
        self.chunks.append(_Chunk(tuple(taps), tokens, (0,) * self.B, (S,) * self.B, S))
        self._wrote = True

    def accept(self, n_keep):
        """Row b keeps the first ``n_keep[b]`` positions of the last pass, if it deferred."""
        if self._wrote:
            last = self.chunks[-1]
            self.chunks[-1] = last._replace(
                hi=tuple(min(h, lo + n) for lo, h, n in zip(last.lo, last.hi, n_keep)))
        self._wrote = False

    def take(self) -> Optional[Tuple[mx.array, mx.array, List[int]]]:
        """Every row's deferred taps (B, P, W) (the tapped layers concatenated) and tokens
        (B, P), right-aligned, and each row's count; None if none. Leaves none deferred."""
        compact = self._compact()
        self.chunks, self._wrote = [], False
        return compact

    def _compact(self) -> Optional[Tuple[mx.array, mx.array, List[int]]]:
        counts = self.lengths()
        P = max(counts, default=0)
        if P == 0:
            return None
        x = _joined([_joined(list(c.taps), -1) for c in self.chunks], 1)
        tokens = _joined([c.tokens for c in self.chunks], 1)
        index = []  # per row: its deferred columns in order, left-padded with its first
        for b in range(self.B):
            cols, start = [], 0
            for c in self.chunks:
                cols += range(start + c.lo[b], start + c.hi[b])
                start += c.width
            index.append([cols[0] if cols else 0] * (P - len(cols)) + cols)
        if any(row != list(range(x.shape[1])) for row in index):
            ix = mx.array(index)
            x = mx.take_along_axis(x, ix[..., None], axis=1)
            tokens = mx.take_along_axis(tokens, ix, axis=1)
        return x, tokens, counts

    def _one_chunk(self, compact) -> List[_Chunk]:
        if compact is None:
            return []
        x, tokens, counts = compact
        P = x.shape[1]
        return [_Chunk((x,), tokens, tuple(P - n for n in counts), (P,) * len(counts), P)]

    def ids_below(self, vocab_size: int) -> bool:
        """Whether every deferred token is an id of the vocabulary (a state read from
        elsewhere: EAGLE-3 embeds them, and an id past the table is read out of bounds)."""
        ids = [c.tokens.reshape(-1).astype(mx.int64) for c in self.chunks]
        if not ids:
            return True
        ids = mx.concatenate(ids)
        return bool(((ids >= 0) & (ids < vocab_size)).all().item())

    # --- the protocol -----------------------------------------------------
    def arrays(self) -> List[mx.array]:
        """What it holds, as held (no compaction: evaluating them builds nothing)."""
        return [a for c in self.chunks for a in (*c.taps, c.tokens)]

    @property
    def state(self):
        compact = self._compact()
        return (None, None) if compact is None else compact[:2]

    @property
    def meta_state(self):
        return tuple(str(n) for n in self.lengths())

    @classmethod
    def from_state(cls, state, meta_state) -> "DeferredTaps":
        counts = [int(n) for n in meta_state]
        c = cls(len(counts))
        if state is None or state[0] is None:
            if any(counts):
                raise ValueError(f"deferred taps: counts {counts} without arrays")
            return c
        x, tokens = state
        if (x.ndim != 3 or tokens.shape != x.shape[:2] or x.shape[0] != len(counts)
                or not mx.issubdtype(tokens.dtype, mx.integer)
                or not all(0 <= n <= x.shape[1] for n in counts)):
            raise ValueError(f"deferred taps {tuple(x.shape)}, tokens {tuple(tokens.shape)} "
                             f"{tokens.dtype} do not fit counts {counts}")
        c.chunks = c._one_chunk((x, tokens, counts))
        return c

    def snapshot(self):
        return list(self.chunks), self._wrote

    def restore(self, snap):
        chunks, self._wrote = snap
        self.chunks = list(chunks)

    def copy(self) -> "DeferredTaps":
        return type(self)(self.B, self.chunks)

    @classmethod
    def merge(cls, caches) -> "DeferredTaps":
        """The caches' rows in order, as one chunk (rows with none deferred: padding)."""
        B = sum(c.B for c in caches)
        parts = [c._compact() for c in caches]
        ref = next((p for p in parts if p is not None), None)
        if ref is None:
            return cls(B)
        P = max(p[0].shape[1] for p in parts if p is not None)
        (x0, t0, _), xs, ts, counts = ref, [], [], []
        for c, p in zip(caches, parts):
            x, t, n = p if p is not None else (
                mx.zeros((c.B, 0, x0.shape[2]), x0.dtype), mx.zeros((c.B, 0), t0.dtype), [0] * c.B)
            pad = P - x.shape[1]
            xs.append(mx.concatenate([mx.zeros((c.B, pad, x.shape[2]), x.dtype), x], axis=1)
                      if pad else x)
            ts.append(mx.concatenate([mx.zeros((c.B, pad), t.dtype), t], axis=1) if pad else t)
            counts += n
        out = cls(B)
        out.chunks = out._one_chunk((mx.concatenate(xs), mx.concatenate(ts), counts))
        return out

    def filter(self, rows: List[int]):
        compact = self._compact()
        self.B, self._wrote = len(rows), False
        if compact is None:
            self.chunks = []
            return
        x, tokens, counts = compact
        ix = mx.array(rows)
        self.chunks = self._one_chunk((x[ix], tokens[ix], [counts[r] for r in rows]))

    def extract(self, row: int) -> "DeferredTaps":
        c = self.copy()
        c.filter([row])
        return c


CACHE_KINDS[DeferredTaps.kind] = DeferredTaps
