"""Batched speculative decoding: many sequences, one trunk forward per step.

Sequences are prefilled one by one (``MTPDecoder.prefill``) and then join the
running batch with ``add``; they leave with ``remove`` at any step. Each step is
``step.DecodeBatch`` over every row: the MTP head drafts for all rows, one trunk
pass verifies them, and each row accepts its own number of drafts (recurrent
layers keep each row's state after its own count, attention and MTP caches turn
each row's rejected slots into holes: ``BatchKVCache``). ``DraftPolicy`` picks
the rows' K from their acceptance and a model of step cost by batch size, so
MTP keeps paying under load or pauses. A failed step is undone and fails one row.
"""

from __future__ import annotations

import time
from typing import Dict, Hashable, List, Optional


from ..models.cache import BatchKVCache, KVCache, RecurrentCache
from .policy import DraftPolicy
from .speculative import MTPDecoder
from .step import DecodeBatch, OwedPairs, Row, RowError, StepOutput


class BatchStepError(Exception):
    """A batched step failed; ``key`` is the row to fail (the rest can go on).

    The batch is restored to its state before the step. Errors raised by one
    row's own work (its sampler, its acceptance test) name that row; errors of
    the shared computation (e.g. out of memory) name the row with the longest
    context, the likeliest cause and the biggest saving.
    """

    def __init__(self, key, cause: Exception):
        super().__init__(str(cause))
        self.key, self.cause = key, cause


class BatchDecoder:
    def __init__(self, model, num_draft_tokens: int = 3, adaptive: bool = True):
        self.model = model
        self.K = num_draft_tokens if model.num_mtp_layers else 0
        self.adaptive = adaptive
        self.policy = DraftPolicy(self.K, adaptive)
        self.core = DecodeBatch(model, [], None, None)

    @property
    def rows(self) -> List[Row]:
        return self.core.rows

    @property
    def cache(self) -> Optional[list]:
        return self.core.cache

    @property
    def mtp_cache(self) -> Optional[list]:
        return self.core.mtp_cache

    def __len__(self):
        return len(self.core.rows)

    # -- membership --------------------------------------------------------
    def add(self, key: Hashable, dec: MTPDecoder):
        """Join a sequence whose prompt ``dec`` has prefilled."""
        core = self.core
        use_mtp = self.K > 0 and dec.mtp_cache is not None
        src = dec.row
        row = Row(key, src.sampler, src.max_k if use_mtp else 0, src.y,
                  src.owed if use_mtp else None, src.stats, src.n_out,
                  src.schedule if use_mtp else None, src.drafter)
        dtype = self.model.text.model.embed_tokens.weight.dtype
        for layer, c in zip(self.model.layers, dec.cache):
            if isinstance(c, RecurrentCache) and c.conv is None:  # one-token prompt
                c.conv, c.ssm = layer.linear_attn.empty_state(1, dtype)
        mtp_single = dec.mtp_cache if use_mtp else [KVCache() for _ in range(self.model.num_mtp_layers)]
        if core.cache is None:
            core.cache = [RecurrentCache.concat([c]) if isinstance(c, RecurrentCache)
                          else BatchKVCache.from_single([c]) for c in dec.cache]
            if self.K:
                core.mtp_cache = [BatchKVCache.from_single([c]) for c in mtp_single]
        else:
            for i, c in enumerate(dec.cache):
                if isinstance(c, RecurrentCache):
                    core.cache[i] = RecurrentCache.concat([core.cache[i], c])
                else:
                    core.cache[i].extend(BatchKVCache.from_single([c]))
            if self.K:
                for i, c in enumerate(mtp_single):
                    core.mtp_cache[i].extend(BatchKVCache.from_single([c]))
        core.rows.append(row)
        # The batch holds copies now; free the sequence's own caches.
        dec.cache = None
        dec.row.owed = OwedPairs() if dec.row.owed is not None else None
        if dec.mtp_cache is not None:
            dec.mtp_cache = []

    def remove(self, key: Hashable):
        core = self.core
        keep = [i for i, r in enumerate(core.rows) if r.key != key]
        if len(keep) == len(core.rows):
            return
        core.rows = [core.rows[i] for i in keep]
        if not core.rows:
            core.cache = core.mtp_cache = None
            return
        for c in core.cache + (core.mtp_cache or []):
            c.filter(keep)

    # -- decoding ----------------------------------------------------------
    def step(self, load: int = 0) -> Dict[Hashable, StepOutput]:
        """One step for every row. ``load``: rows expected soon (prompts being
        processed or queued); K is chosen for that batch size, and by a wider margin
        while they wait, since a slower step delays them too."""
        rows = self.core.rows
        if not rows:
            return {}
        B = len(rows)
        ks = self.policy.row_ks(rows, max(B, load), load > B) if self.K else [0] * B
        snap = self._checkpoint()
        start = time.perf_counter()
        try:
            outs = self.core.step(ks)
            # The whole step counts (rollback included); work the server runs
            # between steps (prompt chunks) does not.
            if not any(o.lookup_drafted for o in outs):  # context drafts are not the policy's
                done = [o.num_drafted for o in outs]
                self.policy.record_step(B, max(done), time.perf_counter() - start,
                                        [o.num_accepted for o in outs], done)
        except Exception as e:
            self._restore(snap)
            if isinstance(e, RowError):
                raise BatchStepError(e.key, e.cause) from e.cause
            victim = max(range(len(rows)), key=self._context)
            raise BatchStepError(rows[victim].key, e) from e
        return {r.key: o for r, o in zip(rows, outs)}

    def _context(self, b: int) -> int:
        kv = next((c for c in self.cache if isinstance(c, BatchKVCache)), None)
        return kv.pos[b] if kv is not None else 0

    def _checkpoint(self):
        """What a step changes, by reference (KV writes past ``idx`` are harmless)."""
        caches = []
        for c in self.cache + (self.mtp_cache or []):
            if isinstance(c, RecurrentCache):
                caches.append((c, c.conv, c.ssm, c.offset))
            else:
                caches.append((c, c.idx, list(c.pos), c.valid, c.keys, c.values))
        rows = [(r, r.y, r.n_out, None if r.owed is None else r.owed.copy(),
                 None if r.sampler.history is None else r.sampler.history.state())
                for r in self.rows]
        return caches, rows

    def _restore(self, snap):
        caches, rows = snap
        for c, *state in caches:
            if isinstance(c, RecurrentCache):
                c.conv, c.ssm, c.offset = state
                c.clear_captured()
            else:
                c.idx, c.pos, c.valid, c.keys, c.values = state
        for r, y, n_out, owed, history in rows:
            r.y, r.n_out, r.owed = y, n_out, owed
            if history is not None:
                r.sampler.history.restore(history)

    def calibrate(self, batch_sizes=(1, 4, 16), steps: int = 3, prompt_len: int = 16) -> float:
        """Time steps of dummy batches at a few (batch size, K) cells before serving.

        Gives ``DraftPolicy`` a cost model from the start, so live traffic does not
        pay for exploring it. Only costs are recorded (dummy drafts say nothing about
        acceptance). Needs an empty batch; returns the seconds spent.
        """
        if not self.K or not self.adaptive or self.rows:
            return 0.0
        t_start = time.perf_counter()
        ks = sorted({0, 1, self.K})
        prompt = [(7 * j + 3) % self.model.text.args.vocab_size for j in range(prompt_len)]
        for B in batch_sizes:
            for i in range(B):
                dec = MTPDecoder(self.model, self.K, adaptive=False)
                dec.prefill(prompt)
                self.add(("calibration", i), dec)
            for k in ks:
                for j in range(steps + 1):  # the first step of a shape pays one-off costs
                    start = time.perf_counter()
                    self.core.step([k] * B)
                    if j:
                        self.policy.costs.observe(B, k, time.perf_counter() - start)
            for i in range(B):
                self.remove(("calibration", i))
        return time.perf_counter() - t_start

    def would_draft(self, batch_size: int) -> bool:
        """Whether a batch of this size drafts now: only then does a joining prompt
        run through the MTP head (paused, the head's history starts after it)."""
        return self.K > 0 and self.policy.would_draft(batch_size)
