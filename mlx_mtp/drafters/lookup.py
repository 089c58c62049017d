"""Drafting from the context (prompt lookup): propose the continuation of the longest
recent match of the sequence's tail in the prompt and the output so far.

``LookupIndex`` keeps, for every n-gram length ``min_match..max_match``, the position
where each n-gram last ended (a dict per length: memory linear in the context, and
``max_match - min_match + 1`` hash updates per appended token, amortised O(1)).
N-grams are keyed by their hash (a collision can only make a poor proposal, never a
wrong output). Before an n-gram's entry is overwritten by the newest token, the previous end is
kept: that is the most recent *earlier* occurrence of the current tail, the match.
The longest matching length wins; among equal lengths the most recent occurrence.
A match longer than ``max_match`` counts as ``max_match``.

The proposal is the tokens that followed the match, up to ``max_draft``; it ends
where the context ends (the head may then extend it, ``decode/step.py``). A proposal is
a deterministic function of tokens already emitted, so as a draft its distribution is
one-hot and verification stays exact (``sampling.verify``): a ``Drafter`` of cost
``NO_PASS`` (``base.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from .base import MAX_DRAFTER_TOKENS, Drafter


@dataclass(frozen=True)
class LookupSettings:
    # Defaults by measurement (docs/lookup.md, benchmarks/lookup_sweep.py): copying runs
    # pay up to 32 deep (the choice takes any prefix); 4 tokens of match start fewer
    # runs that fail, at the same speed.
    min_match: int = 4  # shortest tail that counts as a match
    max_match: int = 8  # longer matches are not told apart
    max_draft: int = 32  # tokens proposed at most

    def __post_init__(self):
        if not (isinstance(self.min_match, int) and 1 <= self.min_match <= self.max_match):
            raise ValueError(f"lookup min_match must be an integer in 1..max_match "
                             f"(got {self.min_match!r}, max_match {self.max_match!r})")
        if not (isinstance(self.max_draft, int) and 1 <= self.max_draft <= MAX_DRAFTER_TOKENS):
            raise ValueError(f"lookup max_draft must be an integer in 1..{MAX_DRAFTER_TOKENS} "
                             f"(got {self.max_draft!r})")


class LookupIndex(Drafter):
    """Prompt + output tokens of one sequence, indexed by the n-grams ending at each position."""

    name = "lookup"

    def __init__(self, settings: LookupSettings = LookupSettings()):
        self.settings = settings
        self.tokens: List[int] = []
        n_lengths = settings.max_match - settings.min_match + 1
        self._last_end: List[Dict[int, int]] = [{} for _ in range(n_lengths)]
        # Per length: where the current tail n-gram ended before (None: first occurrence).
        self._match: List[Optional[int]] = [None] * n_lengths

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_draft(self) -> int:
        return self.settings.max_draft

    def extend(self, tokens: Sequence[int]):
        for t in tokens:
            self._append(int(t))

    def sync(self, prompt: Sequence[int]):
        """Index the tokens of ``prompt`` past those already held (prefill in chunks)."""
        if len(prompt) > len(self.tokens):
            self.extend(prompt[len(self.tokens):])

    def _append(self, t: int):
        toks = self.tokens
        toks.append(t)
        end = len(toks) - 1
        lo = self.settings.min_match
        for i, table in enumerate(self._last_end):
            n = lo + i
            if n > len(toks):
                self._match[i] = None
                continue
            key = hash(tuple(toks[-n:]))  # a collision only makes a poor proposal
            self._match[i] = table.get(key)
            table[key] = end

    def match(self) -> Tuple[int, Optional[int]]:
        """(length, end position) of the longest recent match of the tail; (0, None) if none."""
        for i in range(len(self._match) - 1, -1, -1):
            if self._match[i] is not None:
                return self.settings.min_match + i, self._match[i]
        return 0, None

    def has_proposal(self) -> bool:
        return self.match()[1] is not None

    def propose(self, max_draft: Optional[int] = None) -> List[int]:
        """The tokens that followed the match (at most ``max_draft``; [] without a match)."""
        limit = self.settings.max_draft if max_draft is None else max_draft
        _, end = self.match()
        if end is None:
            return []
        return self.tokens[end + 1 : end + 1 + limit]
