"""The cache of one DeepSeek-V4 attention layer: a sliding window of keys (K = V) and, on
compressed layers, the compressed entries of each series (CSA: the compressor and its
indexer's; HCA: the compressor's) with the raw projections still needed to build the next
entries.

A series compresses every ``ratio`` positions into one entry. CSA's entry ``w`` pools window
``w - 1``'s first half (Ca) with window ``w``'s second half (Cb), so a series keeps the raw
rows of its last complete window (the overlap) and of the incomplete one (the buffer):
``rows`` covers positions ``[max(0, (offset // ratio - 1) * ratio), offset)``.

None of this can be trimmed: the window drops old keys and entries pool several positions.
A verify pass (``begin(L, capture=True)``) keeps the state before it and the pass's new
rows; ``accept(n_keep)`` rebuilds the state after the kept prefix by slicing, since entries
of windows complete inside the kept prefix are the ones the pass computed (the same inputs
as plain decoding). A batch keeps its rows' caches apart (``CompressedRows``). The MTP
head's cache is a window alone, keeping ``spare`` keys past it so a step's drafts can be
trimmed.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Tuple

import mlx.core as mx

from .kv import CACHE_KINDS, _Cache


SERIES = ("compressor", "indexer")  # CSA has both, HCA the first


class Series(NamedTuple):
    rows_kv: Optional[mx.array]  # (B, r, width) raw projections, see the module doc
    rows_gate: Optional[mx.array]
    entries: Optional[mx.array]  # (B, T, d) compressed entries so far


class Pending(NamedTuple):
    """What a series compresses in this pass: whole windows from ``first`` on, and the raw
    rows of the window before them (None: there is none)."""

    kv: mx.array  # (B, n * ratio, width)
    gate: mx.array
    first: int  # absolute position of the first window
    prior_kv: Optional[mx.array]  # (B, ratio, width)
    prior_gate: Optional[mx.array]


def _cat(a, b, axis: int):
    """``b`` after ``a`` (None: nothing yet) along ``axis``; quantized triples part by part."""
    if a is None:
        return b
    if isinstance(b, tuple):
        return tuple(mx.concatenate([x, y], axis=axis) for x, y in zip(a, b))
    return mx.concatenate([a, b], axis=axis)


def _span(a, axis: int, start: int = 0, stop: Optional[int] = None):
    """Positions ``start:stop`` along ``axis`` of an array or a quantized triple."""
    if isinstance(a, tuple):
        return tuple(_span(x, axis, start, stop) for x in a)
    return a[(slice(None),) * axis + (slice(start, stop),)]


def _length(a, axis: int) -> int:
    return (a[0] if isinstance(a, tuple) else a).shape[axis]


class CompressedWindowCache(_Cache):
    """One DeepSeek-V4 attention layer's cache (one row)."""

    kind = "dsv4"

    def __init__(self, window: int = 0, ratio: int = 0, names: Tuple[str, ...] = (),
                 spare: int = 0):
        self.window_size, self.ratio, self.names = window, ratio, tuple(names)
        self.spare = spare  # keys kept past the window, so ``trim`` can drop that many
        self.keys: Optional[mx.array] = None  # (B, 1, <= window - 1, D)
        self.series: Dict[str, Series] = {n: Series(None, None, None) for n in self.names}
        self.offset = 0
        self.start = 0  # the current pass's first position
        self.pass_rows: Optional[dict] = None  # a verify pass: its new rows per part
        self.before = None  # a verify pass: the snapshot before it
        self.chunk: Optional[List[int]] = None  # each row's positions in the next chunk

    @classmethod
    def from_state(cls, state, meta_state):
        c = cls()
        c.meta_state = meta_state  # first: it names the series ``state`` holds
        if state is not None:
            c.state = state
        return c

    def settings(self) -> tuple:
        return self.window_size, self.ratio, self.names, self.spare

    def check_joins(self, row):
        """Rows are kept apart (``CompressedRows``): only kind and settings must agree."""
        if row.kind != self.kind or row.settings() != self.row(0).settings():
            raise ValueError(f"a {row.kind!r} cache of settings {row.settings()} cannot join "
                             f"DeepSeek-V4 rows of settings {self.row(0).settings()}")

    def prepare(self, S: int, lengths=None):
        self.chunk = None if lengths is None else list(lengths)

    def row_lengths(self, S: int) -> List[int]:
        """Each row's positions in a chunk of ``S`` (right-aligned): as ``prepare`` announced
        them, once; all ``S`` without an announcement."""
        chunk, self.chunk = self.chunk, None
        return chunk if chunk is not None and max(chunk) == S else [S] * self.size()

    def row(self, b: int) -> "CompressedWindowCache":
        if b != 0:
            raise IndexError(f"a single-row cache has no row {b}")
        return self

    # Every layer names both series (a layer without one stores empty arrays for it).
    state_names = ("keys",) + tuple(f"{n}.{p}" for n in SERIES for p in Series._fields)

    @property
    def state(self):
        empty = Series(*[mx.zeros((1, 0, 0))] * 3)
        return (self.keys,) + tuple(a for n in SERIES
                                    for a in (self.series[n] if n in self.names else empty))

    @state.setter
    def state(self, v):
        self.keys = v[0]
        for i, n in enumerate(SERIES):
            if n in self.names:
                self.series[n] = Series(*v[1 + 3 * i: 4 + 3 * i])
        self.pass_rows = self.before = None

    @property
    def meta_state(self):
        return tuple(map(str, (self.offset, self.window_size, self.ratio, self.spare))) + self.names

    @meta_state.setter
    def meta_state(self, v):
        self.offset, self.window_size, self.ratio, self.spare = (int(x) for x in v[:4])
        self.names = tuple(v[4:])
        self.series = {n: self.series.get(n, Series(None, None, None)) for n in self.names}

    # --- one pass ---------------------------------------------------------
    def begin(self, L: int, capture: bool = False):
        """A pass of ``L`` positions starts (``capture``: a verify pass, rolled back by
        ``accept``)."""
        self.before = self.snapshot() if capture else None
        self.pass_rows = {} if capture else None
        self.start = self.offset
        self.offset += L

    def window_keys(self, kv: mx.array) -> mx.array:
        """The kept window followed by the pass's keys ``kv`` (B, 1, L, D); keeps the last
        ``window - 1``."""
        full = _cat(self.keys, self._stored(kv), axis=2)
        keep = self.window_size - 1 + self.spare
        self.keys = _span(full, 2, max(0, _length(full, 2) - keep))
        if self.pass_rows is not None:
            self.pass_rows["keys"] = kv
        return self._read(full)

    def pending(self, name: str, kv: mx.array, gate: mx.array) -> Pending:
        """Series ``name`` takes the pass's raw rows; returns the windows they complete."""
        old = self.series[name]
        if self.pass_rows is not None:
            self.pass_rows[name] = (kv, gate)
        all_kv, all_gate = _cat(old.rows_kv, kv, 1), _cat(old.rows_gate, gate, 1)
        m, start, end = self.ratio, self.start, self.offset
        rows_start = self._rows_start(start)
        first, last = start // m * m, end // m * m
        chunk = slice(first - rows_start, last - rows_start)
        prior = None
        if first >= m:
            prior = slice(first - m - rows_start, first - rows_start)
        keep = slice(self._rows_start(end) - rows_start, None)
        self.series[name] = Series(all_kv[:, keep], all_gate[:, keep], old.entries)
        return Pending(all_kv[:, chunk], all_gate[:, chunk], first,
                       None if prior is None else all_kv[:, prior],
                       None if prior is None else all_gate[:, prior])

    def add_entries(self, name: str, entries: mx.array) -> mx.array:
        """Append series ``name``'s new entries (B, n, d); returns all of them."""
        s = self.series[name]
        self.series[name] = s._replace(entries=_cat(s.entries, self._stored(entries), 1))
        return self._read(self.series[name].entries)

    def _stored(self, x: mx.array):
        """Keys or entries as this cache holds them (a quantized kind: quantized triples)."""
        return x

    def _read(self, held) -> mx.array:
        """What the attention reads of held keys or entries."""
        return held

    def _rows_start(self, offset: int) -> int:
        return max(0, (offset // self.ratio - 1) * self.ratio)

    # --- rollback ---------------------------------------------------------
    def snapshot(self):
        return self.keys, dict(self.series), self.offset

    def restore(self, snap):
        self.keys, series, self.offset = snap
        self.series = dict(series)
        self.pass_rows = self.before = None

    def accept(self, n_keep):
        """Keep the state after the first ``n_keep[0]`` positions of the verify pass."""
        if self.before is None:
            raise RuntimeError("accept() needs a forward pass run with capture=True")
        n = n_keep[0]
        if len(n_keep) != 1 or not 1 <= n <= self.offset - self.start:
            raise ValueError(f"n_keep {list(n_keep)} does not fit a verify pass of "
                             f"{self.offset - self.start} positions")
        rows, after = self.pass_rows, dict(self.series)
        self.restore(self.before)
        self.begin(n)
        self.window_keys(rows["keys"][:, :, :n])
        for name in self.names:
            kv, gate = rows[name]
            self.pending(name, kv[:, :n], gate[:, :n])
            kept = self.offset // self.ratio
            self.series[name] = self.series[name]._replace(
                entries=_span(after[name].entries, 1, 0, kept))

    # --- batch ------------------------------------------------------------
    @classmethod
    def merge(cls, caches: list) -> "CompressedRows":
        return CompressedRows.merge(caches)

    def lengths(self) -> List[int]:
        return [self.offset]

    def is_trimmable(self) -> bool:
        return self.spare > 0  # a window alone (the MTP head's), with spare keys

    def trim(self, n: int) -> int:
        """Drop the last ``n`` positions (at most the spare keys: a window's only; none
        before its first pass, as a one-token prompt's head in its first step)."""
        if not self.is_trimmable():
            raise ValueError("this DeepSeek-V4 cache cannot be trimmed")
        if self.keys is None:  # a head that has not run (a row of a one-token prompt)
            return 0
        n = min(n, self.offset, self.spare)
        self.keys = _span(self.keys, 2, 0, _length(self.keys, 2) - n)
        self.offset -= n
        return n

    def max_positions(self) -> Optional[int]:
        """The window's keys and a series' raw rows (two windows at most) are bounded; the
        entries grow, one per ``ratio`` positions."""
        return max(self.window_size - 1 + self.spare, 2 * self.ratio if self.names else 0)

    def _like(self) -> "CompressedWindowCache":
        """An empty cache of the same settings."""
        return CompressedWindowCache(self.window_size, self.ratio, self.names, self.spare)

    def copy(self) -> "CompressedWindowCache":
        c = self._like()
        c.keys, c.series, c.offset = self.keys, dict(self.series), self.offset
        return c


CACHE_KINDS[CompressedWindowCache.kind] = CompressedWindowCache


class CompressedRows(_Cache):
    """Several rows' ``CompressedWindowCache``s, kept apart: rows sit at different phases of
    their windows, so within one pass over all rows the model reads each row's window and
    entries from its own cache (``row(b)``)."""

    kind = "dsv4_rows"
    row_kind = CompressedWindowCache.kind

    def __init__(self, rows: List[CompressedWindowCache]):
        self.rows = list(rows)
        self.chunk: Optional[List[int]] = None

    @classmethod
    def merge(cls, caches: list) -> "CompressedRows":
        return cls([r.copy() for c in caches for r in (c.rows if isinstance(c, cls) else [c])])

    def check_joins(self, row):
        self.rows[0].check_joins(row)

    prepare = CompressedWindowCache.prepare
    row_lengths = CompressedWindowCache.row_lengths

    def row(self, b: int) -> CompressedWindowCache:
        return self.rows[b]

    def size(self) -> int:
        return len(self.rows)

    def filter(self, rows: List[int]):
        self.rows = [self.rows[i] for i in rows]

    def extract(self, row: int) -> CompressedWindowCache:
        return self.rows[row].copy()

    def arrays(self) -> List[mx.array]:
        return [a for r in self.rows for a in r.arrays()]

    def snapshot(self):
        return [(r, r.snapshot()) for r in self.rows]

    def restore(self, snap):
        self.rows = [r for r, _ in snap]
        for r, s in snap:
            r.restore(s)

    def accept(self, n_keep):
        for r, n in zip(self.rows, n_keep):
            r.accept([n])

    def trim(self, n: int) -> int:
        return min(r.trim(n) for r in self.rows)

    def lengths(self) -> List[int]:
        return [r.offset for r in self.rows]

    def is_trimmable(self) -> bool:
        return self.rows[0].is_trimmable()

    def max_positions(self) -> Optional[int]:
        return self.rows[0].max_positions()

    def copy(self) -> "CompressedRows":
        return CompressedRows([r.copy() for r in self.rows])


CACHE_KINDS[CompressedRows.kind] = CompressedRows
