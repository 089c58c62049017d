"""A fair share of the machine between a long prompt and the streams decoding beside it.

The scheduler runs, per iteration, prompt chunks then one decode step for every stream.
A fixed token budget per chunk is not fair: a chunk's cost grows with the prompt's context
(at 8k tokens a 64-token chunk can outlast a decode step many times over), so streams slowed
~10x beside a long prefill. Here the time decides, as a running account: each iteration the
prompt may run about one decode step's time plus what it is owed (minus what it overran),
and the account is kept within one step either way, so neither side banks a burst; credit is
spent at most half a step per iteration. Over a prefill the prompt and the streams each get
about half of the time, and a stream's inter-token gap stays within about 2.5 steps.

Several prompts share that one account: an iteration's time goes to them in turn, the prompt
with the least prefill time first (a newcomer starts level with the least of those waiting,
as Linux's CFS starts a task at ``min_vruntime``; on a tie the fewer remaining tokens first),
so two long prompts split the prompts' half evenly, both advance, and a short prompt arriving
runs at once. Each prompt's chunk is sized by its own per-token cost, which grows with its
context (here ~14 ms a token at 30k, ~9 at 8k, less at a prompt's start).

Chunks are sized by a typical decode round (``typical_s``), so one long round does not
lengthen the chunks after it; the round right after a prompt's row joins the batch is
partly that prompt's (its merge, every row attending over its width), and what it runs over
a typical round counts as the prompts' time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, Hashable, List, Optional


@dataclass
class PromptAccount:
    """One prompt in prefill: its prefill seconds so far (the order of turns), its latest
    per-token cost (it grows with the prompt's context) and the tokens it has left."""

    served_s: float = 0.0
    token_s: Optional[float] = None
    left: int = 0


class FairShare:
    """Time split between prompt chunks and decode steps while both have work, and the
    prompts' part between the prompts.

    ``debt``: seconds prompts ran beyond the decode steps' time since they started
    competing, kept within one decode step either way (negative: the prompts are owed time).
    ``budget`` sizes a prompt's next chunk from ``step_s - debt`` (less what prompts ran
    since the last decode step) and that prompt's latest per-token cost. ``prompt_s`` /
    ``decode_s``: the competing seconds each side ran, the record the time share is read
    from. ``prompts``: the prompts in prefill, by the caller's key (``order`` keeps it).
    """

    SMOOTH = 0.5  # weight of the newest measurement
    FLOOR = 8  # tokens: fixed cost per call (4-token calls ran at 69 % of 512-token ones)
    BANK = 1.0  # decode steps the account may hold either way
    SPEND = 1.5  # decode steps prompts may run in one iteration (a stream's gap: 2.5)
    RECENT = 8  # decode rounds the typical one is taken from

    def __init__(self):
        self.debt = 0.0
        self.step_s: Optional[float] = None  # a decode round, smoothed: the account's unit
        self.recent: Deque[float] = deque(maxlen=self.RECENT)  # the last rounds' times
        self.token_s: Optional[float] = None  # one prompt token, any prompt's latest
        self.round_s = 0.0  # prompt seconds since the last decode step
        self.idle_s = 0.0  # decode seconds since prompts last ran beside them
        self.prompt_s = 0.0
        self.decode_s = 0.0
        self.prompts: Dict[Hashable, PromptAccount] = {}
        self.joined = False  # a prompt finished beside the streams: its row joins the batch

    def _mix(self, old: Optional[float], new: float) -> float:
        return new if old is None else old + self.SMOOTH * (new - old)

    def _token_s(self, prompt: Optional[Hashable]) -> Optional[float]:
        """A prompt's per-token cost: its own once measured, else any prompt's latest."""
        own = self.prompts.get(prompt)
        return own.token_s if own is not None and own.token_s else self.token_s

    def order(self, remaining: Dict[Hashable, int]) -> List[Hashable]:
        """The prompts in prefill (key -> tokens left) in the order they run: least prefill
        time first, then fewer tokens left. A newcomer starts level with the least served,
        so it neither waits for the others' past time nor takes it back; prompts no longer
        listed are forgotten."""
        known = [self.prompts[k].served_s for k in remaining if k in self.prompts]
        start = min(known, default=0.0)
        self.prompts = {k: self.prompts.get(k) or PromptAccount(start) for k in remaining}
        for k, n in remaining.items():
            self.prompts[k].left = n
        return sorted(remaining, key=lambda k: (self.prompts[k].served_s, remaining[k]))

    def prefill_ran(self, seconds: float, tokens: int, competing: bool,
                    prompt: Optional[Hashable] = None):
        own = self.prompts.get(prompt)
        # A chunk under the floor (a segment's remainder) is mostly fixed cost: its
        # per-token time would shrink the next chunks for nothing.
        if tokens >= self.FLOOR or (tokens and self.token_s is None):
            self.token_s = self._mix(self.token_s, seconds / tokens)
            if own is not None:
                own.token_s = self._mix(own.token_s, seconds / tokens)
        if own is not None:
            own.served_s += seconds
            own.left -= tokens
            self.joined = self.joined or (competing and own.left <= 0)
        if competing:
            self.debt += seconds
            self.round_s += seconds
            self.idle_s = 0.0
            self.prompt_s += seconds

    def typical_s(self) -> float:
        """A decode round's typical time: the mean of the last few but the longest, so one
        long round (a long row joining, a pause) does not lengthen the chunks after it as
        the smoothed ``step_s`` does (one 0.64 s join among 0.2 s steps had the next chunk
        run 0.64 s), while rounds often long (drafting ones) still count."""
        n = len(self.recent)
        return (sum(self.recent) - max(self.recent)) / (n - 1) if n > 1 else self.recent[0]

    def decode_ran(self, seconds: float, competing: bool):
        # The first round of a row that just joined is partly that prompt's: the merge, and
        # every row attending over its width (0.64 s among 0.2 s steps for an 8k row). What
        # it ran over a typical round is the prompts', so they wait instead of being owed.
        joining = max(0.0, seconds - self.typical_s()) if self.joined and self.recent else 0.0
        self.joined = False
        self.step_s = self._mix(self.step_s, seconds)
        self.recent.append(seconds)
        self.round_s = 0.0
        self.idle_s = self.idle_s + seconds if competing else 0.0
        if competing:
            self.decode_s += seconds - joining
            self.prompt_s += joining
            bound = self.BANK * self.step_s
            self.debt = min(max(self.debt + joining - (seconds - joining), -bound), bound)
        else:
            self.debt = 0.0

    CELL_ROUNDS = 1.5  # a whole grid cell may last this many decode rounds

    def floor(self, cell: int, least: int, prompt: Optional[Hashable] = None) -> int:
        """The smallest chunk of ``prompt``: ``least`` where a whole grid cell would
        outlast ``CELL_ROUNDS`` decode rounds (long contexts), else the cell (short
        contexts: splitting a cheap cell only delays the short prompts queued behind it)."""
        token_s = self._token_s(prompt)
        if self.recent and token_s and token_s * cell > self.CELL_ROUNDS * self.typical_s():
            return least
        return cell

    def share(self) -> float:
        """The prompts' part of the competing time so far (0.5: an even split)."""
        total = self.prompt_s + self.decode_s
        return self.prompt_s / total if total else 0.0

    def budget(self, tokens: int, least: int, most: int,
               prompt: Optional[Hashable] = None) -> int:
        """Tokens for the next chunk of ``prompt``, ``tokens`` at most: about one decode
        step's worth plus the time owed, less what prompts ran since the last step (up to
        ``SPEND`` steps an iteration; none when the prompts are a step ahead), a multiple of
        ``least`` (few distinct chunk shapes) and at least ``least`` when half of such a
        chunk fits in the time (so on average the prompts keep their half), at most
        ``most``. A chunk of ``least`` that never fits (half of it outlasts ``SPEND`` steps)
        runs once the streams have had as long since the prompts last ran: the prompt
        finishes and each side keeps half."""
        token_s = self._token_s(prompt)
        if self.step_s is None or not token_s:
            return min(most, max(least, tokens))
        spend = self.SPEND * self.typical_s()  # what bounds a stream's gap
        seconds = min(self.step_s - self.debt, spend - self.round_s)
        fits = seconds / token_s
        if fits < least / 2:
            chunk_s = least * token_s
            never = chunk_s / 2 > spend  # no credit makes it fit
            return least if never and self.round_s == 0.0 and self.idle_s >= chunk_s else 0
        n = min(tokens, int(fits))
        return min(most, max(least, n - n % least))
