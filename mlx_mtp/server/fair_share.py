"""A fair share of the machine between a long prompt and the streams decoding beside it.

The scheduler runs, per iteration, prompt chunks then one decode step for every stream.
A fixed token budget per chunk is not fair: a chunk's cost grows with the prompt's context
(at 8k tokens a 64-token chunk can outlast a decode step many times over), so streams slowed
~10x beside a long prefill. Here the time decides, as a running account: each iteration the
prompt may run about one decode step's time plus what it is owed (minus what it overran),
and the account is kept within one step either way, so neither side banks a burst; credit is
spent at most half a step per iteration. Over a prefill the prompt and the streams each get
about half of the time, and a stream's inter-token gap stays within about 2.5 steps.
"""

from __future__ import annotations

from typing import Optional


class FairShare:
    """Time split between prompt chunks and decode steps while both have work.

    ``debt``: seconds prompts ran beyond the decode steps' time since they started
    competing, kept within one decode step either way (negative: the prompt is owed time).
    ``budget`` sizes this iteration's chunk from ``step_s - debt`` and the latest per-token
    prompt cost (it grows with context). ``prompt_s`` / ``decode_s``: the competing seconds
    each side ran, the record the time share is read from.
    """

    SMOOTH = 0.5  # weight of the newest measurement
    FLOOR = 8  # tokens: fixed cost per call (4-token calls ran at 69 % of 512-token ones)
    BANK = 1.0  # decode steps the account may hold either way
    SPEND = 1.5  # decode steps a prompt may run in one iteration (a stream's gap: 2.5)

    def __init__(self):
        self.debt = 0.0
        self.step_s: Optional[float] = None  # a decode round
        self.token_s: Optional[float] = None  # one prompt token in a chunk
        self.prompt_s = 0.0
        self.decode_s = 0.0

    def _mix(self, old: Optional[float], new: float) -> float:
        return new if old is None else old + self.SMOOTH * (new - old)

    def prefill_ran(self, seconds: float, tokens: int, competing: bool):
        # A chunk under the floor (a segment's remainder) is mostly fixed cost: its
        # per-token time would shrink the next chunks for nothing.
        if tokens >= self.FLOOR or (tokens and self.token_s is None):
            self.token_s = self._mix(self.token_s, seconds / tokens)
        if competing:
            self.debt += seconds
            self.prompt_s += seconds

    def decode_ran(self, seconds: float, competing: bool):
        self.step_s = self._mix(self.step_s, seconds)
        if competing:
            self.decode_s += seconds
            bound = self.BANK * self.step_s
            self.debt = min(max(self.debt - seconds, -bound), bound)
        else:
            self.debt = 0.0

    CELL_ROUNDS = 1.5  # a whole grid cell may last this many decode rounds

    def floor(self, cell: int, least: int) -> int:
        """The smallest chunk: ``least`` where a whole grid cell would outlast
        ``CELL_ROUNDS`` decode rounds (long contexts), else the cell (short contexts:
        splitting a cheap cell only delays the short prompts queued behind it)."""
        if (self.step_s is not None and self.token_s
                and self.token_s * cell > self.CELL_ROUNDS * self.step_s):
            return least
        return cell

    def share(self) -> float:
        """The prompts' part of the competing time so far (0.5: an even split)."""
        total = self.prompt_s + self.decode_s
        return self.prompt_s / total if total else 0.0

    def budget(self, tokens: int, least: int, most: int) -> int:
        """Prompt tokens for this iteration, ``tokens`` at most: about one decode step's
        worth plus the time owed (up to ``SPEND`` steps; none when the prompt is a step ahead), a multiple of
        ``least`` (few distinct chunk shapes) and at least ``least`` when half of such a
        chunk fits in the time (so on average the prompt keeps its half), at most ``most``."""
        if self.step_s is None or not self.token_s:
            return min(most, max(least, tokens))
        fits = min(self.step_s - self.debt, self.SPEND * self.step_s) / self.token_s
        if fits < least / 2:
            return 0
        n = min(tokens, int(fits))
        return min(most, max(least, n - n % least))
