"""The server's memory budget (``serve --memory-budget``): admission by cache bytes.

Memory is accounted from the cache protocol (``_Cache.nbytes``: the bytes a cache's
``state`` holds). A model's ``Footprint`` (bytes per token and per sequence, and the bounded
parts, in the batch form the engine decodes in) is measured once, per cache: over a
sequence's first few tokens (prefilled) and over 1024 tokens past every cache's
``max_positions`` (on shapes alone, ``models/cache_growth.traced_bytes``, as ``inspect``
measures: a tenth of a second). A cache that grows faster at first has a bounded part (a
window, DeepSeek-V4's raw rows) that fills at the difference, beside what it keeps for good
(compressed entries); a block drafter's deferred taps are a bounded part of their own
(``MAX_DEFERRED`` positions a row). A request's worst case is its prompt plus ``max_tokens``
(the API already caps both by ``--max-kv-size``), plus the positions a verify pass writes
and the holes rejected drafts leave in a batch cache until it next grows.

The running batch pads every row to its longest (``BatchKVCache``), so ``n`` rows need
``n`` times the longest row: the larger of what a row holds now and the worst case of
the longest request. A request is admitted when that, for the running rows and it, plus
the prefix cache's entries (in-memory sessions included) fits the budget; the prefix
cache gives back entries, least recently used first, before a request waits. The queue's
head waits (nobody overtakes it) until running requests finish; a queued request is
answered 429 with ``Retry-After`` only when it could never fit (alone, with an empty prefix
cache) or has waited ``max_wait`` seconds. Running requests are never stopped for it.

The MTP head's caches are counted as long as the longest row that drafts from the head: a
row that does not (``num_draft_tokens`` 0, a lookup-only source) holds none of their growth,
but the batch pads it to a drafting row's length beside one.

Not accounted: weights, activations, and the copy a batch holds for an instant while a row
joins.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Tuple

import mlx.core as mx

from ..decode import block_context
from ..decode.sequence import Sequence
from ..models.cache_growth import GROWTH_TOKENS, past_bounds, traced_bytes
from .events import Failed, emit

GIB = 1 << 30
SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": GIB, "T": 1 << 40}
# Holes rejected drafts leave in a batch cache until it grows again (a growth adds room
# for this many positions and squeezes the holes out: BatchKVCache.step).
GROWTH_SLACK = 256
MAX_WAIT_SECONDS = 300.0  # a request waiting longer for memory is answered 429
RETRY_AFTER_SECONDS = 10  # what a 429 for a long wait suggests


class OverBudget(Exception):
    """A request the memory budget refuses (429, ``retry_after`` seconds)."""

    code = "memory_budget_exceeded"

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after

    def event(self) -> Failed:
        return Failed(429, str(self), self.code, self.retry_after)


def parse_memory_budget(text: str) -> int:
    """``--memory-budget`` in bytes: GB (``12``), up to 1 a fraction of the RAM (``0.6``),
    or a size with its unit (``512M``, ``2G``)."""
    t = str(text).strip().upper()
    unit = SIZE_UNITS.get(t[-1:], None)
    try:
        value = float(t[:-1] if unit else t)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise ValueError(f"--memory-budget takes GB (e.g. 12), a fraction of the RAM "
                         f"(e.g. 0.6) or a size (e.g. 512M), not {text!r}")
    if unit:
        return int(value * unit)
    if value <= 1:
        return int(value * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return int(value * GIB)


@dataclass(frozen=True)
class Footprint:
    """What one sequence's caches hold in a batch: ``per_sequence`` bytes whatever its length
    (recurrent states, pending inputs), ``per_token`` bytes for each token it holds, and
    ``bounded``: the parts that hold at most so many positions (windows, DeepSeek-V4's raw
    rows, a block drafter's deferred taps), as (bytes per token, most positions) each."""

    per_token: int
    per_sequence: int
    bounded: Tuple[Tuple[int, int], ...] = ()
    # The part of these the MTP head's caches (and a row's owed pairs) hold: a row that does
    # not draft from the head holds none of it, unless a drafting row pads it in a batch.
    head: Optional["Footprint"] = None

    @classmethod
    def measure(cls, model, mtp: bool = True, lengths=(4, 8)) -> "Footprint":
        """Each cache's growth over a sequence's first ``lengths`` tokens (prefilled) and
        over 1024 tokens past every cache's ``max_positions`` (on shapes alone, as
        ``inspect`` measures it: ``cache_growth.traced_bytes``), each cache in its batch form
        (a batch of one: a batch's row masks count too); ``mtp``: the rows keep MTP caches,
        whose part is ``head``. A cache that grows faster at first than past its bound has a
        bounded part (a window, pending rows) beside what it keeps for good (a compressed
        cache's entries)."""
        (short, caps), (short2, _) = (cls._held(model, n, mtp) for n in lengths)
        far, far2 = cls._held_far(model, mtp)
        parts = [_fit(lengths, a, b, (far.length, far2.length), far_a, far_b, cap)
                 for a, b, far_a, far_b, cap in zip(short, short2, far.held, far2.held, caps)]
        n_trunk = len(block_context.make_cache(model))
        head = _sum(parts[n_trunk:]) if len(parts) > n_trunk + 1 else None  # + owed pairs
        whole = _sum(parts)
        return cls(whole.per_token, max(0, whole.per_sequence),
                   whole.bounded + cls._deferred_taps(model), head)

    @staticmethod
    def _held(model, n: int, mtp: bool):
        """Bytes each cache (and the owed MTP pairs) holds after ``n`` tokens, and each
        cache's bound in positions."""
        seq = Sequence(model, 1 if mtp and model.num_mtp_layers else 0, adaptive=False)
        seq.prefill(list(range(n + 1)))  # the last token is the first input of decoding
        batch = [type(c).merge([c]) for c in seq.cache + (seq.mtp_cache or [])]
        owed = seq.owed.hidden if seq.owed is not None else []
        return ([c.nbytes for c in batch] + [sum(h.nbytes for h in owed)],
                [c.max_positions() for c in batch] + [None])

    @staticmethod
    def _held_far(model, mtp: bool) -> Tuple["_Held", "_Held"]:
        """Bytes each cache holds, in its batch form, after ``n`` and ``n + 1024`` prompt
        tokens, ``n`` past every cache's bound (the owed pairs: none)."""
        trunk = block_context.make_cache(model)
        head = model.make_mtp_cache() if mtp and model.num_mtp_layers else []
        n = past_bounds(trunk + head)
        lengths = (n, n + GROWTH_TOKENS)
        held = traced_bytes(model, trunk, head, lengths,
                            run=lambda ids, c: block_context.trunk(model, ids, c),
                            held=lambda c: type(c).merge([c]).nbytes)
        return tuple(_Held(n, h + [0]) for n, h in zip(lengths, held))

    @staticmethod
    def _deferred_taps(model) -> Tuple[Tuple[int, int], ...]:
        """A block drafter's raw taps a row holds between its passes: up to
        ``MAX_DEFERRED`` positions of what one decode step defers (traced)."""
        if model.block_drafter is None:
            return ()
        cache, held = block_context.make_cache(model), []

        def step(x):
            block_context.trunk(model, mx.ones((1, 1), mx.uint32), cache, defer=True)
            held.append(type(cache[-1]).merge([cache[-1]]).nbytes)  # the taps: last
            return x

        mx.compile(step)(mx.zeros(1))
        return ((held[0], block_context.MAX_DEFERRED),)

    def row_bytes(self, tokens: int, head_tokens: Optional[int] = None) -> int:
        """A row's bytes at ``tokens`` positions, its head caches' at ``head_tokens`` (None:
        as many; 0: none, as in a batch where no row drafts from the head)."""
        whole = (self.per_sequence + self.per_token * tokens
                 + sum(b * min(tokens, cap) for b, cap in self.bounded))
        if self.head is None or head_tokens is None:
            return whole
        return (whole - self.head.row_bytes(tokens)
                + (max(0, self.head.row_bytes(head_tokens)) if head_tokens else 0))


class _Held(NamedTuple):
    length: int
    held: List[int]  # bytes per cache


def _line(lengths: Tuple[int, int], a: int, b: int) -> Tuple[int, int]:
    """Bytes a token (rounded up) and at no tokens of the line through ``a`` bytes at
    ``lengths[0]`` tokens and ``b`` at ``lengths[1]``."""
    grows = math.ceil((b - a) / (lengths[1] - lengths[0]))
    return grows, a - grows * lengths[0]  # < 0 for a cache a position behind (MTP)


def _fit(at, a: int, b: int, far_at, far_a: int, far_b: int, cap: Optional[int]) -> "Footprint":
    """One cache's figures from its bytes after the short lengths ``at`` (``a``, ``b``) and
    the far ones ``far_at`` (``far_a``, ``far_b``); ``cap``: its bound in positions."""
    early, f_early = _line(at, a, b)
    late, f_late = _line(far_at, far_a, far_b)
    if early > late:  # the bounded part fills at early - late bytes a token
        fills = math.ceil((f_late - f_early) / (early - late))
        return Footprint(late, f_early, ((early - late, max(cap or 0, fills, 0)),))
    # a row's own bytes where it grows alike (the traced head is ahead of a row's, which
    # owes its last pairs); else what first grows later
    return Footprint(late, f_early if early == late else max(f_early, f_late))


def _sum(parts: List["Footprint"]) -> "Footprint":
    return Footprint(sum(p.per_token for p in parts), sum(p.per_sequence for p in parts),
                     tuple(b for p in parts for b in p.bounded))


def batch_row_bytes(caches: Optional[list]) -> int:
    """Bytes each row of a batch's caches holds now (rows are as long as the longest)."""
    return sum(c.row_nbytes for c in caches or [])


class MemoryBudget:
    """Admission by memory (see the module doc); ``limit`` None: no budget (no checks)."""

    def __init__(self, limit: Optional[int] = None, max_wait: float = MAX_WAIT_SECONDS,
                 footprint: Optional[Footprint] = None):
        self.limit = limit
        self.max_wait = max_wait
        self.footprint = footprint  # measured on first use (on the engine's thread)
        # What the engine thread saw last (read by /metrics and the live page).
        self.used_by_sequences = 0
        self.reserved = 0

    @property
    def enabled(self) -> bool:
        return self.limit is not None

    def worst_tokens(self, req, default_k: int) -> int:
        k = default_k if req.num_draft_tokens is None else req.num_draft_tokens
        return len(req.prompt) + req.max_tokens + k + 1 + GROWTH_SLACK

    def _gib(self, n: int) -> str:
        return f"{n / GIB:.2f} GiB"

    def drafts(self, engine, req) -> bool:
        """Whether ``req``'s row drafts from the MTP head, so keeps head caches that grow (a
        row with ``num_draft_tokens`` 0 or a lookup-only source never does)."""
        k, _ = engine.draft_sources.for_row(engine.num_draft_tokens, req.num_draft_tokens,
                                            req.draft_source, engine.has_mtp)
        return k > 0

    def check(self, req, engine):
        """Raise ``OverBudget`` for a request that could never fit or waited too long
        (nothing is checked before the model's footprint is known)."""
        if not self.enabled or self.footprint is None:
            return
        worst = self.worst_tokens(req, engine.num_draft_tokens)
        need = self.footprint.row_bytes(worst, worst if self.drafts(engine, req) else 0)
        if need > self.limit:
            raise OverBudget(f"This request needs up to {self._gib(need)} of KV and state "
                             f"memory, more than the server's whole memory budget "
                             f"({self._gib(self.limit)}); shorten the prompt or max_tokens.",
                             retry_after=int(self.max_wait))
        if time.perf_counter() - req.arrival > self.max_wait:
            raise OverBudget(f"The server's memory budget stayed full for {self.max_wait:.0f} "
                             "seconds while this request waited; try again later.",
                             retry_after=RETRY_AFTER_SECONDS)

    def _need(self, engine, extra: list) -> int:
        """Bytes the running rows (and the requests ``extra``) need at most: each row as long
        as the longest, its head caches as long as the longest row drafting from the head
        (rows that do not are padded to it in the batch; none drafting: none held)."""
        reqs = [s.req for s in engine.running] + extra
        if not reqs:
            return 0
        worst = [self.worst_tokens(r, engine.num_draft_tokens) for r in reqs]
        head = max([w for w, r in zip(worst, reqs) if self.drafts(engine, r)], default=0)
        trunk = self.footprint.row_bytes(max(worst), 0)
        # what the batch holds now, if more (head caches a drafting row left stay)
        row = (max(trunk, batch_row_bytes(engine.batch.cache))
               + max(self.footprint.row_bytes(max(worst), head) - trunk,
                     batch_row_bytes(engine.batch.mtp_cache)))
        return len(worst) * row

    def report_to(self, engine) -> "MemoryBudget":
        """Publish the account on ``engine.metrics``, read when scraped (the sequences' figures
        are the last iteration's, 0 once none runs)."""
        m = engine.metrics
        m.memory_budget.fn = lambda: self.limit or 0
        m.memory_sequences.fn = lambda: self.used_by_sequences if engine.running else 0
        m.memory_reserved.fn = lambda: self.reserved if engine.running else 0
        m.memory_prefixes.fn = lambda: engine.prefix_cache.nbytes
        return self

    def settle(self, engine):
        """Each scheduler iteration: measure what sequences hold, and let the prefix cache
        give back what the running rows' worst case leaves no room for."""
        if not self.enabled:
            return
        if self.footprint is None:
            self.footprint = Footprint.measure(engine.model, mtp=engine.batch.mtp)
        self._refuse(engine)
        self.used_by_sequences = (
            len(engine.batch) * (batch_row_bytes(engine.batch.cache)
                                 + batch_row_bytes(engine.batch.mtp_cache))
            + sum(sum(c.nbytes for c in s.dec.cache + (s.dec.mtp_cache or []))
                  for s in engine.running if s.prefilling and s.dec.cache is not None))
        self.reserved = self._need(engine, [])
        self._make_room(engine.prefix_cache, self.reserved)

    def _make_room(self, pc, need: int) -> bool:
        """Evict prefix-cache entries, least recently used first, until ``need`` bytes and
        the cache fit; whether they do."""
        while pc.nbytes and need + pc.nbytes > self.limit:
            pc.evict_oldest()
        return need + pc.nbytes <= self.limit

    def _refuse(self, engine):
        """Answer 429 to the queued requests that could never fit or waited too long."""
        for req in [r for r in engine.waiting if not r.cancelled]:
            try:
                self.check(req, engine)
            except OverBudget as e:
                engine.waiting.remove(req)
                engine.metrics.request_failure.inc(reason="memory_budget")
                emit(req, e.event())

    def waits(self, engine, req) -> bool:
        """Whether the queue's head ``req`` waits for memory (False: admit it)."""
        if not self.enabled or req.cancelled:
            return False
        need = self._need(engine, [req])
        if self._make_room(engine.prefix_cache, need):
            self.reserved = need
            return False
        return True
