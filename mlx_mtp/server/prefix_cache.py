"""Prompt-prefix cache for hybrid models.

A Gated DeltaNet layer's recurrent state cannot be trimmed back to an earlier
position, so (unlike a pure-attention KV cache) a state is only reusable for
prompts that start with *exactly* the tokens it was computed on. The engine
therefore stores decoder states at chosen boundaries of each prompt (end of
the system turn, end of the conversation history, end of the prompt) and a
new request restores the longest stored prefix of its own prompt.

An entry's key is the token prefix ``prompt[: n + 1]`` where ``n`` is the
number of tokens in the trunk cache: the state also holds the MTP pair owed
for token ``n``, so that token is part of what must match.

Bounded by number of entries and by bytes, least recently used first out.
Only the engine thread touches it (no locking).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple


@dataclass
class Entry:
    key: Tuple[int, ...]
    state: object  # speculative.DecoderState
    nbytes: int
    has_mtp: bool


class PrefixCache:
    def __init__(self, max_entries: int = 32, max_bytes: int = 2 << 30):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.entries: "OrderedDict[Tuple[int, ...], Entry]" = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0

    def __len__(self):
        return len(self.entries)

    def __contains__(self, key) -> bool:
        return tuple(key) in self.entries

    def lookup(self, tokens: Sequence[int], need_mtp: bool) -> Optional[Entry]:
        """The entry with the longest key that is a prefix of ``tokens``."""
        if not self.enabled:
            return None
        tokens = tuple(tokens)
        best = None
        for key, e in self.entries.items():
            n = len(key)
            if n > len(tokens) or (best is not None and n <= len(best.key)):
                continue
            if need_mtp and not e.has_mtp:
                continue
            if tokens[:n] == key:
                best = e
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(best.key)
        return best

    def store(self, key: Sequence[int], state, nbytes: int, has_mtp: bool) -> bool:
        if not self.enabled or nbytes > self.max_bytes:
            return False
        key = tuple(key)
        old = self.entries.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes
            if old.has_mtp and not has_mtp:  # keep the richer state
                state, nbytes, has_mtp = old.state, old.nbytes, old.has_mtp
        self.entries[key] = Entry(key, state, nbytes, has_mtp)
        self.nbytes += nbytes
        self._evict()
        return True

    def touch(self, key: Sequence[int]):
        key = tuple(key)
        if key in self.entries:
            self.entries.move_to_end(key)

    def _evict(self):
        while self.entries and (len(self.entries) > self.max_entries
                                or self.nbytes > self.max_bytes):
            _, e = self.entries.popitem(last=False)
            self.nbytes -= e.nbytes

    def clear(self):
        self.entries.clear()
        self.nbytes = 0
