"""Batched speculative decoding: many sequences, one trunk forward per step.

Sequences are prefilled one by one (``MTPDecoder.prefill``) and then join the
running batch with ``add``; they leave with ``remove`` at any step. One step
drafts K tokens for every row (the MTP head runs batched too), verifies all
rows' ``[y, d_1..d_K]`` in one trunk pass, and lets each row accept its own
number of drafts: recurrent layers select each row's captured state, attention
and MTP caches turn each row's rejected slots into holes (``BatchKVCache``).
K is shared by the batch; ``DraftPolicy`` picks it from the rows' acceptance and
a model of step cost by batch size, so MTP keeps paying under load or pauses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, Hashable, List, Optional

import mlx.core as mx

from ..models.cache import BatchKVCache, KVCache, RecurrentCache
from .sampling import Sampler, SamplingParams, filtered_logprobs, log_softmax, verify
from .policy import DraftPolicy
from .speculative import MTPDecoder, SpecStats, StepOutput, trim_owed


@dataclass
class _Row:
    key: Hashable
    params: SamplingParams
    sampler: Sampler
    max_k: int
    y: mx.array  # (1,) last emitted token, not yet in the trunk
    owed_hidden: List[mx.array] = field(default_factory=list)
    owed_tokens: List[mx.array] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)

    def owed(self) -> int:
        return sum(h.shape[1] for h in self.owed_hidden)

    def take_owed(self):
        h = mx.concatenate(self.owed_hidden, axis=1)
        t = mx.concatenate(self.owed_tokens, axis=1)
        self.owed_hidden, self.owed_tokens = [], []
        return h, t


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


class _RowError(Exception):
    def __init__(self, key, cause):
        super().__init__(str(cause))
        self.key, self.cause = key, cause


def _per_row(rows, fn):
    out = []
    for b, r in enumerate(rows):
        try:
            out.append(fn(b, r))
        except Exception as e:
            raise _RowError(r.key, e) from e
    return out


def _prepare(caches, S, lengths=None):
    for c in caches:
        if isinstance(c, BatchKVCache):
            c.prepare(S, lengths)


class BatchDecoder:
    def __init__(self, model, num_draft_tokens: int = 3, adaptive: bool = True):
        self.model = model
        self.K = num_draft_tokens if model.num_mtp_layers else 0
        self.rows: List[_Row] = []
        self.cache: Optional[list] = None
        self.mtp_cache: Optional[list] = None
        self.adaptive = adaptive
        self.policy = DraftPolicy(self.K, adaptive)

    def __len__(self):
        return len(self.rows)

    # -- membership --------------------------------------------------------
    def add(self, key: Hashable, dec: MTPDecoder):
        """Join a sequence whose prompt ``dec`` has prefilled."""
        use_mtp = self.K > 0 and dec.mtp_cache is not None
        row = _Row(key, dec.params, dec.sampler, dec.K if use_mtp else 0, dec.y, stats=dec.stats)
        if use_mtp:
            row.owed_hidden, row.owed_tokens = list(dec.owed_hidden), list(dec.owed_tokens)
        dtype = self.model.text.model.embed_tokens.weight.dtype
        for layer, c in zip(self.model.layers, dec.cache):
            if isinstance(c, RecurrentCache) and c.conv is None:  # one-token prompt
                c.conv, c.ssm = layer.linear_attn.empty_state(1, dtype)
        mtp_single = dec.mtp_cache if use_mtp else [KVCache() for _ in range(self.model.num_mtp_layers)]
        if self.cache is None:
            self.cache = [RecurrentCache.concat([c]) if isinstance(c, RecurrentCache)
                          else BatchKVCache.from_single([c]) for c in dec.cache]
            if self.K:
                self.mtp_cache = [BatchKVCache.from_single([c]) for c in mtp_single]
        else:
            for i, c in enumerate(dec.cache):
                if isinstance(c, RecurrentCache):
                    self.cache[i] = RecurrentCache.concat([self.cache[i], c])
                else:
                    self.cache[i].extend(BatchKVCache.from_single([c]))
            if self.K:
                for i, c in enumerate(mtp_single):
                    self.mtp_cache[i].extend(BatchKVCache.from_single([c]))
        self.rows.append(row)
        # The batch holds copies now; free the sequence's own caches.
        dec.cache, dec.owed_hidden, dec.owed_tokens = None, [], []
        if dec.mtp_cache is not None:
            dec.mtp_cache = []

    def remove(self, key: Hashable):
        keep = [i for i, r in enumerate(self.rows) if r.key != key]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self.cache = self.mtp_cache = None
            return
        for c in self.cache + (self.mtp_cache or []):
            c.filter(keep)

    # -- decoding ----------------------------------------------------------
    def step(self, load: int = 0) -> Dict[Hashable, StepOutput]:
        """One step for every row. ``load``: rows expected soon (prompts being
        processed or queued); K is chosen for that batch size, and by a wider margin
        while they wait, since a slower step delays them too."""
        if not self.rows:
            return {}
        B = len(self.rows)
        policy_k = self.policy.choose(max(B, load), load > B) if self.K else 0
        k = min([policy_k] + [r.max_k for r in self.rows])
        if k and any(r.owed() == 0 for r in self.rows):
            k = 0
        snap = self._checkpoint()
        start = time.perf_counter()
        try:
            out = self._plain_step() if k == 0 else self._spec_step(k)
            # The whole step counts (rollback included); work the server runs
            # between steps (prompt chunks) does not.
            accepted = [o.num_accepted for o in out.values()]
            self.policy.record_step(B, k, time.perf_counter() - start, accepted)
        except Exception as e:
            self._restore(snap)
            if isinstance(e, _RowError):
                raise BatchStepError(e.key, e.cause) from e.cause
            victim = max(range(len(self.rows)), key=lambda b: self._context(b))
            raise BatchStepError(self.rows[victim].key, e) from e
        return out

    def _context(self, b: int) -> int:
        kv = next((c for c in self.cache if isinstance(c, BatchKVCache)), None)
        return kv.pos[b] if kv is not None else 0

    def _checkpoint(self):
        """What a step changes, by reference (KV writes past ``idx`` are harmless)."""
        caches = []
        for c in self.cache + (self.mtp_cache or []):
            if isinstance(c, RecurrentCache):
                caches.append((c, c.conv, c.ssm))
            else:
                caches.append((c, c.idx, list(c.pos), c.valid, c.keys, c.values))
        rows = [(r, r.y, list(r.owed_hidden), list(r.owed_tokens)) for r in self.rows]
        return caches, rows

    def _restore(self, snap):
        caches, rows = snap
        for c, *state in caches:
            if isinstance(c, RecurrentCache):
                c.conv, c.ssm = state
                c.clear_captured()
            else:
                c.idx, c.pos, c.valid, c.keys, c.values = state
        for r, y, h, t in rows:
            r.y, r.owed_hidden, r.owed_tokens = y, h, t

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
                    self._plain_step() if k == 0 else self._spec_step(k)
                    if j:
                        self.policy.costs.observe(B, k, time.perf_counter() - start)
            for i in range(B):
                self.remove(("calibration", i))
        return time.perf_counter() - t_start

    def would_draft(self, batch_size: int) -> bool:
        """Whether a batch of this size drafts now: only then does a joining prompt
        run through the MTP head (paused, the head's history starts after it)."""
        return self.K > 0 and self.policy.would_draft(batch_size)

    def _sample_rows(self, lp):
        """Per-row filtered distributions and samples (rows may sample differently)."""
        qs = _per_row(self.rows, lambda b, r: filtered_logprobs(lp[b], r.params))
        toks = mx.stack(_per_row(self.rows, lambda b, r: r.sampler.sample(qs[b])))
        return toks, qs

    def _plain_step(self):
        model = self.model
        if self.mtp_cache is not None:
            for r in self.rows:
                trim_owed(r.owed_hidden, r.owed_tokens)
        y = mx.stack([r.y for r in self.rows])  # (B, 1)
        _prepare(self.cache, 1)
        h_norm, h_mtp = model.trunk(y, self.cache)
        lp = log_softmax(model.logits(h_norm[:, -1]))  # (B, V)
        toks, _ = self._sample_rows(lp)
        ids = toks.tolist()  # the one host sync
        out = {}
        for b, r in enumerate(self.rows):
            if self.mtp_cache is not None:
                r.owed_hidden.append(h_mtp[b : b + 1])
                r.owed_tokens.append(toks[b : b + 1, None])
            r.y = toks[b : b + 1]
            out[r.key] = StepOutput([ids[b]], lp[b : b + 1], 0, 0)
        return out

    def _owed_batch(self):
        """Every row's owed MTP pairs, right-aligned in one (B, S) chunk."""
        hs, ts, lengths = [], [], []
        for r in self.rows:
            h, t = r.take_owed()
            hs.append(h)
            ts.append(t)
            lengths.append(h.shape[1])
        S = max(lengths)
        H = hs[0].shape[-1]
        hidden = mx.concatenate([mx.concatenate(
            [mx.zeros((1, S - n, H), h.dtype), h], axis=1) for h, n in zip(hs, lengths)])
        tokens = mx.concatenate([mx.concatenate(
            [mx.zeros((1, S - n), mx.uint32), t.astype(mx.uint32)], axis=1)
            for t, n in zip(ts, lengths)])
        return hidden, tokens, lengths

    def _spec_step(self, k: int):
        model, rows, B = self.model, self.rows, len(self.rows)
        # 1. draft: the first call also writes every row's owed pairs.
        hidden, tokens, lengths = self._owed_batch()
        _prepare(self.mtp_cache, hidden.shape[1], lengths)
        out = model.mtp_forward(hidden, tokens, self.mtp_cache)[:, -1:]
        drafts, draft_lps = [], []
        for j in range(k):
            if j:
                _prepare(self.mtp_cache, 1)
                out = model.mtp_forward(out, drafts[-1][:, None], self.mtp_cache)
            d, qs = self._sample_rows(log_softmax(model.logits(out[:, -1])))
            drafts.append(d)
            draft_lps.append(qs)
        drafts = mx.stack(drafts, axis=1)  # (B, k)
        # 2. verify all rows in one trunk pass.
        inputs = mx.concatenate([mx.stack([r.y for r in rows]), drafts], axis=1)
        _prepare(self.cache, k + 1)
        h_norm, h_mtp = model.trunk(inputs, self.cache, capture=True)
        raw = log_softmax(model.logits(h_norm))  # (B, k+1, V)
        # 3. accept, row by row (rows may sample differently).
        def accept(b, r):
            target = filtered_logprobs(raw[b : b + 1], r.params)
            q = None if r.params.greedy else mx.stack([lps[b] for lps in draft_lps])[None]
            return verify(target, drafts[b : b + 1], q, r.sampler)

        ns, nxts = map(list, zip(*_per_row(rows, accept)))
        values = mx.concatenate(ns + nxts + [drafts.reshape(-1)]).tolist()  # the one sync
        n_acc, nxt_ids, draft_ids = values[:B], values[B : 2 * B], values[2 * B :]
        # 4. per-row rollback.
        for c in self.cache:
            if isinstance(c, RecurrentCache):
                c.select_rows([n + 1 for n in n_acc])
            else:
                c.drop_last([k - n for n in n_acc])
        for c in self.mtp_cache:
            c.drop_last([k - 1] * B)
        result = {}
        for b, r in enumerate(rows):
            n = n_acc[b]
            nxt = mx.array([nxt_ids[b]], mx.uint32)
            r.owed_hidden.append(h_mtp[b : b + 1, : n + 1])
            r.owed_tokens.append(mx.concatenate([drafts[b : b + 1, :n], nxt[:, None]], axis=1))
            r.y = nxt
            r.stats.record(k, n)
            ids = draft_ids[b * k : b * k + n] + [nxt_ids[b]]
            result[r.key] = StepOutput(ids, raw[b, : n + 1], k, n)
        return result
