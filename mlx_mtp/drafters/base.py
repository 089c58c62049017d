"""What a draft source is to the step and to the chooser.

A step drafts each row's positions from up to two sources: the row's drafter (a
``Drafter``: its tokens come first) and the checkpoint's MTP head chained after them
(``mtp_head.py``). ``DraftPlan`` is one row's share of a step. The chooser
(``decode/draft_source.py``) prices a plan with the one step-cost table: a position
verified costs ``verify(k)``, a source whose ``cost`` is ``HEAD_PASSES`` adds one
head pass per position it chains through, and one whose ``cost`` is ``BLOCK_PASS`` adds its
drafter's one pass (``costs.StepCosts.block_pass``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, List, Sequence

HEAD = "mtp"  # the MTP head chain's name (``mtp_head.py``): its registry value and estimates
HEAD_PASSES = "head"  # a head pass per drafted position (``costs.StepCosts.head_pass``)
NO_PASS = "none"  # nothing beyond the positions the trunk verifies
BLOCK_PASS = "block"  # one pass of the model's block drafter per step (drafters/block)
# A row drafter's tokens verified per step at most; the head may chain MAX_DRAFT_TOKENS
# after them (models/cache/window.py keeps that many positions to roll back).
MAX_DRAFTER_TOKENS = 32


@dataclass
class DraftPlan:
    """One row's drafts for a step: its drafter's ``fixed`` tokens first, then ``head``
    MTP drafts chained after them; or ``block`` drafts from the model's block drafter."""

    fixed: List[int] = field(default_factory=list)
    head: int = 0
    block: int = 0

    @property
    def total(self) -> int:
        return len(self.fixed) + self.head + self.block


class Drafter:
    """A draft source of one row, beside the head.

    Per step the chooser asks ``propose()`` for the row's next positions; after the
    verify the step tells it what the row emitted (``extend``) and how many of its
    drafts landed (``observe``), so its state stays aligned with the row's tokens.

    Declared per kind (the step and the chooser read these, never the class):
    ``name``: its key in the registry and in acceptance estimates; ``cost``: what its
    drafts add to a step (``NO_PASS``, ``HEAD_PASSES`` or ``BLOCK_PASS``); ``deterministic``: a
    proposal is a function of tokens already emitted, so its ``q`` is one-hot and
    ``sampling.verify`` takes it in index form (a source with a ``q`` of its own, as the
    head, is not); ``needs_taps``: it reads trunk hidden states at layers
    (``model.capabilities.taps``, ``model.trunk_with_taps``); ``max_draft``: tokens
    proposed at most (a shorter proposal means the source ran out: the head may extend
    it).
    """

    name: ClassVar[str]
    cost: ClassVar[str] = NO_PASS
    deterministic: ClassVar[bool] = True
    needs_taps: ClassVar[bool] = False
    max_draft: int

    def sync(self, prompt: Sequence[int]):
        """The prompt's tokens past those already seen (prefill comes in chunks)."""

    def extend(self, tokens: Sequence[int]):
        """Tokens the row emitted (a step's accepted drafts and its next token)."""

    def propose(self) -> List[int]:
        """Up to ``max_draft`` tokens for the row's next positions ([]: none)."""
        raise NotImplementedError

    def has_proposal(self) -> bool:
        return bool(self.propose())

    def observe(self, drafted: int, accepted: int):
        """After the verify: ``accepted`` of its ``drafted`` tokens landed."""
