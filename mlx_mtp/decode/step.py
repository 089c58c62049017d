"""One speculative step over B >= 1 rows: draft, verify, accept, roll back.

With ``y`` each row's last emitted token (not yet in the trunk) and ``k_b`` the
drafts row ``b`` asked for (``k = max k_b``):

1. draft: chain the MTP head k times for every row. Its first call also writes
   the MTP pairs each row still owes (``OwedPairs``: trunk hidden at ``i`` with
   token ``i+1``); later calls feed the head its own post-norm output and the
   previous draft. A row with a ``drafter`` (``draft_source.py``, ``drafters/``)
   may take its first drafts from it instead, extended by the head or not; the
   head chains only as far as some row needs it (``J <= k`` passes, fed the
   drafter's tokens, ``drafters/mtp_head.py``). A drafter's token is a
   one-hot proposal ``q``: accepted with probability ``p(d)``, and a rejection
   draws from ``p`` without ``d`` (the residual ``p - q``): step 3 stays exact.
2. verify: one trunk pass over every row's ``[y, d_1..d_k]`` (``capture=True``).
3. accept: ``sampling.verify`` per group of rows sampling alike; a row that asked
   for fewer drafts stops at its own ``k_b`` and takes the target's token there,
   exactly as a ``k_b``-step would. Reading accepted counts, next tokens and
   drafts is the step's only host sync.
4. roll back: every trunk cache keeps ``n_b + 1`` positions of the pass
   (``accept``), the MTP caches drop their ``k - 1`` chained (draft-conditioned)
   entries (``J - 1``; none if no row used the head), and the accepted positions'
   hiddens become owed MTP pairs.

Logit bias, penalties and grammar masks are one per-position list of transforms
(``logits.PositionTransforms``): draft call ``j`` and verify row ``j`` go through the
same ones, so ``p`` and ``q`` stay comparable. Under a grammar (structured output) a
step reads each draft as it is drawn, since the next mask depends on it.

``k = 0`` is a plain step through the same object. Noise comes from each row's
``Sampler``, keyed by output position, so a row's tokens do not depend on the
other rows or on how many drafts earlier steps made.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Hashable, List, Optional, Sequence

import mlx.core as mx

from ..drafters.base import DraftPlan
from ..drafters.mtp_head import MtpHead
from ..models.cache import prepare_chunk
from . import block_context
from .costs import StepCosts
from .logits import PositionTransforms
from .noise import ACCEPT, DRAFT, TARGET, gumbel, position_keys, uniform
from .sampling import Sampler, SamplingParams, log_softmax, sample, verify
from .stats import SpecStats

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


@dataclass
class StepOutput:
    tokens: List[int]  # accepted drafts then the recovered/bonus token
    logprobs: mx.array  # (len(tokens), V) target log-probs for each emitted token
    num_drafted: int
    num_accepted: int
    lookup_drafted: int = 0  # of num_drafted, the row drafter's (draft_source.py)
    lookup_accepted: int = 0
    block_drafted: int = 0  # of num_drafted, the block drafter's (drafters/block)
    block_accepted: int = 0

    @property
    def head_drafted(self) -> int:
        """Of num_drafted, the head's (after the context drafts, if any)."""
        return self.num_drafted - self.lookup_drafted - self.block_drafted


@dataclass
class Row:
    """One sequence's decode state (the caches hold its other state)."""

    key: Hashable
    sampler: Sampler
    max_k: int  # 0: this row never drafts
    y: mx.array  # (1,) last emitted token, not yet in the trunk
    owed: Optional[OwedPairs]  # None when the row never drafts
    stats: SpecStats = field(default_factory=SpecStats)
    n_out: int = 0  # tokens emitted: the output position of the next one
    schedule: Optional[object] = None  # policy.SeededSchedule: K from this row alone
    drafter: Optional[object] = None  # draft_source.RowDrafter: drafts beside the head

    @property
    def params(self) -> SamplingParams:
        return self.sampler.params

    def can_draft(self) -> bool:  # owed None: no head, a block drafter drafts (block_context)
        return self.max_k > 0 and (self.owed is None or len(self.owed) > 0)


class RowError(Exception):
    """Work of one row (its filter, its sampler) failed; ``key`` names the row."""

    def __init__(self, key, cause: Exception):
        super().__init__(str(cause))
        self.key, self.cause = key, cause


def drop_drafted(model, mtp_cache, k: int):
    """Roll the MTP caches back over the entries a step's drafts wrote (conditioned on
    drafts, not on trunk hiddens): k - 1 with one MTP layer; the model says otherwise."""
    for c, n in zip(mtp_cache, model.drafted_entries(k)):
        c.trim(n)


@dataclass
class _Group:
    """Rows that filter and verify alike (same sampling parameters but the seed)."""

    params: SamplingParams
    rows: List[int]
    index: Optional[mx.array]  # None: every row, in order

    def take(self, x: mx.array) -> mx.array:
        return x if self.index is None else x[self.index]


@dataclass
class _Pending:
    """A launched step, not yet read."""

    k: int
    ks: List[int]
    tokens: mx.array  # plain: (B,); speculative: (B,) next tokens
    logprobs: mx.array  # plain: (B, V); speculative: (B, k+1, V)
    n_accepted: Optional[mx.array] = None  # (B,)
    drafts: Optional[mx.array] = None  # (B, k)
    h_mtp: Optional[mx.array] = None  # (B, k+1, H)
    plans: Optional[List[DraftPlan]] = None  # per row: drafter tokens, then head drafts
    head_steps: int = 0  # head passes chained (positions drafted by the head or after it)


@dataclass
class _Proposal:
    """Step 1's result: what the trunk verifies and how the drafts were drawn."""

    drafts: mx.array  # (B, k) uint32
    draft_lps: list  # per head position j: each group's filtered log q (b, V)
    where: Optional[mx.array]  # (B, k) bool: drafter tokens; None: the head's only
    head_steps: int  # J, the head passes chained
    noises: Optional[tuple]  # per group: the target's and the drafts' noise; None: J == 0


class DecodeBatch:
    """Rows decoding together through one trunk forward per step.

    ``cache`` / ``mtp_cache`` are per-layer caches holding every row (one row:
    ``KVCache``; many: ``BatchKVCache``; ``RecurrentCache`` either way).
    """

    def __init__(self, model, rows: List[Row], cache: list, mtp_cache: Optional[list]):
        self.model = model
        self.rows = rows
        self.cache = cache
        self.mtp_cache = mtp_cache
        self.head = MtpHead()  # the head chain, for the rows that draft from it

    def step(self, ks: Sequence[int], costs: StepCosts) -> List[StepOutput]:
        return self.finish(self.launch(ks, costs))

    def launch(self, ks: Sequence[int], costs: StepCosts) -> _Pending:
        """Build the step's graph (``ks[b]``: drafts for row b; ``costs``: the driver's
        step-cost table, for rows that choose between context and head drafts) and start
        evaluating it. Timing it is the driver's (``costs.py``: one clock)."""
        plans = self._plans(list(ks), costs)
        ks = [p.total for p in plans]
        k = max(ks) if ks else 0
        if any(p.head for p in plans) and self.mtp_cache is None:
            raise ValueError("drafting needs an MTP cache")
        pending = self._launch_plain() if k == 0 else self._launch_spec(k, ks, plans)
        mx.async_eval(pending.tokens, pending.logprobs)
        return pending

    def _launch_spec(self, k: int, ks: List[int], plans: List[DraftPlan]) -> _Pending:
        """Propose, verify, accept; ``finish`` reads the result and rolls back."""
        self._check_drafting(plans)
        groups, transforms = self._groups(), self._transforms()
        proposal = self._propose(k, plans, groups, transforms)
        raw, h_mtp = self._verify(proposal.drafts, transforms)
        n_acc, nxt = self._accept(groups, raw, proposal, ks)
        return _Pending(k, ks, nxt.astype(mx.uint32), raw, n_acc, proposal.drafts, h_mtp, plans,
                        proposal.head_steps)

    def _plans(self, ks: List[int], costs: StepCosts) -> List[DraftPlan]:
        """Each row's drafts: the head's ``ks[b]``, or what its drafter picks. The head
        alone drafts for a row under a grammar (a context draft may break it) or with a
        seeded schedule, and on a split model unless its plan follows from K (``plans_alike``)."""
        off = self.model.capabilities.shares
        return block_context.fit_plans(self, [
            DraftPlan([], kb) if r.drafter is None or off and not r.drafter.plans_alike
            or r.schedule is not None or r.sampler.grammar is not None
            else r.drafter.plan(kb, r.can_draft(), len(self.rows), costs, r.max_k)
            for r, kb in zip(self.rows, ks)])

    def finish(self, p: _Pending) -> List[StepOutput]:
        """Read the step (the one host sync) and commit it: rollback, owed pairs, stats.
        The outputs say what each row drafted (from the context and the head) and accepted:
        all the driver records of the step."""
        if p.k == 0:
            return self._finish_plain(p)
        B, k = len(self.rows), p.k
        values = mx.concatenate([p.n_accepted, p.tokens, p.drafts.reshape(-1)]).tolist()
        n_acc, next_ids, draft_ids = values[:B], values[B : 2 * B], values[2 * B :]
        # 4. roll back: every trunk cache keeps the accepted positions and the one after
        for c in self.cache:
            c.accept([n + 1 for n in n_acc])
        if p.head_steps:  # entries conditioned on drafts, not on trunk hiddens
            drop_drafted(self.model, self.mtp_cache, p.head_steps)
        return [self._commit(b, p, n_acc[b], draft_ids[b * k : b * k + n_acc[b]] + [next_ids[b]])
                for b in range(B)]

    def _finish_plain(self, p: _Pending) -> List[StepOutput]:
        ids = p.tokens.tolist()
        for b, r in enumerate(self.rows):
            if r.sampler.grammar is not None:
                self._on_row(b, lambda: r.sampler.grammar.commit([ids[b]]))
            if r.drafter is not None:
                r.drafter.extend([ids[b]])
        return [StepOutput([ids[b]], p.logprobs[b : b + 1], 0, 0) for b in range(len(self.rows))]

    def _commit(self, b: int, p: _Pending, n: int, ids: List[int]) -> StepOutput:
        """Row b emits ``ids`` (its ``n`` accepted drafts and the next token): its owed
        MTP pairs, last token, penalties' history, grammar, drafter and stats."""
        r = self.rows[b]
        nxt = p.tokens[b : b + 1]
        if r.owed is not None:
            tokens = mx.concatenate([p.drafts[b : b + 1, :n], nxt[:, None]], axis=1)
            r.owed.owe(p.h_mtp[b : b + 1, : n + 1], tokens)
        r.y = nxt
        r.n_out += n + 1
        if r.sampler.history is not None:
            self._on_row(b, lambda: r.sampler.history.commit(ids))
        if r.schedule is not None:
            r.schedule.record(p.ks[b], n)
        if r.sampler.grammar is not None:
            self._on_row(b, lambda: r.sampler.grammar.commit(ids))
        drafted = (0, 0)  # the row drafter's tokens, of them accepted
        if r.drafter is not None:
            drafted = r.drafter.record(p.plans[b], n)
            r.drafter.extend(ids)
        by_source = (0, 0, *drafted) if p.plans[b].block else (*drafted, 0, 0)
        r.stats.record(p.ks[b], n, *by_source)
        return StepOutput(ids, p.logprobs[b, : n + 1], p.ks[b], n, *by_source)

    # -- internals -------------------------------------------------------------------
    def _groups(self) -> List[_Group]:
        by_params = {}
        for b, r in enumerate(self.rows):
            by_params.setdefault(replace(r.params, seed=None), []).append(b)
        if len(by_params) == 1:
            (params, rows), = by_params.items()
            return [_Group(params, rows, None)]
        return [_Group(p, rows, mx.array(rows)) for p, rows in by_params.items()]

    def _per_group(self, groups, fn) -> list:
        """``fn(g)`` for each group; a failure names the group's first row."""
        return [self._on_row(g.rows[0], lambda: fn(g)) for g in groups]

    def _filter(self, g: _Group, logprobs: mx.array) -> mx.array:
        return self.rows[g.rows[0]].sampler.filter(g.take(logprobs))

    def _merge(self, groups, parts: List[mx.array]) -> mx.array:
        """Per-group results (rows of each group in order) back into row order."""
        if len(groups) == 1:
            return parts[0]
        order = [b for g in groups for b in g.rows]
        inverse = [0] * len(order)
        for i, b in enumerate(order):
            inverse[b] = i
        return mx.concatenate(parts)[mx.array(inverse)]

    def _grammars(self):
        """Each row's grammar state (None: unconstrained), or None when no row has one."""
        states = [r.sampler.grammar for r in self.rows]
        if all(g is None for g in states):
            return None
        if self.model.capabilities.shares:
            raise ValueError("structured output is not supported on a model split "
                             "across processes")
        return states

    def _on_row(self, b: int, fn):
        """``fn()``, work of row b alone (its grammar, its penalties' bookkeeping, its
        group's sampling): a failure names row b, so the batch fails that row, no other."""
        try:
            return fn()
        except Exception as e:
            raise RowError(self.rows[b].key, e) from e

    def _transforms(self) -> PositionTransforms:
        """The step's per-position logit transforms (penalties, grammar masks)."""
        return PositionTransforms(self.rows, self._grammars(), self._on_row)

    def _noise(self, g: _Group, count: int, stream: int, vocab_size: int) -> Optional[mx.array]:
        """Gumbel noise (b, count, V) from each row's next output position; None if greedy."""
        if g.params.greedy:
            return None
        rows = [self.rows[b] for b in g.rows]
        keys = position_keys([r.sampler.seed for r in rows], [r.n_out for r in rows], count, stream)
        return gumbel(keys, vocab_size)

    def _launch_plain(self) -> _Pending:
        model, rows = self.model, self.rows
        y = mx.stack([r.y for r in rows])  # (B, 1)
        prepare_chunk(self.cache, 1)
        h_norm, h_mtp = block_context.trunk(model, y, self.cache, defer=True)
        logits = self._transforms()(model.logits(h_norm[:, -1:]))  # (B, 1, V)
        lp = log_softmax(logits[:, 0])  # (B, V)
        V = lp.shape[-1]
        groups = self._groups()

        def draw(g):
            noise = self._noise(g, 1, TARGET, V)
            return sample(self._filter(g, lp),
                          None if noise is None else noise[:, 0])

        toks, = model.share(self._merge(groups, self._per_group(groups, draw)))  # (B,)
        for b, r in enumerate(rows):
            if r.owed is not None:
                r.owed.owe(h_mtp[b : b + 1], toks[b : b + 1, None])
                if r.schedule is None:  # a seeded schedule keeps its whole history
                    r.owed.trim()
            r.y = toks[b : b + 1]
            r.n_out += 1
            if r.sampler.history is not None:
                r.sampler.history.commit(r.y)
        return _Pending(0, [0] * len(rows), toks, lp)

    def _owed_chunk(self):
        """Every row's owed pairs, right-aligned in one (B, S) chunk, and their lengths."""
        taken = [r.owed.take() if r.owed is not None and len(r.owed) else None for r in self.rows]
        lengths = [0 if t is None else t[0].shape[1] for t in taken]
        if len(taken) == 1:
            return taken[0][0], taken[0][1], lengths
        S = max(lengths)
        ref = next(t[0] for t in taken if t is not None)
        hs, ts = [], []
        for t, n in zip(taken, lengths):
            pad_h = mx.zeros((1, S - n) + ref.shape[2:], ref.dtype)
            pad_t = mx.zeros((1, S - n), mx.uint32)
            hs.append(pad_h if t is None else mx.concatenate([pad_h, t[0]], axis=1))
            ts.append(pad_t if t is None else mx.concatenate([pad_t, t[1].astype(mx.uint32)], axis=1))
        return mx.concatenate(hs), mx.concatenate(ts), lengths

    def _noises(self, groups, k: int, V: int):
        """Per group: the target's noise at the k+1 positions and the drafts' (None: greedy);
        coupled drafts share the target's noise."""
        target = [self._noise(g, k + 1, TARGET, V) for g in groups]
        draft = [None if n is None else n[:, :k] if g.params.coupled
                 else self._noise(g, k, DRAFT, V) for g, n in zip(groups, target)]
        return target, draft

    def _drafter_tokens(self, plans: List[DraftPlan], k: int):
        """Drafter tokens (B, k) (0 where none) and where they are (B, k) bool; None if none."""
        if not any(p.fixed for p in plans):
            return None, None
        fixed = [p.fixed + [0] * (k - len(p.fixed)) for p in plans]
        lengths = mx.array([len(p.fixed) for p in plans])
        return mx.array(fixed, mx.uint32), mx.arange(k)[None] < lengths[:, None]

    def _draft_head(self, J: int, k: int, groups, transforms, fixed, where, noises: list):
        """Chain the head J of the k positions (``drafters/mtp_head.py``; drafts at position
        j: the fed token where ``where`` says (a row drafter's or the block drafter's), else
        the head's pick). Returns drafts per position (B,) and each group's filtered draft
        log-probs per position; ``noises`` gets the step's noises at the first draw."""
        return self.head.propose(self.model, self.mtp_cache, self._owed_chunk(), J,
                                 self._draw(groups, transforms, k, noises), transforms, fixed,
                                 where)

    def _draw(self, groups, transforms, k: int, noises: list):
        """``draw(logits (B, 1, V), j, drafts)``: picks (B,), each group's log q (b, V)."""
        def draw(logits, j, drafts):
            lq = log_softmax(transforms(logits, j, drafts)[:, 0])  # (B, V): as verify row j
            if not noises:  # per position: coupled drafts share the target's noise
                noises.append(self._noises(groups, k, lq.shape[-1]))
            qs = self._per_group(groups, lambda g: self._filter(g, lq))
            picks = [sample(q, None if n is None else n[:, j]) for q, n in zip(qs, noises[0][1])]
            return self._merge(groups, picks), qs

        return draw

    def _draft_logprobs(self, g: _Group, gi: int, draft_lps, where):
        """The group's head draft log q (b, J, V) (None: no head pass) and where its drafts
        are drafter tokens (b, k) (None: nowhere); those are deterministic proposals,
        verified in index form (``sampling.verify``)."""
        head = mx.stack([lps[gi] for lps in draft_lps], axis=1) if draft_lps else None
        return head, None if where is None else g.take(where)

    def _check_drafting(self, plans: List[DraftPlan]):
        for r, p in zip(self.rows, plans):
            if p.head and not r.can_draft():
                raise ValueError(f"row {r.key!r} cannot draft (no MTP pairs owed)")

    def _propose(self, k: int, plans: List[DraftPlan], groups, transforms) -> _Proposal:
        """1. The drafts (B, k): a row's drafter or block-drafter token where its plan has
        one, else the head's, chained J times (its first call also writes every row's owed
        pairs) and fed those tokens. Block drafts come first, with their own q."""
        fixed, where = self._drafter_tokens(plans, k)  # deterministic: verified in index form
        J = max((p.total for p in plans if p.head), default=0)
        noises, block, fed = [], None, where  # noises: made at the first draw of any source
        if any(p.block for p in plans):
            block = block_context.draft(self.model, self.cache, self.rows, plans, k,
                                        self._draw(groups, transforms, k, noises),
                                        lambda qs: self._merge(groups, qs))
            fixed, fed = block.feed(fixed, where)
        drafts, draft_lps = [], []
        if J:
            drafts, draft_lps = self._draft_head(J, k, groups, transforms, fixed, fed, noises)
        else:
            for r in self.rows:  # the head rests this step, as in a plain step
                if r.owed is not None and r.schedule is None:
                    r.owed.trim()
        drafts = [d.astype(mx.uint32) for d in drafts] + [fixed[:, j] for j in range(J, k)]
        if block is not None:
            draft_lps = block.with_q(draft_lps, groups)
        drafts, = self.model.share(mx.stack(drafts, axis=1))  # what every rank verifies
        return _Proposal(drafts, draft_lps, where, J, noises[0] if noises else None)

    def _verify(self, drafts: mx.array, transforms):
        """2. One trunk pass over every row's ``[y, d_1..d_k]``: the target's log-probs
        (B, k+1, V) and the hiddens the accepted positions owe the head."""
        inputs = mx.concatenate([mx.stack([r.y for r in self.rows]), drafts], axis=1)
        prepare_chunk(self.cache, inputs.shape[1])
        h_norm, h_mtp = block_context.trunk(self.model, inputs, self.cache, capture=True, defer=True)
        return log_softmax(transforms(self.model.logits(h_norm), 0, drafts)), h_mtp

    def _accept(self, groups, raw: mx.array, proposal: _Proposal, ks: List[int]):
        """3. Accepted counts (B,) and next tokens (B,), per group of rows verifying alike."""
        drafts, draft_lps, where = proposal.drafts, proposal.draft_lps, proposal.where
        k, V = drafts.shape[1], raw.shape[-1]
        noises = proposal.noises if proposal.noises is not None else self._noises(groups, k, V)
        target_noise = noises[0]

        def accept(g, gi):
            target = self._filter(g, raw)
            limit = [ks[b] for b in g.rows]
            limit = None if min(limit) == k else mx.array(limit)
            d = g.take(drafts)
            if g.params.greedy or g.params.coupled:
                return verify(target, d, None, target_noise[gi], limit=limit)
            q, fixed = self._draft_logprobs(g, gi, draft_lps, where)
            sel = [self.rows[b] for b in g.rows]
            u = uniform(position_keys([r.sampler.seed for r in sel], [r.n_out for r in sel],
                                      k, ACCEPT))
            return verify(target, d, q, target_noise[gi], u, limit=limit, deterministic=fixed)

        results = [self._on_row(g.rows[0], lambda: accept(g, gi)) for gi, g in enumerate(groups)]
        return self.model.share(self._merge(groups, [n for n, _ in results]),
                                self._merge(groups, [t for _, t in results]))
