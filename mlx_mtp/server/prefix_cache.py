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

With a ``SessionStore`` (``serve --prompt-cache-dir``) stored entries of long prompts are
also written to disk, and a lookup that finds a longer prefix on disk than in memory
restores it (into memory too): a restarted server resumes a conversation without
recomputing it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

log = logging.getLogger("mlx_mtp.server")


@dataclass
class Entry:
    key: Tuple[int, ...]
    state: object  # speculative.DecoderState
    nbytes: int
    has_mtp: bool


class PrefixCache:
    def __init__(self, max_entries: int = 32, max_bytes: int = 2 << 30, disk=None):
        self.disk = disk  # session_store.SessionStore or None
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
        if self.disk is not None:
            best = self._from_disk(tokens, need_mtp, best)
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        if best.key in self.entries:  # (a disk entry too large for memory is not)
            self.entries.move_to_end(best.key)
        return best

    def restore(self, seq, tokens: Sequence[int]) -> Optional[Entry]:
        """Restore into ``seq`` (a new ``decode.sequence.Sequence``) the longest entry whose
        key is a prefix of ``tokens``. An entry that does not fit the model's caches (a
        damaged or forged state) is discarded and None returned: the prompt runs cold."""
        entry = self.lookup(tokens, need_mtp=seq.mtp_cache is not None)
        if entry is None:
            return None
        try:
            seq.restore(entry.state)
        except ValueError as e:
            self.discard(entry.key, e)
            return None
        return entry

    def discard(self, key: Sequence[int], why):
        """Forget an entry found unusable, in memory and on disk (deleted), with a log line."""
        log.warning("Prompt cache: dropping a %d-token entry that failed (%s); the prompt "
                    "runs cold", len(key), why)
        e = self.entries.pop(tuple(key), None)
        if e is not None:
            self.nbytes -= e.nbytes
        if self.disk is not None:
            self.disk.discard(key)

    def _from_disk(self, tokens, need_mtp: bool, best: Optional[Entry]) -> Optional[Entry]:
        """A longer prefix than ``best`` from disk, kept in memory too; else ``best``."""
        if best is not None:
            self.disk.touch(best.key)  # disk LRU follows use
        found = self.disk.lookup(tokens, need_mtp, longer_than=len(best.key) if best else 0)
        if found is None:
            return best
        key, state = found
        entry = Entry(key, state, state.nbytes, state.mtp_cache is not None)
        self._store_memory(key, state, entry.nbytes, entry.has_mtp)
        return self.entries.get(key, entry)

    def store(self, key: Sequence[int], state, nbytes: int, has_mtp: bool) -> bool:
        """Keep a state (arrays already evaluated); long prompts' also go to disk."""
        stored = self._store_memory(key, state, nbytes, has_mtp)
        if stored and self.disk is not None:
            e = self.entries.get(tuple(key))
            if e is not None:  # the richer of the old and new states
                self.disk.put(e.key, e.state, e.has_mtp)
        return stored

    def _store_memory(self, key, state, nbytes: int, has_mtp: bool) -> bool:
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

    def adds(self, key: Sequence[int], has_mtp: bool) -> bool:
        """Whether a state stored under ``key`` would add to the entry there (one as good is
        marked used instead)."""
        old = self.entries.get(tuple(key))
        if old is not None and (old.has_mtp or not has_mtp):
            self.touch(key)
            return False
        return True

    def touch(self, key: Sequence[int]):
        key = tuple(key)
        if key in self.entries:
            self.entries.move_to_end(key)

    def _evict(self):
        while self.entries and (len(self.entries) > self.max_entries
                                or self.nbytes > self.max_bytes):
            self.evict_oldest()

    def evict_oldest(self):
        """Drop the least recently used entry (also when the memory budget needs room)."""
        _, e = self.entries.popitem(last=False)
        self.nbytes -= e.nbytes

    def clear(self):
        self.entries.clear()
        self.nbytes = 0
