"""A fair share of the machine between a long prompt and the streams decoding beside it.

The scheduler runs, per iteration, prompt chunks then one decode step for every stream.
A fixed token budget per chunk is not fair: a chunk's cost grows with the prompt's context
(at 8k tokens a 64-token chunk can outlast a decode step many times over), so streams slowed
~10x beside a long prefill. Here the time decides: a chunk lasts about one decode step
(measured; it may be shorter than a 64-token grid cell), and when prompts have run longer
than the decode steps since they started competing, the next iteration decodes only. Each
side keeps at least half of the time, so a stream's inter-token gap stays within about two
steps.
"""

from __future__ import annotations

from typing import Optional


class FairShare:
    """Time split between prompt chunks and decode steps while both have work.

    ``debt``: seconds prompts ran beyond the decode steps' time since they started
    competing; positive, the next iteration decodes only. ``tokens`` sizes a chunk to last
    about one decode step, from the latest per-token prompt cost (it grows with context).
    """

    SMOOTH = 0.5  # weight of the newest measurement

    def __init__(self):
        self.debt = 0.0
        self.step_s: Optional[float] = None  # a decode round
        self.token_s: Optional[float] = None  # one prompt token in a chunk

    def _mix(self, old: Optional[float], new: float) -> float:
        return new if old is None else old + self.SMOOTH * (new - old)

    def prefill_ran(self, seconds: float, tokens: int, competing: bool):
        if tokens:
            self.token_s = self._mix(self.token_s, seconds / tokens)
        if competing:
            self.debt += seconds

    def decode_ran(self, seconds: float, competing: bool):
        self.step_s = self._mix(self.step_s, seconds)
        if competing:  # credit stays bounded: a prompt cannot bank a burst
            self.debt = max(self.debt - seconds, -seconds)
        else:
            self.debt = 0.0

    CELL_ROUNDS = 1.5  # a whole cell may last this many decode rounds (gap <= 2.5 rounds)

    def floor(self, cell: int, least: int) -> int:
        """The smallest chunk: ``least`` where a whole grid cell would stretch a stream's
        gap beyond 2.5 decode rounds (long contexts), else the cell (short contexts:
        splitting a cheap cell only delays the short prompts queued behind it)."""
        if (self.step_s is not None and self.token_s
                and self.token_s * cell > self.CELL_ROUNDS * self.step_s):
            return least
        return cell

    def budget(self, tokens: int, least: int, most: int) -> int:
        """Prompt tokens for this iteration, ``tokens`` at most: none while prompts have
        had more than their half; else about one decode step's worth (up to two while
        prompts are owed time), at least ``least``
        (a chunk's fixed cost makes tinier ones wasteful), at most ``most``."""
        if self.debt > 0:
            return 0
        if self.step_s is not None and self.token_s:
            # One round's worth, plus what prompts are owed (credit is at most one round).
            tokens = min(tokens, int((self.step_s - min(self.debt, 0.0)) / self.token_s))
        return min(most, max(least, tokens))
