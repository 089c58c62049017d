"""Where each row's drafts come from: the MTP chain, the row's drafter (context lookup or
the model's block drafter, ``drafters/``), or the drafter's run extended by the head when
it ends.

``DraftSources`` is shared by the rows of one decoder or engine: the setting (a value of
the drafters' registry, ``drafters/registry.py``: ``mtp``, ``lookup``, ``both``, ``block``,
``block+mtp``), the drafter settings and the acceptance earlier rows showed. ``RowDrafter``
belongs to one row: its drafter (``drafters/base.py::Drafter``) and its acceptance per
source. Per step, ``RowDrafter.plan`` picks the candidate with the most tokens per second:
expected tokens from the row's measured acceptance at each draft position (per source),
over the measured cost of a step verifying that many positions (the driver's step-cost
table, ``costs.StepCosts.predict_plan``: a step with ``k`` positions to verify, ``J`` of
them chained through the head, costs ``verify(k) + J * head``, plus ``block_pass`` when the
block drafter runs, all fitted from steps as they run; a length never measured is tried at
an optimistic guess, which measuring it corrects). A drafter the estimates turn down is
paused and re-tried now and then (``probe_gap``). The block drafter's width is the K
policy's over its own acceptance and the table's block steps (``block_policy.BlockPolicy``):
it waits for a timed plain step, earns its depth, pauses and is re-checked as the head is
(``RowDrafter._plan_block``).

The choice depends only on what earlier steps showed, never on this step's draws: greedy
output is unchanged, and sampled output keeps the target distribution (``sampling.verify``:
a lookup proposal's ``q`` is one-hot, a block draft's is the drafter's own).
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

from ..drafters.base import (BLOCK_PASS, HEAD, HEAD_PASSES, MAX_DRAFTER_TOKENS, Drafter,
                             DraftPlan)
from ..drafters.lookup import LookupSettings
from ..drafters.registry import SOURCES
from . import MAX_DRAFT_TOKENS, check_draft_source
from .block_policy import BlockPolicy
from .costs import StepCosts
from .policy import AcceptanceEstimate


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
        self.acceptance = {}  # per source name, filled by ``shared``
        # The block drafter is the same weights for every row: a new row takes up the
        # resting rows' re-checks (interval, steps to the next; None: none rests), and one
        # none of whose drafts ever landed drafts ``first_misses`` steps in all, then only
        # re-checks (as the head; ``block_policy.BlockPolicy``).
        self.block_rest: Optional[Tuple[int, int]] = None
        self.first_misses, self.block_dry_steps = 3, 0  # None once a block draft landed

    def for_row(self, default_k: int, k: Optional[int] = None, source: Optional[str] = None,
                has_head: bool = True) -> Tuple[int, Optional["RowDrafter"]]:
        """A row's drafting, chosen here once: its cap on head drafts per step and its
        drafter (None: none). ``k``: the head drafts the row asks for (None:
        ``default_k``; 0: no drafts from any source); ``source``: the row's (None: this
        setting's)."""
        source = self.source if source is None else check_draft_source(source)
        if k == 0:
            return 0, None
        k = default_k if k is None else k
        entry = SOURCES[source]  # a block drafter drafts without the head
        uses_k = entry.capped_by_k and (has_head or entry.drafter is not None
                                        and entry.drafter.needs_taps)
        return (k if uses_k else 0), self.drafter(source)

    def drafter(self, source: Optional[str] = None) -> Optional["RowDrafter"]:
        """A row's drafter beside the head (None: the row drafts from the head only)."""
        source = self.source if source is None else check_draft_source(source)
        return None if SOURCES[source].drafter is None else RowDrafter(self, source)

    def block_landed(self, drafted: int, accepted: int):
        """A row's block drafts of a step: the drafter's first-misses count."""
        if self.block_dry_steps is not None and drafted:
            self.block_dry_steps = None if accepted else self.block_dry_steps + 1

    def block_dry(self) -> bool:
        """The block drafter drafted ``first_misses`` steps and none of it ever landed."""
        return self.block_dry_steps is not None and self.block_dry_steps >= self.first_misses

    def shared(self, name: str, positions: int) -> AcceptanceEstimate:
        """Source ``name``'s acceptance over every row's steps (made on first use)."""
        if name not in self.acceptance:
            self.acceptance[name] = AcceptanceEstimate(positions, 0.99, 3.0, 0.7)
        return self.acceptance[name]


class RowDrafter:
    """One row's drafter (``drafters/base.py::Drafter``) and measured acceptance per source.

    ``acceptance[drafter.name]``: per position of the drafter's run. ``acceptance["mtp"]``:
    the head's, per chain depth: a head draft at position j of a step (after j drafter
    tokens, or j head drafts) is the head's j-th chained pass, whichever source drafted
    the positions before it, so head-only steps and runs it extends both teach it. Both
    start from what the decoder's earlier rows showed (``DraftSources.acceptance``).
    """

    def __init__(self, sources: DraftSources, source: str):
        self.sources, self.source = sources, source
        entry = SOURCES[source]
        self.drafter: Drafter = entry.drafter(sources.settings)
        if self.drafter.deterministic == self.drafter.needs_taps:
            raise ValueError(f"draft source {source!r}: the step takes a row drafter's tokens "
                             "as deterministic proposals and feeds it no trunk taps, or draws "
                             "the model's block drafter's (drafters/block_source.py)")
        self.uses_head = entry.head
        self.blocks = self.drafter.needs_taps  # the model's block drafter, drawn in the step
        self.block_width = MAX_DRAFTER_TOKENS  # its drafts per pass (``fit_block``)
        self.pass_per_draft = False  # an autoregressive drafter (EAGLE-3): one pass per draft
        # The head may chain after a drafter's run: its depths reach past the run's.
        sizes = {HEAD: MAX_DRAFTER_TOKENS + MAX_DRAFT_TOKENS, self.drafter.name: MAX_DRAFTER_TOKENS}
        self.acceptance = {name: AcceptanceEstimate(n, 0.97, 3.0, sources.shared(name, n).alpha)
                           for name, n in sizes.items()}
        self._gap = self._wait = sources.probe_gap[0]
        # the block drafter's width: the K policy over its acceptance (None: no block drafter)
        self.pacing = (BlockPolicy(sources, self.acceptance[self.drafter.name])
                       if self.blocks else None)

    @property
    def plans_alike(self) -> bool:
        """Its plan is a function of K alone, the same on every rank of a split model: the
        block drafter at a fixed K (its tokens are drawn in the step, rank 0's shared)."""
        return self.blocks and not self.sources.adaptive

    def sync(self, prompt):
        self.drafter.sync(prompt)

    def extend(self, tokens):
        self.drafter.extend(tokens)

    def has_proposal(self) -> bool:
        """Whether the next step may draft from the drafter (else a plain step may be
        launched ahead): the block drafter's unless it rests with no probe due."""
        if self.blocks:
            return self.pacing.may_draft()
        return self.drafter.has_proposal()

    def fit_block(self, width: int, pass_per_draft: bool = False):
        """The model's block drafter proposes ``width`` drafts per step at most, in one pass
        or (``pass_per_draft``) one pass each."""
        self.block_width, self.pass_per_draft = width, pass_per_draft
        self.pacing.pass_per_draft = pass_per_draft

    def plan(self, k_head: int, can_head: bool, B: int, costs: StepCosts,
             cap: int = 0) -> DraftPlan:
        """Drafts for the next step; ``k_head``: the policy's K for the head (0: paused);
        ``costs``: the driver's step-cost table; ``cap``: the row's own K, up to which a
        block drafter drafts whether or not the head is paused."""
        if self.blocks:  # the block drafter: drawn in the step
            return self._plan_block(k_head, can_head, cap, B, costs)
        mtp = DraftPlan([], k_head if can_head and self.uses_head else 0)
        proposal = self.drafter.propose()[:MAX_DRAFTER_TOKENS]
        if not proposal:
            return mtp
        ended = len(proposal) < self.drafter.max_draft  # the drafter ran out
        full = DraftPlan(proposal, mtp.head if ended else 0)
        if not self.sources.adaptive:
            return full
        best = self._best(proposal, mtp, full, B, costs)
        if not best.fixed:  # pausing the drafter needs evidence: its upper estimate
            best = self._best(proposal, mtp, full, B, costs, optimistic=True)
        return self._paced(best, bool(best.fixed), full)

    def _paced(self, best: DraftPlan, drafts: bool, full: DraftPlan) -> DraftPlan:
        """``best``, or now and then (every ``probe_gap`` steps, doubling) ``full`` while
        the estimates keep the drafter paused (``drafts`` False)."""
        first, longest = self.sources.probe_gap
        if drafts:
            self._gap = self._wait = first
            return best
        self._wait -= 1
        if self._wait > 0:
            return best
        self._gap = self._wait = min(2 * self._gap, longest)
        return full  # a probe: measures its acceptance and its cost again

    def _plan_block(self, k_head: int, can_draft: bool, cap: int, B: int,
                    costs: StepCosts) -> DraftPlan:
        """The block drafter's row: ``DraftPlan(block=n)`` drafts n positions, those past
        the drafter's block chained by the head (``block+mtp``, ``block_context.fit_plans``).
        The width is the K policy's over the block's own acceptance and the table's block
        steps (``self.pacing``: 0 while it does not pay, a width now and then to re-check
        it); ``block+mtp`` then takes the head alone at the K policy's ``k_head`` instead
        where that pays better, and follows it while the block rests. A paused row runs
        no drafter pass; its taps wait for the next one (``block_context.trunk``)."""
        if not can_draft or not cap:
            return DraftPlan()
        if not self.sources.adaptive:
            return DraftPlan(block=k_head)
        head = DraftPlan([], k_head) if self.uses_head and k_head else DraftPlan()
        full = min(cap, self.block_width)
        width = self.pacing.width(B, full, costs)
        if not width:
            return head
        if not self.uses_head or self.pacing.resting:  # ``block``, or a re-check
            return DraftPlan(block=width)
        return self._best_block(k_head, cap, width, full, B, costs)

    def _best_block(self, k_head: int, cap: int, width: int, full: int, B: int,
                    costs: StepCosts) -> DraftPlan:
        """``block+mtp``: the most expected tokens per second of the block's ``width``
        drafts (the policy's width), the whole block (``full`` drafts, reached) extended by
        the head to ``cap``, and the head alone at the K policy's ``k_head`` (which beats a
        plain step, by that policy's estimates) or else a plain step. Positions not drafted
        lately read as the one above (``AcceptanceEstimate.extrapolated``)."""
        run, head = self.acceptance[self.drafter.name], self.acceptance[HEAD]
        expected = run.expected_tokens(width, extrapolate=True)
        candidates = [(DraftPlan(block=width), expected, 0)]
        if width == full and cap > full:  # fed every block token: cap passes
            reach = math.prod(run.extrapolated[:width])
            extension = head.expected_tokens(cap - width, start=width) - 1
            candidates.append((DraftPlan(block=cap), expected + reach * extension, cap))
        if k_head:  # the K policy's choice: the head beats a plain step
            candidates.append((DraftPlan([], k_head), head.expected_tokens(k_head), k_head))
        else:
            candidates.append((DraftPlan(), 1.0, 0))
        return max(candidates, key=lambda c: self._rate(c[0], c[1], B, costs, c[2]))[0]

    def _best(self, proposal: List[int], mtp: DraftPlan, full: DraftPlan, B: int,
              costs: StepCosts, optimistic: bool = False) -> DraftPlan:
        """The candidate with the most expected tokens per second: each prefix of the
        drafter's proposal, the head alone, a plain step, the proposal extended by the
        head. ``optimistic``: the drafter's acceptance at its upper estimate."""
        run, head = self.acceptance[self.drafter.name], self.acceptance[HEAD]
        # Expected tokens of the first n drafter tokens: 1 + a1 + a1*a2 + ... (once per step).
        expected, reach = [1.0], 1.0
        for a in (run.upper if optimistic else run.alpha)[:len(proposal)]:
            reach *= a
            expected.append(expected[-1] + reach)
        extension = head.expected_tokens(full.head, start=len(proposal)) - 1
        candidates = [(DraftPlan(proposal[:n]), expected[n]) for n in range(1, len(proposal) + 1)]
        candidates += [(mtp, head.expected_tokens(mtp.head)), (DraftPlan(), 1.0),
                       (full, expected[-1] + reach * extension)]
        return max(candidates, key=lambda c: self._rate(*c, B, costs))[0]

    def _rate(self, plan: DraftPlan, expected: float, B: int, costs: StepCosts,
              head_passes: Optional[int] = None) -> float:
        """Expected tokens per second; a plain step's counts ``margin`` times (drafting
        must beat it clearly). ``head_passes``: the plan's (None: ``_head_passes``)."""
        head = self._head_passes(plan) if head_passes is None else head_passes
        block = int(bool(plan.block) and self.drafter.cost == BLOCK_PASS)
        if block and self.pass_per_draft:
            block = min(plan.block, self.block_width)
        t = costs.predict_plan(B, plan.total, head, block)
        t = t if t is not None else 1.0  # nothing measured yet: tokens alone decide
        return expected / t * (1.0 if plan.total else self.sources.margin)

    def _head_passes(self, plan: DraftPlan) -> int:
        """Head passes the plan's step chains: through every position once the head
        drafts (it is fed the drafter's tokens), or the drafter's own if it costs so."""
        if plan.head:
            return plan.total
        return len(plan.fixed) if self.drafter.cost == HEAD_PASSES else 0

    def record(self, plan: DraftPlan, n_accepted: int) -> Tuple[int, int]:
        """Learn from a step's outcome; returns (drafter tokens, of them accepted)."""
        n, name = len(plan.fixed) or plan.block, self.drafter.name
        if n:  # the row's own estimate (through the block's policy), then every row's
            if plan.block:
                self.pacing.record(n, n_accepted)
            else:
                self.acceptance[name].record(n, [n_accepted])
            self.sources.acceptance[name].record(n, [n_accepted])
            self.drafter.observe(n, min(n, n_accepted))
        for estimates in (self.acceptance, self.sources.acceptance):
            if plan.head:  # at its chain depths, after the drafter's tokens if any
                estimates[HEAD].record(plan.head, [n_accepted], starts=[n])
        return n, min(n, n_accepted)
