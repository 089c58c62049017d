"""How many tokens a batch drafts per step: measured acceptance against a step-cost model.

Drafting K tokens for B rows pays when the tokens a row gains per step,
``E_K = 1 + a1 + a1*a2 + ...`` (``a_j``: acceptance at draft position j), outweigh
what the step costs relative to a plain one: ``E_K / t(B, K) > 1 / t(B, 0)``.

Step times are fitted by least squares as ``t(B, K) ~ c0 + c1*B + c2*K + c3*B*K``
over every (B, K) measured so far: drafting is K MTP passes over B rows, verifying
one trunk pass over B*(K+1) positions. The fit carries what was measured at one
batch size over to the others. Where extra rows cost almost nothing (Apple GPUs,
a good CPU BLAS) drafting stays on under load; where they cost linearly (the
reference BLAS of the Linux CPU wheel) it stops at the batch sizes where it
would lose, without probing each of them.

``DraftController`` (speculative.py) does the same job for a single sequence
by timing epochs; this policy serves ``BatchDecoder``, whose batch size changes
at every join and leave.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np


def _features(B: int, K: int):
    return (1.0, float(B), float(K), float(B * K))


class StepCosts:
    """Seconds per batch step by (batch size, K): cell averages plus a pooled linear fit."""

    def __init__(self, memory: int = 8):
        self.memory = memory  # a cell averages its last ~memory steps
        self.cells: Dict[Tuple[int, int], List[float]] = {}  # (B, K) -> [mean, count]
        self._coef: Optional[np.ndarray] = None
        self._dirty = False

    def observe(self, B: int, K: int, seconds: float):
        mean, n = self.cells.get((B, K), (0.0, 0))
        n += 1
        mean += (seconds - mean) / min(n, self.memory)
        self.cells[(B, K)] = [mean, n]
        self._dirty = True

    def measured(self, B: int, K: int, min_count: int = 1) -> Optional[float]:
        cell = self.cells.get((B, K))
        return cell[0] if cell is not None and cell[1] >= min_count else None

    def predict(self, B: int, K: int) -> Optional[float]:
        """The cell's own average when it has a few steps, else the fit (None: unknown)."""
        direct = self.measured(B, K, min_count=3)
        if direct is not None:
            return direct
        coef = self._fit()
        if coef is not None:
            t = float(np.dot(coef, _features(B, K)))
            if t > 0:
                return t
        return self.measured(B, K)

    def _fit(self) -> Optional[np.ndarray]:
        if self._dirty:
            self._dirty = False
            self._coef = None
            keys = list(self.cells)
            X = np.array([_features(B, K) for B, K in keys])
            if len(keys) >= 4 and np.linalg.matrix_rank(X) == 4:
                w = np.sqrt([min(self.cells[k][1], 4 * self.memory) for k in keys])
                y = np.array([self.cells[k][0] for k in keys])
                self._coef = np.linalg.lstsq(X * w[:, None], y * w, rcond=None)[0]
        return self._coef


class DraftPolicy:
    """Chooses K for each batch step (``choose``) from what steps cost and what rows accept."""

    def __init__(self, max_k: int, adaptive: bool = True, margin: float = 1.05,
                 forget: float = 0.9, probe_gap: Tuple[int, int] = (16, 1024)):
        self.max_k = max_k
        self.adaptive = adaptive
        self.margin = margin  # drafting must win clearly: timing noise must not cost users
        self.forget = forget
        self.costs = StepCosts()
        # Acceptance per draft position, a forgetting average over steps with a
        # prior worth one observation at 0.7: optimistic enough to try drafting.
        self.hits = [0.7] * max_k
        self.trials = [1.0] * max_k
        self.probe_gap = probe_gap
        self._gap: Dict[int, int] = {}  # batch size -> steps between acceptance probes
        self._wait: Dict[int, int] = {}

    # -- measurements ------------------------------------------------------------
    def record_step(self, B: int, k: int, seconds: float, accepted: List[int] = ()):
        """One finished step: its batch size, K, wall time and each row's accepted count."""
        self.costs.observe(B, k, seconds)
        for j in range(k):
            reached = sum(1 for n in accepted if n >= j)
            if reached:
                hit = sum(1 for n in accepted if n > j)
                self.hits[j] = self.forget * self.hits[j] + hit
                self.trials[j] = self.forget * self.trials[j] + reached

    @property
    def alpha(self) -> List[float]:
        return [h / t for h, t in zip(self.hits, self.trials)]

    def expected_tokens(self, k: int) -> float:
        total, run = 1.0, 1.0
        for a in self.alpha[:k]:
            run *= a
            total += run
        return total

    def _reach(self, k: int) -> float:
        return float(np.prod(self.alpha[:k]))

    # -- decision ----------------------------------------------------------------
    def choose(self, B: int) -> int:
        if not self.adaptive or self.max_k == 0:
            return self.max_k
        k, _ = self._decide(B)
        if k == 0:
            k = self._maybe_probe(B)
        elif B in self._gap:
            self._gap[B], self._wait[B] = self.probe_gap[0], self.probe_gap[0]
        return k

    def would_draft(self, B: int) -> bool:
        """Whether a batch of B rows drafts now (or explores): no side effects."""
        if not self.adaptive:
            return self.max_k > 0
        return self._decide(B)[0] > 0

    def _decide(self, B: int) -> Tuple[int, bool]:
        """(K, exploring): the best K by predicted tokens per second per row."""
        t0 = self.costs.predict(B, 0)
        if t0 is None:
            return 0, False  # time plain steps at this batch size first
        best, best_rate = 0, self.margin / t0
        for k in range(1, self.max_k + 1):
            t = self.costs.predict(B, k)
            if t is None:
                # Unknown cost: try it for a step if its drafts would mostly land.
                if self._reach(k) >= 0.5:
                    return k, True
                break
            rate = self.expected_tokens(k) / t
            if rate > best_rate:
                best, best_rate = k, rate
        return best, False

    def _maybe_probe(self, B: int) -> int:
        """While paused, re-measure acceptance now and then (at doubling intervals),
        but only where drafting could win at all: perfect acceptance must beat plain."""
        t0 = self.costs.predict(B, 0)
        if t0 is None:
            return 0
        hopeful = [k for k in range(1, self.max_k + 1)
                   if (t := self.costs.predict(B, k)) is not None
                   and (k + 1) / t > self.margin / t0]
        if not hopeful:
            return 0
        gap = self._gap.setdefault(B, self.probe_gap[0])
        wait = self._wait.get(B, gap) - 1
        if wait > 0:
            self._wait[B] = wait
            return 0
        self._gap[B] = min(2 * gap, self.probe_gap[1])
        self._wait[B] = self._gap[B]
        return hopeful[0]
