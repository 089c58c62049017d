"""Speculative-decoding counters, named as vLLM names them, and the figures derived from
them: the one dict form (``to_dict``) and the one text form (``describe``) that the CLI,
the server (responses, the live page, the log line) and the benchmark render.

Mean acceptance length counts the bonus/recovered token: ``1 + accepted/drafts``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional


@dataclass
class SpecStats:
    """Speculative-decoding counters (vLLM's names)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_per_pos: List[int] = field(default_factory=list)
    accepted_per_pos: List[int] = field(default_factory=list)
    # Of the above, drafts copied from the context (drafters/lookup.py); the rest are the head's.
    lookup_drafts: int = 0
    lookup_draft_tokens: int = 0
    lookup_accepted_tokens: int = 0
    # Of the above, drafts of the model's block drafter (drafters/block).
    block_drafts: int = 0
    block_draft_tokens: int = 0
    block_accepted_tokens: int = 0
    # Head drafts rejected where the target's token lay outside the draft vocabulary's
    # subset (models/draft/vocab_auto.py): drafts the subset lost.
    draft_vocab_lost: int = 0

    def record(self, k: int, n_accepted: int, lookup_drafted: int = 0, lookup_accepted: int = 0,
               block_drafted: int = 0, block_accepted: int = 0):
        """One step that drafted ``k`` tokens (``lookup_drafted`` of them copied from the
        context, ``block_drafted`` from the block drafter) of which ``n_accepted`` were
        accepted (``lookup_accepted`` of the copies, ``block_accepted`` of the block's)."""
        if k == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += n_accepted
        self.lookup_drafts += lookup_drafted > 0
        self.lookup_draft_tokens += lookup_drafted
        self.lookup_accepted_tokens += lookup_accepted
        self.block_drafts += block_drafted > 0
        self.block_draft_tokens += block_drafted
        self.block_accepted_tokens += block_accepted
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
        self.block_drafts += other.block_drafts
        self.block_draft_tokens += other.block_draft_tokens
        self.block_accepted_tokens += other.block_accepted_tokens
        self.draft_vocab_lost += other.draft_vocab_lost

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_per_pos(self) -> List[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)]

    @property
    def head_draft_tokens(self) -> int:
        """Drafts of the MTP head: all but the context's and the block drafter's."""
        return self.num_draft_tokens - self.lookup_draft_tokens - self.block_draft_tokens

    @property
    def head_accepted_tokens(self) -> int:
        return self.num_accepted_tokens - self.lookup_accepted_tokens - self.block_accepted_tokens

    def by_source(self) -> Dict[str, Dict[str, int]]:
        """Drafted and accepted tokens of the head (``mtp``), of the context (``lookup``) and,
        once it drafted, of the block drafter (``block``)."""
        sources = {"mtp": {"drafted": self.head_draft_tokens,
                           "accepted": self.head_accepted_tokens},
                   "lookup": {"drafted": self.lookup_draft_tokens,
                              "accepted": self.lookup_accepted_tokens}}
        if self.block_draft_tokens:
            sources["block"] = {"drafted": self.block_draft_tokens,
                                "accepted": self.block_accepted_tokens}
        return sources

    def to_dict(self, missing: Optional[float] = 0.0) -> dict:
        """The counters and the rates derived from them; ``missing``: a rate with nothing
        drafted to measure it."""
        def rate(accepted: int, drafted: int):
            return accepted / drafted if drafted else missing

        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": rate(self.num_accepted_tokens, self.num_draft_tokens),
            "mean_acceptance_length": (self.mean_acceptance_length if self.num_drafts
                                       else missing),
            "accepted_per_pos": list(self.accepted_per_pos),
            "drafted_per_pos": list(self.drafted_per_pos),
            "acceptance_per_pos": self.acceptance_per_pos,
            # Of the drafts, those copied from the context (drafters/lookup.py); the rest are
            # the head's.
            "lookup_drafts": self.lookup_drafts,
            "lookup_draft_tokens": self.lookup_draft_tokens,
            "lookup_accepted_tokens": self.lookup_accepted_tokens,
            "lookup_acceptance_rate": rate(self.lookup_accepted_tokens, self.lookup_draft_tokens),
            "mtp_acceptance_rate": rate(self.head_accepted_tokens, self.head_draft_tokens),
            "block_drafts": self.block_drafts,
            "block_draft_tokens": self.block_draft_tokens,
            "block_accepted_tokens": self.block_accepted_tokens,
            "block_acceptance_rate": rate(self.block_accepted_tokens, self.block_draft_tokens),
            "draft_vocab_lost": self.draft_vocab_lost,
        }

    def describe(self) -> str:
        """One line: acceptance overall, per position and, with context drafts, by source."""
        per_pos = " ".join(f"{a:.2f}" for a in self.acceptance_per_pos)
        line = (f"MTP: accepted {self.num_accepted_tokens}/{self.num_draft_tokens} "
                f"({100 * self.acceptance_rate:.1f}%), mean acceptance length "
                f"{self.mean_acceptance_length:.2f}, per-pos [{per_pos}], drafts {self.num_drafts}")
        if self.lookup_drafts or self.block_drafts:
            line += (f"; by source: context {self.lookup_accepted_tokens}/"
                     f"{self.lookup_draft_tokens}, head {self.head_accepted_tokens}/"
                     f"{self.head_draft_tokens}")
        if self.block_drafts:
            line += f", block {self.block_accepted_tokens}/{self.block_draft_tokens}"
        if self.draft_vocab_lost:
            line += f"; {self.draft_vocab_lost} lost to the draft vocabulary"
        return line
