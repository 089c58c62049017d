"""The driver: any number of sequences (B >= 1), one trunk forward per step.

Sequences prefill on their own (``sequence.Sequence``) and join with ``add``; they
leave with ``remove`` at any step. The first row's caches are adopted as they are;
later rows are merged in (``merge``), leaving rows are filtered out (``filter``). A
joining row is checked first (each cache's ``check_joins``: kinds, shapes, dtypes, no
sync): one that does not fit fails alone (``BatchJoinError``) and leaves the batch as it
was. Values are checked where a state comes from outside (``session_store``), not here:
a join must not read a whole cache and sync for every request.
Each step is ``step.DecodeBatch`` over every row: the MTP head drafts for all rows,
one trunk pass verifies them, and each row accepts its own number of drafts.

K per row comes from a ``DraftPolicy`` (``choose_ks``), up to the row's own cap
(``Row.max_k``, the one place K is stored), or from the caller (``step(ks=)``: a
distributed follower runs the K its leader chose). The driver records each step
once (``_record``): its time, from the previous step's read to its own (from its
launch when the caller ran other work in between; unknown for a driver's first step;
why this clock: ``costs.py``), shape and acceptance go to the policy, whose ``costs``
is the one step-cost table (the draft-source chooser reads it too), and its tokens to
the model's draft-vocabulary tuner. Plain steps may be launched ahead (``overlap``:
before the previous step's token is read, as mlx-lm does). With more than one row a
step is checkpointed and a failed step is undone and fails one row (``BatchStepError``).
"""

from __future__ import annotations

import time
from typing import Dict, Hashable, List, Optional, Sequence

import mlx.core as mx

from ..models.cache.kv import restore_caches, snapshot_caches
from ..models.cache.quantized import draft_room
from . import block_context
from .policy import DraftPolicy
from .sequence import Sequence as DecodeSequence
from .step import DecodeBatch, Row, RowError, StepOutput


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


class BatchJoinError(ValueError):
    """Row ``key``'s caches cannot join the batch (``cause`` says why); the batch is as it
    was before the join."""

    def __init__(self, key, cause: Exception):
        super().__init__(f"row {key!r} cannot join the batch: {cause}")
        self.key, self.cause = key, cause


class BatchDecoder:
    def __init__(self, model, mtp: bool = True, adaptive: bool = True,
                 policy: Optional[DraftPolicy] = None, overlap: bool = False):
        """``mtp``: the head (it keeps the rows' MTP caches) or the model's block drafter
        drafts for this batch's rows; False: rows join without them and draft from the
        context at most."""
        self.model = model
        self.mtp = mtp and (model.num_mtp_layers > 0 or model.block_drafter is not None)
        self.adaptive = adaptive
        self.policy = policy if policy is not None else DraftPolicy(adaptive)
        self.overlap = overlap
        self.core = DecodeBatch(model, [], None, None)
        self._ahead = None  # (pending, checkpoint) of a plain step launched ahead
        self._next_ks: Optional[List[int]] = None  # chosen while deciding to launch ahead
        self._plain_run: List[float] = []  # overlapped plain steps' times, not yet recorded
        self._last_read: Optional[float] = None  # when the last step was read

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
    def add(self, key: Hashable, seq: DecodeSequence, share: bool = False):
        """Join a sequence whose prompt ``seq`` has prefilled. The batch takes its
        caches (``share``: the sequence keeps them too; only as the first row).

        Atomic: the row is checked first (``_check_joins``); a row that does not fit
        raises ``BatchJoinError`` naming ``key`` and the batch is unchanged."""
        core = self.core
        self._drop_ahead()
        if share and core.rows:
            raise ValueError("a sequence shares its caches only as a batch's only row")
        # a row drafting with no MTP cache: a block drafter's on a model without a head
        use_mtp = self.mtp and (seq.mtp_cache is not None or seq.row.max_k > 0)
        mtp = seq.mtp_cache if use_mtp and seq.mtp_cache is not None else \
            self.model.make_mtp_cache()
        self._check_joins(key, seq.cache, mtp if self.mtp else [])
        row = seq.row
        row.key = key
        if not use_mtp:
            row.max_k, row.owed, row.schedule = 0, None, None
        if not core.rows:
            core.cache = seq.cache if share else list(seq.cache)
            core.mtp_cache = (mtp if share else list(mtp)) if self.mtp else None
        else:
            core.cache = [type(a).merge([a, c]) for a, c in zip(core.cache, seq.cache)]
            if self.mtp:
                core.mtp_cache = [type(a).merge([a, c]) for a, c in zip(core.mtp_cache, mtp)]
        core.rows.append(row)
        if not share:
            seq.release()

    def _check_joins(self, key, cache: list, mtp: list):
        """Raise ``BatchJoinError`` naming ``key`` unless the row's caches fit beside the
        batch's (an empty batch: beside the model's new caches); run before any cache
        changes, so a refused row leaves the batch as it was."""
        core = self.core
        if core.rows:
            ours, ours_mtp = core.cache, core.mtp_cache or []
        else:
            ours = block_context.make_cache(self.model)
            ours_mtp = self.model.make_mtp_cache() if self.mtp else []
        try:
            for name, a, b in (("trunk", ours, cache), ("MTP", ours_mtp, mtp)):
                if len(b) != len(a):
                    raise ValueError(f"{len(b)} {name} caches, the model has {len(a)}")
                for i, (c, r) in enumerate(zip(a, b)):
                    try:
                        c.check_joins(r)
                    except ValueError as e:
                        raise ValueError(f"{name} cache {i}: {e}") from None
        except ValueError as e:
            raise BatchJoinError(key, e) from e

    def remove(self, key: Hashable):
        core = self.core
        keep = [i for i, r in enumerate(core.rows) if r.key != key]
        if len(keep) == len(core.rows):
            return
        self._drop_ahead()
        core.rows = [core.rows[i] for i in keep]
        if not core.rows:
            core.cache = core.mtp_cache = None
            return
        for c in core.cache + (core.mtp_cache or []):
            c.filter(keep)

    # -- decoding ----------------------------------------------------------
    def choose_ks(self, load: int = 0) -> List[int]:
        """Drafts per row for the next step. ``load``: rows expected soon (prompts being
        processed or queued); K is chosen for that batch size, and by a wider margin
        while they wait, since a slower step delays them too."""
        if self._next_ks is not None:
            ks, self._next_ks = self._next_ks, None
            return ks
        rows = self.core.rows
        B = len(rows)
        ks = (self.policy.row_ks(rows, max(B, load), load > B, self._contexts()) if self.mtp
              else [0] * B)
        room = draft_room(self.core.cache or [])  # a verify must not cross --quantized-kv-start
        return ks if room is None else [min(k, room) for k in ks]

    def step(self, load: int = 0, ks: Optional[Sequence[int]] = None,
             interleaved: bool = False) -> Dict[Hashable, StepOutput]:
        """One step for every row (``ks``: drafts per row; default ``choose_ks(load)``).
        ``interleaved``: the caller may have run other work since the last step (the
        server's prompt chunks), so this step is timed from its launch."""
        rows = list(self.core.rows)
        if not rows:
            return {}
        chosen_here, snap = ks is None, None
        try:
            if self._ahead is not None:
                (pending, snap), self._ahead = self._ahead, None
                start = self._last_read
            else:
                ks = self.choose_ks(load) if ks is None else list(ks)
                snap = self._checkpoint()
                start = time.perf_counter() if interleaved else self._last_read
                pending = self.core.launch(ks, self.policy.costs)
            if chosen_here:  # a caller's K is for this step only: nothing ahead
                self._launch_ahead(pending, load)
            outs = self.core.finish(pending)
        except Exception as e:
            self._ahead = self._next_ks = None
            self._plain_run = []
            if snap is not None:
                self._restore(snap)
            if isinstance(e, RowError):
                raise BatchStepError(e.key, e.cause) from e.cause
            victim = max(range(len(rows)), key=self._context)
            raise BatchStepError(rows[victim].key, e) from e
        now = self._last_read = time.perf_counter()
        self._record(outs, None if start is None else now - start)
        return {r.key: o for r, o in zip(rows, outs)}

    def _launch_ahead(self, pending, load: int):
        """Start the next plain step before reading this one (plain steps only, and not
        with a grammar row: its next mask needs this step's token)."""
        if (not self.overlap or pending.k != 0
                or any(r.sampler.grammar is not None for r in self.core.rows)
                or any(r.drafter is not None and r.drafter.has_proposal() for r in self.core.rows)):
            return
        self._next_ks = self.choose_ks(load)
        # K drafts from the head: a row whose drafter drafts alone (``block``) asked above
        if not any(k for k, r in zip(self._next_ks, self.core.rows)
                   if r.drafter is None or r.drafter.uses_head):
            ks, self._next_ks = self._next_ks, None
            snap = self._checkpoint()
            self._ahead = (self.core.launch(ks, self.policy.costs), snap)

    def finish_pending(self):
        """Wait for a plain step launched ahead (before timing or reusing the model)."""
        if self._ahead is not None:
            mx.eval(self._ahead[0].tokens)

    def _drop_ahead(self):
        """Undo a plain step launched ahead, not yet read (rows are about to change)."""
        if self._ahead is None:
            return
        (_, snap), self._ahead = self._ahead, None
        self._plain_run = []
        if snap is None:
            raise RuntimeError("read the step launched ahead before rows join or leave")
        self._restore(snap)

    def _record(self, outs: List[StepOutput], seconds: Optional[float]):
        """Record the step once: its shape, time and each row's drafts and accepted
        count for the policy, its tokens for the draft-vocabulary tuner.

        A plain step read after its successor was launched has no cost of its own:
        launching the successor waited for most of its work on the CPU (on a GPU the two
        overlap), so the first step of such a chain reads as two and the last as almost
        nothing. Each counts the mean of its chain (recorded when the chain ends, or two
        at a time while it goes on, the newest step held back so the next pair stays
        together). Timed one by one, the policy's median swung between the two and
        drafting paused for two plain steps after each draft."""
        self._tune_draft_vocab(outs)
        B, k = len(outs), max(o.num_drafted for o in outs)
        if k or seconds is None or (self._ahead is None and not self._plain_run):
            heads = [o.head_drafted for o in outs]
            head_passes = max((o.num_drafted for o, h in zip(outs, heads) if h), default=0)
            self.policy.record_step(B, k, seconds, [o.num_accepted for o in outs], heads,
                                    starts=[o.lookup_drafted + o.block_drafted for o in outs],
                                    head_passes=head_passes, contexts=self._contexts(),
                                    block=self._block_passes(outs))
            return
        self._plain_run.append(seconds)
        if self._ahead is None:  # the chain ends here
            group, self._plain_run = self._plain_run, []
        elif len(self._plain_run) >= 3:
            group, self._plain_run = self._plain_run[:-1], self._plain_run[-1:]
        else:
            return
        for _ in group:
            self.policy.record_step(B, 0, sum(group) / len(group), [0] * B, [0] * B)

    def _block_passes(self, outs) -> int:
        """The block drafter's passes in a step: one, or one per draft of its longest row
        for an autoregressive drafter (EAGLE-3); 0 if it did not run."""
        n = max(o.block_drafted for o in outs)
        return n if n and self.model.block_drafter.spec.autoregressive else int(n > 0)

    def _tune_draft_vocab(self, outs: List[StepOutput]):
        """The default draft vocabulary re-sizes from the tokens emitted, the target's tokens
        where a head draft was rejected (the token emitted there) and what steps cost
        (``vocab_auto``)."""
        tuner = self.model.draft_vocab_tuner
        if tuner is not None:
            rows = [(r, o.tokens[o.num_accepted]) for r, o in zip(self.core.rows, outs)
                    if o.num_drafted - o.head_drafted <= o.num_accepted < o.num_drafted]
            lost = tuner.observe([t for o in outs for t in o.tokens], self.policy.costs,
                                 [t for _, t in rows])
            for (r, _), n in zip(rows, lost):
                r.stats.draft_vocab_lost += int(n)

    def _context(self, b: int) -> int:
        return self._contexts()[b]

    def _contexts(self) -> List[int]:
        """Each row's context length (0 each without a KV cache to count it)."""
        kv = next((c for c in self.cache or [] if c.is_trimmable()), None)  # counts per row
        return kv.lengths() if kv is not None else [0] * len(self.core.rows)

    def _checkpoint(self):
        """What a step changes, by reference; None for one row (its failure fails the
        whole batch: nothing to keep)."""
        if len(self.core.rows) < 2:
            return None
        caches = snapshot_caches(self.cache + (self.mtp_cache or []))
        rows = [(r, r.y, r.n_out, None if r.owed is None else r.owed.copy(),
                 None if r.sampler.history is None else r.sampler.history.state(),
                 None if r.sampler.grammar is None else r.sampler.grammar.state())
                for r in self.rows]
        return caches, rows

    def _restore(self, snap):
        caches, rows = snap
        restore_caches(caches)
        for r, y, n_out, owed, history, grammar in rows:
            r.y, r.n_out, r.owed = y, n_out, owed
            if history is not None:
                r.sampler.history.restore(history)
            if grammar is not None:  # commits of rows before a failing one
                r.sampler.grammar.restore(grammar)

    def calibrate(self, max_k: int, batch_sizes=(1, 4, 16), steps: int = 3,
                  prompt_len: int = 16, budget: Optional[float] = None) -> float:
        """Time steps of dummy batches at a few (batch size, K <= ``max_k``) cells before
        serving.

        Gives ``DraftPolicy`` a cost model from the start, so live traffic does not
        pay for exploring it. Only costs are recorded (dummy drafts say nothing about
        acceptance). Needs an empty batch; stops once ``budget`` seconds are spent;
        returns the seconds spent.
        """
        if not self.model.num_mtp_layers or not self.mtp or not max_k or not self.adaptive \
                or self.rows:  # its dummy rows draft from the head
            return 0.0
        t_start = time.perf_counter()
        ks = sorted({0, 1, max_k})
        prompt = [(7 * j + 3) % self.model.text.args.vocab_size for j in range(prompt_len)]

        def spent() -> bool:
            return budget is not None and time.perf_counter() - t_start > budget

        for B in batch_sizes:
            for i in range(B):
                seq = DecodeSequence(self.model, max_k, adaptive=False)
                seq.prefill(prompt)
                self.add(("calibration", i), seq)
            for k in ks:
                read = None  # timed read to read, as live steps (costs.py)
                for j in range(steps + 1):  # the first step of a shape pays one-off costs
                    if spent():
                        break
                    self.core.step([k] * B, self.policy.costs)
                    now = time.perf_counter()
                    if j:
                        self.policy.costs.observe(B, k, k, now - read)
                    read = now
            for i in range(B):
                self.remove(("calibration", i))
            if spent():
                break
        return time.perf_counter() - t_start

    def would_draft(self, batch_size: int, max_k: int) -> bool:
        """Whether a batch of this size drafts now for a row of cap ``max_k``: only then
        does a joining prompt run through the MTP head (paused, the head's history starts
        after it)."""
        return self.mtp and self.policy.would_draft(batch_size, max_k)
