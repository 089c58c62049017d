"""The model's block drafter (``drafters/block``) as a row's draft source.

Its drafts are drawn inside the step's graph from one drafter pass over the row's context
(``decode/step.py``), with their own ``q`` (the drafter's softmax under the row's sampling
transforms): nothing is proposed here on the host, and the step verifies them by rejection
sampling against that ``q``.
"""

from __future__ import annotations

from typing import List

from .base import BLOCK_PASS, MAX_DRAFTER_TOKENS, Drafter


class BlockSource(Drafter):
    name = "block"
    cost = BLOCK_PASS  # the chooser prices its pass (decode/costs.py::StepCosts.block_pass)
    deterministic = False
    needs_taps = True

    def __init__(self, settings=None):
        self.max_draft = MAX_DRAFTER_TOKENS  # the drafter's block caps it in the step

    def propose(self) -> List[int]:
        return []
