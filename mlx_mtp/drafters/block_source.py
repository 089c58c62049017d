"""The model's block drafter (``drafters/block``) as a row's draft source.

Its drafts are drawn inside the step's graph from one drafter pass over the row's context
(``decode/step.py``), with their own ``q`` (the drafter's softmax under the row's sampling
transforms): nothing is proposed here on the host, and the step verifies them by rejection
sampling against that ``q``.
"""

from __future__ import annotations

from typing import List

from .base import MAX_DRAFTER_TOKENS, NO_PASS, Drafter


class BlockSource(Drafter):
    name = "block"
    cost = NO_PASS  # its pass is not priced yet: the chooser does not weigh it (issue 36 item 5)
    deterministic = False
    needs_taps = True

    def __init__(self, settings=None):
        self.max_draft = MAX_DRAFTER_TOKENS  # the drafter's block caps it in the step

    def propose(self) -> List[int]:
        return []
