"""Speculative-decoding counters, named as vLLM names them.

Mean acceptance length counts the bonus/recovered token: ``1 + accepted/drafts``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


@dataclass
class SpecStats:
    """Speculative-decoding counters (vLLM's names)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_per_pos: List[int] = field(default_factory=list)
    accepted_per_pos: List[int] = field(default_factory=list)
    # Of the above, drafts copied from the context (decode/lookup.py); the rest are the head's.
    lookup_drafts: int = 0
    lookup_draft_tokens: int = 0
    lookup_accepted_tokens: int = 0

    def record(self, k: int, n_accepted: int):
        if k == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += n_accepted
        while len(self.drafted_per_pos) < k:
            self.drafted_per_pos.append(0)
            self.accepted_per_pos.append(0)
        for j in range(k):
            self.drafted_per_pos[j] += 1
            self.accepted_per_pos[j] += j < n_accepted

    def merge(self, other: "SpecStats"):
        for j in range(len(other.drafted_per_pos)):
            while len(self.drafted_per_pos) <= j:
                self.drafted_per_pos.append(0)
                self.accepted_per_pos.append(0)
            self.drafted_per_pos[j] += other.drafted_per_pos[j]
            self.accepted_per_pos[j] += other.accepted_per_pos[j]
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.lookup_drafts += other.lookup_drafts
        self.lookup_draft_tokens += other.lookup_draft_tokens
        self.lookup_accepted_tokens += other.lookup_accepted_tokens

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_per_pos(self) -> List[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)]

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "accepted_per_pos": list(self.accepted_per_pos),
            "drafted_per_pos": list(self.drafted_per_pos),
            "acceptance_per_pos": self.acceptance_per_pos,
            "lookup_drafts": self.lookup_drafts,
            "lookup_draft_tokens": self.lookup_draft_tokens,
            "lookup_accepted_tokens": self.lookup_accepted_tokens,
        }
