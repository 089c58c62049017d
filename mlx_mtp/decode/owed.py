"""The MTP pairs a row owes its head: committed trunk hiddens and tokens the MTP cache
has not seen yet (``step.py`` writes them at the head's next pass)."""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx

MAX_OWED_WHILE_PAUSED = 4


class OwedPairs:
    """MTP pairs ``(hidden at i, token i+1)`` committed but not yet in the MTP cache.

    The newest pair always stays owed between steps: the next draft starts from its
    output.
    """

    def __init__(self, hidden: Optional[list] = None, tokens: Optional[list] = None):
        self.hidden: List[mx.array] = list(hidden or [])  # (1, S, H) chunks
        self.tokens: List[mx.array] = list(tokens or [])  # (1, S) chunks

    def __len__(self) -> int:
        return sum(h.shape[1] for h in self.hidden)

    def owe(self, hidden: mx.array, tokens: mx.array):
        self.hidden.append(hidden)
        self.tokens.append(tokens)

    def take(self):
        """All pairs as one (1, S, H), (1, S) chunk; nothing stays owed."""
        h, t = self.hidden, self.tokens
        self.hidden, self.tokens = [], []
        if len(h) == 1:
            return h[0], t[0]
        return mx.concatenate(h, axis=1), mx.concatenate(t, axis=1)

    def trim(self, keep: int = MAX_OWED_WHILE_PAUSED):
        """While drafting pauses, keep only the newest ``keep`` chunks (list work only).

        The head then sees a shorter history when drafting resumes (it only drafts,
        so greedy and coupled output are unaffected), and a probe after a long pause
        costs one short MTP pass instead of one over every token since.
        """
        if len(self.hidden) > 2 * keep:
            del self.hidden[:-keep], self.tokens[:-keep]

    def flush(self, model, mtp_cache, max_owed: int = 0):
        """Write all but the newest pair into ``mtp_cache`` when more than ``max_owed`` wait."""
        if len(self) > max(max_owed, 1):
            h, t = self.take()
            model.mtp_forward(h[:, :-1], t[:, :-1], mtp_cache)
            self.owe(h[:, -1:], t[:, -1:])
            mx.eval([c.state for c in mtp_cache])

    def copy(self) -> "OwedPairs":
        return OwedPairs(self.hidden, self.tokens)
