"""What a decode step costs: the one table of measured step times, and its estimates.

A step is keyed by its shape: ``B`` rows, ``k`` positions drafted per row (the longest
row's; the trunk verifies ``k + 1``) and ``head``, the passes the MTP head chains (as far
as the longest row that uses it); steps in which the model's block drafter ran
(``drafters/block``: one pass whatever its rows draft, or one per draft for an autoregressive
one, EAGLE-3) are a cost kind of their own, ``block_cells`` beside ``cells``. ``head == k``:
the head ran through every position, the step the K policy plans (K=k; context drafts it
extends cost the same); ``head == 0``: a plain step, or context drafts only
(``draft_source.py``); in between: rows copying from the context beside rows drafting from
the head. The driver (``batch.BatchDecoder``) records one observation per step; every
reader asks this table:

* the K policy (``policy.DraftPolicy``): ``predict(B, K)`` for a head step, from the
  cell or a least-squares fit over every batch size; ``count`` and ``stale`` for its probes;
* the draft-source chooser (``draft_source.RowDrafter``): ``predict_plan(B, k, head,
  block)``, built from ``verify(B, k)`` (a step with no head or drafter pass) plus
  ``head`` times ``head_pass(B)``, plus ``block_pass(B)`` per pass of the block drafter;
* persistence (``step_costs.py``): ``cells``, stored per model shape and machine (not
  ``block_cells``: a drafter's pass depends on the drafter, which that key does not name).

**The clock.** A step's cost is the time from the previous step's read (its host sync)
to its own: what one more step delays the next token by. That includes the Python
between steps (choosing K and the drafts, building the step's graph, committing rows),
which a step really costs on top of its compute: a K whose graph takes longer to build
must pay for it. Timing from the step's launch instead would leave that out, and with
overlapped plain steps (``BatchDecoder(overlap=True)``) a launch-to-read interval
counts the previous step's work. The driver's first step, with nothing read before it,
is timed from its launch only when other work ran in between (``step(interleaved=)``),
else not at all; calibration times steps the same way, read to read.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Tuple

import numpy as np

from . import MAX_DRAFT_TOKENS

Cell = Tuple[int, int, int]  # (rows, positions drafted, head passes)


def _features(B: int, K: int):
    return (1.0, float(B), float(K), float(B * K))


class StepCosts:
    """Seconds per step by (batch size, positions drafted, head passes): the last
    ``memory`` steps of each cell, and what is derived from them (kept until the next
    observation: the chooser reads it for every candidate of every row).

    Head steps are fitted as ``t(B, K) ~ c0 + c1*B + c2*K + c3*B*K`` (drafting is K MTP
    passes over B rows, verifying one trunk pass over B*(K+1) positions). The fit is
    local: cells are weighted by how close their batch size is to the one asked about
    (on a log scale), so costs that grow sub-linearly with rows (a tuned BLAS, a GPU)
    are followed instead of extrapolated from small batches.
    """

    def __init__(self, memory: int = 24):
        self.memory = memory  # a cell keeps its last ``memory`` steps
        self.cells: Dict[Cell, Deque[float]] = {}  # cell -> recent seconds
        self.block_cells: Dict[Cell, Deque[float]] = {}  # the same, with a block pass
        self.block_passes: Dict[Cell, int] = {}  # a block cell's drafter passes (its last step's)
        self._clock = 0  # steps observed
        self._last: Dict[tuple, int] = {}  # (block, cell) -> step of its last observation
        self._derived: Dict[tuple, object] = {}

    def observe(self, B: int, k: int, head: int, seconds: float, block: int = 0):
        """One step's time (``head`` of its ``k`` drafted positions chained by the head;
        ``block``: the block drafter's passes in it, 0 if it did not run)."""
        cell, ran = (B, k, head), int(block > 0)
        table = self._table(ran)
        self._derived.clear()  # first: a copy taken meanwhile (the dashboard's) stays whole
        if self._stale(cell, ran):  # what it measured long ago (other contexts, load) is gone
            table.pop(cell, None)
        table.setdefault(cell, deque(maxlen=self.memory)).append(seconds)
        if ran:
            self.block_passes[cell] = block
        self._clock += 1
        self._last[(ran, cell)] = self._clock

    def _table(self, block: int) -> Dict[Cell, Deque[float]]:
        return self.block_cells if block else self.cells

    def _memo(self, key, fn: Callable):
        if key not in self._derived:
            self._derived[key] = fn()
        return self._derived[key]

    def _stale(self, cell: Cell, block: int = 0, horizon: int = 256) -> bool:
        return self._clock - self._last.get((block, cell), 0) > horizon

    # -- head steps: the K policy ---------------------------------------------------
    def stale(self, B: int, K: int) -> bool:
        """The head step not measured in the last 256 steps (contexts grow, load changes)."""
        return self._stale((B, K, K))

    def count(self, B: int, K: int) -> int:
        """Steps the head step's cell holds."""
        return len(self.cells.get((B, K, K), ()))

    def deepest_within(self, B: int, max_k: int, ratio: float) -> int:
        """The deepest head step K (up to ``max_k``) at most ``ratio`` plain steps, both
        measured lately (``stale``: contexts grow, so an old figure is from shorter ones and
        cheaper; a K not taken since is not probed either); 0 if none."""
        t0 = self.measured(B, 0)
        if t0 is None or self.stale(B, 0):
            return 0
        return max((k for k in range(1, max_k + 1) if not self.stale(B, k)
                    and (self.measured(B, k) or math.inf) <= ratio * t0), default=0)

    def measured(self, B: int, K: int) -> Optional[float]:
        """The head step's own median (None: never measured)."""
        return self._median((B, K, K))

    def predict(self, B: int, K: int) -> Optional[float]:
        """A head step of K drafts (K=0: plain): the cell's own median once it has a
        few steps, else the fit or the thin cell, whichever is lower (None: unknown).
        Optimism is self-correcting: a K chosen on a low estimate gets measured; one
        dismissed on a high one would not."""
        direct = self.measured(B, K)
        if direct is not None and self.count(B, K) >= 3:
            return direct
        coef = self._fit(B)
        fitted = float(np.dot(coef, _features(B, K))) if coef is not None else None
        estimates = [t for t in (direct, fitted) if t is not None and t > 0]
        return min(estimates) if estimates else None

    def _median(self, cell: Cell, block: int = 0) -> Optional[float]:
        """The cell's median, leaving out its very first step once there are others:
        one-off costs (first use of a shape, a cache growing as rows join) must not
        decide for good."""
        def median():
            steps = list(self._table(block).get(cell, ()))
            if not steps:
                return None
            return statistics.median(steps[1:] if 1 < len(steps) < self.memory else steps)
        return self._memo(("median", cell, block), median)

    def _fit(self, B: int) -> Optional[np.ndarray]:
        """The fit over head steps within the K policy's range, weighted for B."""
        def fit():
            keys = [(b, k) for b, k, head in self.cells if head == k <= MAX_DRAFT_TOKENS]
            X = np.array([_features(b, k) for b, k in keys])
            if len(keys) < 4 or np.linalg.matrix_rank(X) < 4:
                return None
            count = np.array([self.count(b, k) for b, k in keys])
            near = np.exp(-np.abs(np.log2([b for b, _ in keys]) - np.log2(B)))
            w = np.sqrt(count * near)
            y = np.array([self.measured(b, k) for b, k in keys])
            return np.linalg.lstsq(X * w[:, None], y * w, rcond=None)[0]
        return self._memo(("fit", B), fit)

    # -- any mix of context and head drafts: the draft-source chooser ----------------
    def _verify_cells(self, B: int) -> List[Tuple[int, float]]:
        return self._memo(("verify", B), lambda: sorted(
            (k, self._median(c)) for c in self.cells for k in [c[1]] if c[0] == B and c[2] == 0))

    def verify(self, B: int, k: int) -> Optional[float]:
        """A step of k positions with no head or drafter pass: measured, else interpolated between
        the nearest measured lengths, else the nearest shorter one (optimistic)."""
        known = self._verify_cells(B)
        if not known:
            return None
        i = bisect.bisect_left(known, (k, -math.inf))
        if i < len(known) and known[i][0] == k:
            return known[i][1]
        if i == 0:
            return known[0][1]
        (k0, t0) = known[i - 1]
        if i == len(known):
            return t0
        (k1, t1) = known[i]
        return t0 + (t1 - t0) * (k - k0) / (k1 - k0)

    def head_pass(self, B: int) -> float:
        """Seconds one chained head pass adds to a step (0 until measured: optimistic)."""
        def fit():
            extra = [(self._median(c) - base) / c[2] for c in self.cells
                     if c[0] == B and c[2] for base in [self.verify(B, c[1])]
                     if base is not None]
            return max(statistics.median(extra), 0.0) if extra else 0.0
        return self._memo(("head", B), fit)

    def block_pass(self, B: int) -> float:
        """Seconds one pass of the block drafter adds to a step, beyond the positions it
        verifies and the head passes chained after it (0 until measured: optimistic)."""
        def fit():
            extra = [(self._median(c, 1) - base - c[2] * self.head_pass(B))
                     / self.block_passes.get(c, 1)
                     for c in self.block_cells if c[0] == B
                     for base in [self.verify(B, c[1])] if base is not None]
            return max(statistics.median(extra), 0.0) if extra else 0.0
        return self._memo(("block", B), fit)

    def predict_plan(self, B: int, k: int, head: int, block: int = 0) -> Optional[float]:
        """A step of k drafted positions, ``head`` of them chained by the head, after
        ``block`` passes of the block drafter: the cell's median once it has a few steps,
        else ``verify + head * head_pass + block * block_pass`` or the thin cell,
        whichever is lower (None: unknown)."""
        ran = int(block > 0)
        direct = self._median((B, k, head), ran)
        if direct is not None and len(self._table(ran)[(B, k, head)]) >= 3:
            return direct
        base = self.verify(B, k)
        if base is None:
            return direct
        fitted = base + head * self.head_pass(B) + block * self.block_pass(B)
        return fitted if direct is None else min(direct, fitted)


class BlockSteps:
    """The table as the K policy reads head steps (``predict``, ``count``, ``stale``), for
    the block drafter's widths (``block_policy.BlockPolicy``): "K" is w block drafts
    verified after the drafter's pass (one, or one per draft for an autoregressive
    drafter), K=0 a plain step. A width wider than any block step measured at B is
    unknown (None), as an unmeasured head K is: the verify cost would be read flat from
    shorter ones, so every deeper width would look free; the policy tries it when it could
    pay at a guessed cost."""

    def __init__(self, costs: StepCosts, pass_per_draft: bool = False):
        self.costs, self.pass_per_draft = costs, pass_per_draft

    def predict(self, B: int, K: int) -> Optional[float]:
        if K == 0:
            return self.costs.predict(B, 0)
        if not any(b == B and k >= K and head == 0 for b, k, head in self.costs.block_cells):
            return None
        return self.costs.predict_plan(B, K, 0, K if self.pass_per_draft else 1)

    def count(self, B: int, K: int) -> int:
        return self.costs.count(B, 0) if K == 0 else len(self.costs.block_cells.get((B, K, 0), ()))

    def stale(self, B: int, K: int) -> bool:
        return self.costs.stale(B, 0) if K == 0 else self.costs._stale((B, K, 0), 1)
