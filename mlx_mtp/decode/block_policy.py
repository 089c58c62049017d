"""How wide one row's block drafter drafts: the K policy (``policy.DraftPolicy``) over its
widths.

The head's policy already prices depth and pauses: K is the width with the most expected
tokens per second (a plain step wins unless drafting beats it by ``margin``), a position
not drafted lately reads as the one above, depth is earned one past the positions that
landed, a source none of whose drafts landed stops after ``first_misses`` drafting steps,
pausing otherwise needs the upper acceptance estimate to fall, and a paused source is
re-checked at doubling intervals priced by the table (sooner after a re-check lands).
``BlockPolicy`` is that policy for the block drafter of one row: the row's own acceptance
per block position, the table's block steps (``costs.BlockSteps``: the drafter's pass plus
the verify of w positions) and what earlier rows left in ``DraftSources`` (the drafter is
the same weights for every row): whether any of its drafts ever landed, and the re-check
interval of the resting rows and the steps left to its next re-check, where a row joining
later takes it up (rows of a few tokens each still re-check it on schedule).

A block drafter none of whose drafts ever landed is first re-checked after
``RECHECKS[1]`` steps, then at the budgeted interval: after its first misses it runs at
most two passes per 128 tokens.
"""

from __future__ import annotations

from .costs import BlockSteps, StepCosts
from .policy import AcceptanceEstimate, ContextAcceptance, DraftPolicy

# Re-check intervals (first, shortest and longest cap; DraftPolicy's ``recheck_gap``): the
# head's first, a longer shortest cap (a block re-check costs a pass and a wider verify).
RECHECKS = (4, 64, 512)


class BlockPolicy(DraftPolicy):
    """The K policy choosing one row's block width (``width``) and learning from its block
    steps (``record``). ``acceptance``: the row's estimate per block position."""

    def __init__(self, sources, acceptance: AcceptanceEstimate, pass_per_draft: bool = False):
        super().__init__(margin=sources.margin, forget=acceptance.forget, recheck_gap=RECHECKS)
        self.acceptance = acceptance
        self.by_context = ContextAcceptance(acceptance, acceptance.weight[0])
        self.sources, self.pass_per_draft = sources, pass_per_draft
        self.rows, self.depth = 1, 1  # the last ``width``'s batch size and widths considered
        self.first_misses = sources.first_misses
        self._join()
        # a row joining resting rows rests until its first re-check
        self.resting = bool(sources.block_rest) or sources.block_dry()
        if sources.block_rest:
            self._gaps[None] = sources.block_rest

    def _join(self):
        """The evidence every row shares: whether any block draft ever landed."""
        dry = self.sources.block_dry_steps
        self._landed_once |= dry is None
        self._dry_steps = max(self._dry_steps, dry or 0)

    def width(self, B: int, cap: int, costs: StepCosts) -> int:
        """Block drafts for the row's next step (0: none), up to ``cap``; ``costs``: the
        driver's table."""
        self.costs, self.rows = BlockSteps(costs, self.pass_per_draft), B
        self._join()
        # no width past the one it earned is tried, not even to time it
        self.depth = min(cap, self.acceptance.landed_depth() + 1)
        w = self.choose(B, self.depth)
        # waiting for a timed plain step is not resting: the next step may draft
        self.resting = not self._drafting and self.costs.predict(B, 0) is not None
        self.sources.block_rest = self._gaps.get(None) if self.resting else None
        return w

    def may_draft(self) -> bool:
        """Whether the next ``width`` may draft (no side effects): not resting, a re-check
        due, or the estimates turned (the plain steps timed since moved the balance). Exact
        while nothing is recorded in between: the driver launches a plain step ahead on it."""
        return (not self.resting or self._gaps.get(None, (2, 2))[1] <= 1
                or self.would_draft(self.rows, self.depth))

    def record(self, drafted: int, accepted: int):
        """One block step of the row: ``drafted`` block positions, ``accepted`` landed."""
        self.record_step(self.rows, drafted, None, [accepted])
        self.sources.block_landed(drafted, min(drafted, accepted))

    def _due(self, key, longest=None, first=None) -> bool:
        """As the head's, but while the drafter rests only its re-checks (``key`` None) draft:
        its plain steps time themselves, and a width probed for its cost would be a re-check
        outside their budget (a row joining resting rows would draft within 8 steps)."""
        return (key is None or self._drafting) and super()._due(key, longest, first)

    def _recheck_gaps(self, B: int, k: int = 1):
        """As the head's, but a drafter none of whose drafts ever landed (on any row) is
        first re-checked after the shortest cap (``RECHECKS[1]``) rather than soon."""
        first, longest = super()._recheck_gaps(B, k)
        return (first if self._landed_once else min(longest, self.recheck_gap[1])), longest
