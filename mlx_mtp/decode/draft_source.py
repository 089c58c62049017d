"""Where each row's drafts come from: the MTP chain, the context (``lookup.py``), or a
context run extended by the head when it ends.

``DraftSources`` is shared by the rows of one decoder or engine: the setting
(``mtp``, ``lookup`` or ``both``), the lookup settings and the acceptance earlier rows
showed. ``RowDrafter`` belongs to one row: its lookup index and its acceptance per
source. Per step, ``RowDrafter.plan`` picks the candidate with the most tokens per
second: expected tokens from the row's measured acceptance at each draft position (per
source), over the measured cost of a step verifying that many positions (the driver's
step-cost table, ``costs.StepCosts.predict_plan``: a step with ``k`` positions to
verify, ``J`` of them chained through the head, costs ``verify(k) + J * head``, both
fitted from steps as they run; a length never measured is tried at an optimistic
guess, which measuring it corrects).

The choice depends only on what earlier steps showed, never on this step's draws, and a
context draft is a deterministic proposal: greedy output is unchanged and sampled output
keeps the target distribution (``sampling.verify``: ``q`` one-hot at the proposal).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from . import MAX_DRAFT_TOKENS, check_draft_source
from .costs import StepCosts
from .lookup import MAX_LOOKUP_DRAFT, LookupIndex, LookupSettings
from .policy import AcceptanceEstimate


@dataclass
class DraftPlan:
    """One row's drafts for a step: context tokens first, then ``head`` MTP drafts."""

    lookup: List[int] = field(default_factory=list)
    head: int = 0

    @property
    def total(self) -> int:
        return len(self.lookup) + self.head


class DraftSources:
    """The draft-source setting of one decoder or engine (step costs: the driver's table)."""

    def __init__(self, source: str = "both", settings: LookupSettings = LookupSettings(),
                 adaptive: bool = True, margin: float = 1.05,
                 probe_gap: Tuple[int, int] = (4, 256)):
        self.source = check_draft_source(source)
        self.settings = settings
        self.adaptive = adaptive
        self.margin = margin  # drafting must beat a plain step clearly
        # Steps between re-tries of a context run the estimates turned down (doubling):
        # a row that starts copying later must be noticed; a useless one costs little.
        self.probe_gap = probe_gap
        # What every row's steps showed, per source: a new row's prior, its own steps
        # then take over (a server's chat requests rarely copy, its edit requests do).
        self.acceptance = _estimates(0.99)

    def for_row(self, default_k: int, k: Optional[int] = None, source: Optional[str] = None,
                has_head: bool = True) -> Tuple[int, Optional["RowDrafter"]]:
        """A row's drafting, chosen here once: its cap on head drafts per step and its
        context drafter (None: none). ``k``: the head drafts the row asks for (None:
        ``default_k``; 0: no drafts from any source); ``source``: the row's (None: this
        setting's)."""
        source = self.source if source is None else check_draft_source(source)
        if k == 0:
            return 0, None
        k = default_k if k is None else k
        return (k if has_head and source != "lookup" else 0), self.drafter(source)

    def drafter(self, source: Optional[str] = None) -> Optional["RowDrafter"]:
        """A row's context drafter (None: the row drafts from the head only)."""
        source = self.source if source is None else check_draft_source(source)
        return None if source == "mtp" else RowDrafter(self, source)


def _estimates(forget: float, prior=None):
    """Acceptance per source: the head's per chain depth, the context's per position."""
    return {"mtp": AcceptanceEstimate(MAX_LOOKUP_DRAFT + MAX_DRAFT_TOKENS, forget, 3.0,
                                      0.7 if prior is None else prior["mtp"].alpha),
            "lookup": AcceptanceEstimate(MAX_LOOKUP_DRAFT, forget, 3.0,
                                         0.7 if prior is None else prior["lookup"].alpha)}


class RowDrafter:
    """One row's lookup index and measured acceptance per source.

    ``acceptance["lookup"]``: per position of a context run. ``acceptance["mtp"]``: the
    head's, per chain depth: a head draft at position j of a step (after j context
    drafts, or j head drafts) is the head's j-th chained pass, whichever source drafted
    the positions before it, so head-only steps and context runs it extends both teach it.
    Both start from what the decoder's earlier rows showed (``DraftSources.acceptance``).
    """

    def __init__(self, sources: DraftSources, source: str):
        self.sources, self.source = sources, source
        self.index = LookupIndex(sources.settings)
        self.acceptance = _estimates(0.97, sources.acceptance)
        self._gap = self._wait = sources.probe_gap[0]

    def has_match(self) -> bool:
        return self.index.match()[1] is not None

    def plan(self, k_head: int, can_head: bool, B: int, costs: StepCosts) -> DraftPlan:
        """Drafts for the next step; ``k_head``: the policy's K for the head (0: paused);
        ``costs``: the driver's step-cost table."""
        mtp = DraftPlan([], k_head if can_head and self.source == "both" else 0)
        proposal = self.index.propose()
        if not proposal:
            return mtp
        ended = len(proposal) < self.sources.settings.max_draft  # the context ran out
        full = DraftPlan(proposal, mtp.head if ended else 0)
        if not self.sources.adaptive:
            return full
        best = self._best(proposal, mtp, full, B, costs)
        if not best.lookup:  # pausing the context needs evidence: its upper estimate
            best = self._best(proposal, mtp, full, B, costs, optimistic=True)
        if best.lookup:
            self._gap = self._wait = self.sources.probe_gap[0]
            return best
        self._wait -= 1
        if self._wait > 0:
            return best
        self._gap = self._wait = min(2 * self._gap, self.sources.probe_gap[1])
        return full  # a probe: measures its acceptance and its cost again

    def _best(self, proposal: List[int], mtp: DraftPlan, full: DraftPlan, B: int,
              costs: StepCosts, optimistic: bool = False) -> DraftPlan:
        """The candidate with the most expected tokens per second: each prefix of the
        context's proposal, the head alone, a plain step, the proposal extended by the
        head. ``optimistic``: the context's acceptance at its upper estimate."""
        lookup, head = self.acceptance["lookup"], self.acceptance["mtp"]
        # Expected tokens of the first n context drafts: 1 + a1 + a1*a2 + ... (once per step).
        expected, reach = [1.0], 1.0
        for a in (lookup.upper if optimistic else lookup.alpha)[:len(proposal)]:
            reach *= a
            expected.append(expected[-1] + reach)
        extension = head.expected_tokens(full.head, start=len(proposal)) - 1
        candidates = [(DraftPlan(proposal[:n]), expected[n]) for n in range(1, len(proposal) + 1)]
        candidates += [(mtp, head.expected_tokens(mtp.head)), (DraftPlan(), 1.0),
                       (full, expected[-1] + reach * extension)]
        return max(candidates, key=lambda c: self._rate(*c, B, costs))[0]

    def _rate(self, plan: DraftPlan, expected: float, B: int, costs: StepCosts) -> float:
        """Expected tokens per second; a plain step's counts ``margin`` times (drafting
        must beat it clearly)."""
        head_passes = plan.total if plan.head else 0
        t = costs.predict_plan(B, plan.total, head_passes)
        t = t if t is not None else 1.0  # nothing measured yet: tokens alone decide
        return expected / t * (1.0 if plan.total else self.sources.margin)

    def record(self, plan: DraftPlan, n_accepted: int) -> Tuple[int, int]:
        """Learn from a step's outcome; returns (context drafts, of them accepted)."""
        n = len(plan.lookup)
        for estimates in (self.acceptance, self.sources.acceptance):
            if n:
                estimates["lookup"].record(n, [n_accepted])
            if plan.head:  # at its chain depths, after the context's drafts if any
                estimates["mtp"].record(plan.head, [n_accepted], starts=[n])
        return n, min(n, n_accepted)
