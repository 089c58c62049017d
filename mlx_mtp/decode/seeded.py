"""K for seeded requests: a schedule per row that depends on nothing but the row.

Greedy rows and coupled rows (``SamplingParams.coupled``)
emit the target's own per-position choice whatever was drafted, so K is free for
them. A seeded row sampled with independent drafts emits tokens that depend on
*which* positions were drafted; its K therefore comes from a ``SeededSchedule``:
its own acceptance and a fixed cost model, never timings or batch mates. The
batch drafts the largest K any row asks for; a row asking for fewer stops at its
own (``step.py``), so every row's output is what it would be alone.
"""

from __future__ import annotations

from typing import Tuple

from . import MAX_DRAFT_TOKENS
from .policy import AcceptanceEstimate


def needs_schedule(params) -> bool:
    """The rule for seeded requests (this module's docstring): a seeded row sampled with
    independent drafts takes its K from its own ``SeededSchedule``."""
    return params.seed is not None and not params.greedy and not params.coupled


class SeededSchedule:
    """K per step for one seeded row, from its own acceptance and a fixed cost model.

    The modelled rate of K is ``E_K / (1 + draft_cost * K)`` (a step that drafts K
    costs ``1 + draft_cost * K`` plain steps). When plain decoding wins, K=1 is
    re-tried after a pause that doubles each time, so a useless head costs little.
    Deterministic: the same request takes the same K at every step.
    """

    def __init__(self, adaptive: bool = True, draft_cost: float = 0.35,
                 margin: float = 1.05, probe_gap: Tuple[int, int] = (4, 256)):
        self.adaptive = adaptive
        self.draft_cost, self.margin = draft_cost, margin
        self.acceptance = AcceptanceEstimate(MAX_DRAFT_TOKENS, forget=0.9)
        self.probe_gap = probe_gap
        self._gap = self._wait = probe_gap[0]

    def next_k(self, max_k: int) -> int:
        """K for the row's next step, up to its cap ``max_k``."""
        if not self.adaptive:
            return max_k
        rates = [self.acceptance.expected_tokens(k) / (1 + self.draft_cost * k)
                 for k in range(max_k + 1)]
        best = max(range(max_k + 1), key=lambda k: rates[k])
        if best and rates[best] >= self.margin:
            self._gap = self._wait = self.probe_gap[0]
            return best
        self._wait -= 1
        if self._wait > 0:
            return 0
        self._gap = min(2 * self._gap, self.probe_gap[1])
        self._wait = self._gap
        return 1

    def record(self, k: int, n_accepted: int):
        self.acceptance.record(k, [n_accepted])
