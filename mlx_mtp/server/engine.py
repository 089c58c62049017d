"""The scheduler: continuous batching with per-sequence MTP speculative decoding.

One background thread owns the model. HTTP handlers ``submit`` an ``EngineRequest`` (with a
thread-safe ``on_event`` callback) and ``cancel`` it when the client goes away. Every
scheduler iteration (``Engine.step``):

1. takes new submissions and drops cancelled requests;
2. admits waiting requests, up to ``max_concurrency`` and the memory budget (``memory_budget``),
   restoring the longest cached prompt prefix into the new sequence's decoder;
3. runs prompt chunks, in turns by prefill time: while streams decode, all prompts together
   and the streams each keep half of the time (``fair_share.py``); otherwise chunks of
   ``prefill_step_size``. Prefix-cache snapshots are taken at chunk ends that fall on
   reusable boundaries;
4. runs one decode step for each decoding sequence (``_decode_round``).

A sequence's prompt runs through its own ``Sequence``; then it joins the ``BatchDecoder``:
one trunk forward per step for all decoding sequences, each accepting its own number of
drafts and rolling back its own state, so greedy output does not depend on what else is
running. The batch's ``DraftPolicy`` picks K per step; while it pauses drafting, joining
prompts skip the MTP head.

Events sent to ``on_event`` (``events.py``, shaped by ``output.py``): ``Admitted`` when the
request joins the batch, ``Delta`` per step, then exactly one of ``Done`` or ``Failed``.
A cancelled request gets nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Deque, List, Optional

import mlx.core as mx

from ..decode import step_costs
from ..decode.batch import BatchDecoder, BatchStepError
from ..decode.draft_source import DraftSources
from ..decode.sequence import Sequence
from ..decode.speculative import SpecStats, StepOutput
from ..models.io.layout import check_acceptance
from .metrics import PeriodicLog, ServerMetrics
from .distributed import StepSync
from .events import Admitted, EngineRequest, EngineUnavailable, Failed, emit
from .fair_share import FairShare
from .memory_budget import MemoryBudget
from .output import RowOutput, failure
from .prefix_cache import PrefixCache
from .prompt_chunks import ChunkGrid

log = logging.getLogger("mlx_mtp.server")


class _Seq:
    """Engine-side state of one admitted request."""

    def __init__(self, req: EngineRequest, dec: Sequence, output: RowOutput):
        self.req = req
        self.dec = dec
        self.output = output  # holds n_cached: the prompt tokens the prefix cache gave
        self.restored = None  # the key of the prompt-cache entry restored, if any
        self.prefilling = True
        self.mtp_enabled = dec.mtp_cache is not None
        self.t_admit = time.perf_counter()
        self.t_prefill_done: Optional[float] = None
        self.t_first: Optional[float] = None
        self.t_last: Optional[float] = None
        n = len(req.prompt) - 1
        self.boundaries = sorted({b for b in req.boundaries if output.n_cached < b <= n})


class Engine:
    def __init__(
        self,
        model,
        tokenizer,
        *,
        num_draft_tokens: int = 3,
        adaptive: bool = True,
        max_concurrency: int = 16,
        prefill_step_size: int = 512,
        max_batched_tokens: int = 128,
        prefix_cache: Optional[PrefixCache] = None,
        metrics: Optional[ServerMetrics] = None,
        max_queue: int = 1024,
        model_name: str = "model",
        log_interval: float = 10.0,
        calibrate: bool = True,
        sync: Optional[StepSync] = None,
        draft_sources: Optional[DraftSources] = None,
        memory: Optional[MemoryBudget] = None,
    ):
        for name, value in (("prefill_step_size", prefill_step_size),
                            ("max_batched_tokens", max_batched_tokens),
                            ("max_concurrency", max_concurrency)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1")
        self.model = model
        self.tokenizer = tokenizer
        self.has_mtp = model.num_mtp_layers > 0
        drafts = self.has_mtp or model.block_drafter is not None  # a block drafter: no head
        self.num_draft_tokens = num_draft_tokens if drafts else 0  # a request's default
        self.adaptive = adaptive
        self.max_concurrency = max_concurrency
        self.prefill_step_size = prefill_step_size
        self.max_batched_tokens = max_batched_tokens
        self.chunks = ChunkGrid(prefill_step_size)
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache(0, 0)
        self.metrics = metrics or ServerMetrics(model_name)
        self.model_name = model_name
        self.metrics.num_requests_running.fn = lambda: len(self.running)
        self.metrics.num_requests_waiting.fn = lambda: len(self.waiting) + len(self._incoming)
        self.max_queue = max_queue
        self.eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
        self.waiting: Deque[EngineRequest] = deque()
        self.running: List[_Seq] = []
        self._incoming: Deque[EngineRequest] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: Optional[threading.Thread] = None
        self._park = threading.Event()
        self._stopped = threading.Event()
        self.alive = False
        self.periodic = PeriodicLog(log_interval)  # vLLM's log line
        self.calibrate = calibrate  # time a few batch shapes before serving (start())
        # Distributed serve: the other ranks replay what this engine does to the model.
        self.sync = sync or StepSync()
        self.total_stats = SpecStats()
        # Decoding sequences share one batched forward per step (MTP included).
        self.batch = BatchDecoder(model, self.num_draft_tokens > 0, adaptive)
        self.fair = FairShare()
        # Context drafts (--draft-source, a request's draft_source): one cost table for all.
        self.draft_sources = draft_sources or DraftSources("mtp", adaptive=adaptive)
        self.memory = (memory or MemoryBudget()).report_to(self)  # --memory-budget

    # -- interface used by the HTTP layer (any thread) ----------------------------
    def start(self):
        self._thread = threading.Thread(target=self._run, name="mlx-mtp-engine", daemon=True)
        self.alive = True
        self._thread.start()

    def submit(self, req: EngineRequest):
        with self._cv:
            if self._stopping:
                raise EngineUnavailable("The server is shutting down.", "shutting_down")
            if self.sync.lost:
                raise EngineUnavailable(self.sync.lost, "distributed_rank_lost")
            # Requests that will start at once (free slots) are not waiting.
            free = max(0, self.max_concurrency - len(self.running))
            if len(self._incoming) + len(self.waiting) - free >= self.max_queue:
                raise OverflowError(
                    f"Too many requests waiting ({self.max_queue}); try again later.")
            self.memory.check(req, self)  # OverBudget (429): it never fits
            self._incoming.append(req)
            self._cv.notify()

    def cancel(self, req: EngineRequest):
        req.cancelled = True
        with self._cv:
            self._cv.notify()

    def shutdown(self, timeout: float = 10.0):
        """Fail everything still queued or running, then stop the loop."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self.sync.shutting_down()
        if self._thread is not None and not self.sync.lost:  # lost: it may sit in a collective
            self._stopped.wait(timeout)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self._incoming)

    # -- the loop -------------------------------------------------------------------
    def _calibrate(self):
        # Batch sizes whose costs an earlier run on this machine stored are not timed again.
        sizes = step_costs.uncalibrated(self.model, self.batch.policy.costs, self.max_concurrency,
                                        self.num_draft_tokens)
        try:
            self.sync.calibrating(sizes)
            seconds = self.batch.calibrate(self.num_draft_tokens, sizes) if sizes else 0.0
            if seconds:
                step_costs.save(self.model, self.batch.policy.costs)
        except Exception as e:  # never fatal: the policy then learns from live steps
            if self.sync.group_lost(e):
                return
            log.exception("MTP step-cost calibration failed")
            self.batch = BatchDecoder(self.model, self.batch.mtp, self.adaptive)
            return
        if seconds:
            log.info("MTP step costs calibrated in %.1f s; draft policy at %s", seconds,
                     self.batch.policy.describe(self.max_concurrency, self.num_draft_tokens))

    def _run(self):
        if self.calibrate:  # this machine's stored step costs, or timed
            self._calibrate()
        while True:
            with self._cv:
                while (not self._stopping and not self._incoming and not self.waiting
                       and not self.running):
                    if not self._cv.wait(self.sync.idle_seconds):
                        break  # an idle iteration: the other ranks get a heartbeat
                if self._stopping:
                    break
            try:
                self.step()
            except Exception as e:  # a bug outside per-request handling: fail the batch
                if self.sync.group_lost(e):
                    continue
                log.exception("Scheduler iteration failed")
                self._fail_all(500, f"Internal error in the scheduler: {e}")
                mx.clear_cache()
        self.sync.stopped()
        self.alive = False
        if self.calibrate:  # what live steps measured (context drafts too), for the next start
            step_costs.save(self.model, self.batch.policy.costs)
        self._fail_all(503, "The server is shutting down.", code="shutting_down")
        self._stopped.set()
        # MLX aborts the process at exit ("terminate called without an active
        # exception") if a thread that ran model code has finished, so this
        # daemon thread parks instead of returning.
        self._park.wait()

    def step(self) -> bool:
        """One scheduler iteration; returns whether there was work."""
        with self._cv:
            while self._incoming:
                self.waiting.append(self._incoming.popleft())
        self._drop_cancelled()
        self._admit()
        self._prefill_round()
        self._decode_round()
        self.sync.end_step()
        self.periodic.maybe_log(len(self.running), self.num_waiting,
                               lambda: self.batch.policy.describe(self._load(),
                                                                  self.num_draft_tokens)
                               if self.batch.mtp else None)
        return bool(self.running or self.waiting)

    # -- admission ------------------------------------------------------------------
    def _drop_cancelled(self):
        if any(r.cancelled for r in self.waiting):
            kept = deque()
            for r in self.waiting:
                if r.cancelled:
                    self.metrics.request_failure.inc(reason="abort")
                else:
                    kept.append(r)
            self.waiting = kept
        for seq in [s for s in self.running if s.req.cancelled]:
            self._remove(seq)
            self.metrics.request_failure.inc(reason="abort")

    def _admit(self):
        self.memory.settle(self)
        while (self.waiting and len(self.running) < self.max_concurrency
               and not self.memory.waits(self, self.waiting[0])):  # the head waits: FIFO
            req = self.waiting.popleft()
            if req.cancelled:
                self.metrics.request_failure.inc(reason="abort")
                continue
            try:
                seq = self._make_seq(req)
                self.running.append(seq)
                self._emit(req, Admitted(seq.output.n_cached))
            except Exception as e:
                log.exception("Could not start request %s", req.request_id)
                self._emit(req, failure(e))

    def _load(self) -> int:
        """Sequences in the batch soon: running (decoding or in prefill) and queued."""
        return min(len(self.running) + len(self.waiting), self.max_concurrency)

    def _make_seq(self, req: EngineRequest, use_cache: bool = True) -> _Seq:
        k, drafter = self.draft_sources.for_row(self.num_draft_tokens, req.num_draft_tokens,
                                                req.draft_source, self.has_mtp)
        dec = Sequence(self.model, k, req.sampling, adaptive=self.adaptive,
                       prefill_step_size=self.prefill_step_size,
                       grammar=None if req.grammar is None else req.grammar.start(),
                       drafter=drafter, images=req.encoded_images(self.model))
        entry, pc = None, self.prefix_cache
        if use_cache and req.cache_prompt and pc.enabled:
            entry = pc.restore(dec, req.prefix_key)
            self.metrics.prefix_cache_queries.inc(len(req.prompt))
        n_cached = 0 if entry is None else entry.state.n_processed
        self.metrics.prefix_cache_hits.inc(n_cached)
        seq = _Seq(req, dec, RowOutput(self.tokenizer, req, self.eos, n_cached))
        seq.restored = None if entry is None else entry.key
        self.sync.admitted(seq, entry)
        return seq

    # -- prompt processing ----------------------------------------------------------
    def _prefill_budget(self, prompt: str, spent: int) -> tuple[int, bool]:
        """(tokens for the prompt's next chunk, 0: none now; may it end below a grid cell):
        while streams decode, ``FairShare.budget`` (vLLM's chunked prefill, sized by time) in
        ``max_batched_tokens`` less their rows (1 + K each); else ``prefill_step_size``."""
        n_decoding = sum(1 for s in self.running if not s.prefilling)
        if not n_decoding:
            left = self.prefill_step_size - spent
            return (left if left >= self.chunks.floor else 0), False
        left = self.max_batched_tokens - n_decoding * (1 + self.num_draft_tokens) - spent
        if left < self.chunks.floor:  # a rest under the floor waits
            return 0, False
        least = self.fair.floor(self.chunks.grid, self.chunks.floor, prompt)
        split = self.fair.floor(self.chunks.grid, 0, prompt) < self.chunks.grid  # long cells
        return self.fair.budget(left, least, self.prefill_step_size, prompt), split

    def _prefill_round(self):
        waiting = {s.req.request_id: s for s in self.running
                   if s.prefilling and not s.req.cancelled}
        spent, competing = 0, any(not s.prefilling for s in self.running)
        # One share for all prompts, in turns by prefill time (FairShare.order): a short
        # request joins the batch at once and no long prompt waits for another.
        for key in self.fair.order({k: len(s.req.prompt) - 1 - s.dec.n_processed
                                    for k, s in waiting.items()}):
            while waiting[key].prefilling:
                n, split = self._prefill_budget(key, spent)
                if not n:
                    return  # the prompt whose turn it is waits, and those after it
                start = time.perf_counter()
                try:
                    n = self._prefill_chunk(waiting[key], n, below_grid=split)
                except Exception as e:
                    self._fail(waiting[key], e)
                    break
                spent += n
                self.fair.prefill_ran(time.perf_counter() - start, n, competing, key)

    def _prefill_chunk(self, seq: _Seq, max_tokens: int, below_grid: bool = False) -> int:
        """Process the next chunk of the prompt (about ``max_tokens``, on the grid of
        ``prompt_chunks``); returns its length."""
        prompt, dec = seq.req.prompt, seq.dec
        n = len(prompt) - 1
        start = dec.n_processed
        seg_start = max([seq.output.n_cached] + [b for b in seq.boundaries if b <= start])
        seg_end = min([n] + [b for b in seq.boundaries if b > start])
        end = self.chunks.end(start, seg_start, seg_end, max_tokens, below_grid)
        # Sequence.prefill continues after n_processed and stops at the last
        # token it is given, which becomes the pending input: passing the
        # prompt up to ``end`` runs exactly tokens [start, end).
        # The MTP head reads the chunk only if the batch the sequence joins drafts now.
        run_head = dec.mtp_cache is None or self.batch.would_draft(
            max(len(self.batch) + 1, self._load()), dec.row.max_k)
        self.sync.prefill(seq, end, run_head)
        dec.prefill(prompt[: end + 1], run_head=run_head)
        if end in seq.boundaries:
            self._store_prefix(seq, end)
        if end == n:
            seq.prefilling = False
            seq.t_prefill_done = time.perf_counter()
            seq.mtp_enabled = dec.mtp_cache is not None
            self.batch.add(seq.req.request_id, dec)
            self.metrics.prompt_tokens.inc(len(prompt))
            self.metrics.prompt_len.observe(len(prompt))
        return end - start

    def _store_prefix(self, seq: _Seq, end: int):
        pc, key = self.prefix_cache, seq.req.prefix_key[: end + 1]
        has_mtp = seq.dec.mtp_cache is not None
        if not (seq.req.cache_prompt and pc.enabled and pc.adds(key, has_mtp)):
            return
        state = seq.dec.snapshot()
        mx.eval(state.arrays())
        pc.store(key, state, state.nbytes, has_mtp)
        self.sync.stored(seq, key, state)

    # -- decoding -------------------------------------------------------------------
    def _decode_round(self):
        """One batched decode step for every decoding sequence.

        Each row drafts, verifies and rolls back on its own inside one trunk
        forward (``BatchDecoder``). When the step fails, the batch is restored
        and only the row it names fails; the others go on at the next step.
        """
        decoding = [s for s in self.running if not s.prefilling and not s.req.cancelled]
        if not decoding:
            return
        start = time.perf_counter()
        try:
            self._decode_step(decoding)
        finally:  # prompts still in prefill compete with this step
            self.fair.decode_ran(time.perf_counter() - start,
                                 any(s.prefilling for s in self.running))

    def _decode_step(self, decoding: List[_Seq]):
        try:
            ks = self.batch.choose_ks(self._load())
            self.sync.decoding(ks)  # the K every rank runs
            outs = self.batch.step(ks=ks, interleaved=True)
        except BatchStepError as e:
            for seq in decoding:
                if seq.req.request_id == e.key:
                    self._fail(seq, e.cause)
            return
        for seq in decoding:
            out = outs.get(seq.req.request_id)
            if out is None:
                continue
            try:
                self._consume(seq, out)
            except Exception as e:
                self._fail(seq, e)

    def _consume(self, seq: _Seq, out: StepOutput):
        now = time.perf_counter()
        req = seq.req
        by_source = (out.lookup_drafted, out.lookup_accepted, out.block_drafted,
                     out.block_accepted)
        self.metrics.record_step(out.num_drafted, out.num_accepted, *by_source)
        used, delta = seq.output.add(out)
        self.metrics.generation_tokens.inc(len(used))
        self.periodic.record(out.num_drafted, out.num_accepted, len(used), *by_source)

        # Latency metrics: the step's time spread over the tokens it produced.
        if seq.t_first is None:
            seq.t_first = now
            self.metrics.ttft.observe(now - req.arrival)
        elif used:
            dt = (now - seq.t_last) / len(used)
            for _ in used:
                self.metrics.itl.observe(dt)
        seq.t_last = now

        if delta is not None:
            self._emit(req, delta)
        if seq.output.finish_reason is not None:
            self._finish(seq)

    def _finish(self, seq: _Seq):
        now = time.perf_counter()
        req, stats = seq.req, seq.dec.stats
        self._remove(seq)
        self.total_stats.merge(stats)
        t = self.total_stats  # the head's drafts only: context drafts say nothing about it
        check_acceptance(t.head_draft_tokens, t.head_accepted_tokens, self.model_name)
        prefill_done = seq.t_prefill_done or now
        done = seq.output.done(stats, seq.mtp_enabled, prefill_done - seq.t_admit,
                               now - prefill_done)
        m = self.metrics
        m.request_success.inc(finished_reason=done.finish_reason)
        m.e2e.observe(now - req.arrival)
        m.generation_len.observe(seq.output.num_tokens)
        self._emit(req, done)

    # -- failures -------------------------------------------------------------------
    def _fail(self, seq: _Seq, e: Exception):
        if self.sync.group_lost(e) or self._retry_cold(seq, e):
            return  # every request failed already (503); or computed cold now
        log.error("Request %s failed: %s: %s", seq.req.request_id, type(e).__name__, e,
                  exc_info=not isinstance(e, MemoryError))
        self._remove(seq)
        self.metrics.request_failure.inc(reason="error")
        self._emit(seq.req, failure(e))
        seq.dec = None  # drop its caches before clearing MLX's buffer cache
        mx.clear_cache()

    def _retry_cold(self, seq: _Seq, e: Exception) -> bool:
        """A restored prefix state failed before any token (a damaged or forged entry)."""
        if seq.restored is None or seq.output.num_tokens or not isinstance(e, ValueError):
            return False
        self.prefix_cache.discard(seq.restored, f"request {seq.req.request_id}: {e}")
        self._remove(seq)
        self.running.append(self._make_seq(seq.req, use_cache=False))
        return True

    def _fail_all(self, status: int, message: str, code: Optional[str] = None):
        with self._cv:
            while self._incoming:
                self.waiting.append(self._incoming.popleft())
        running, waiting = self.running, list(self.waiting)
        self.running, self.waiting = [], deque()
        # Failed rows leave the batch (or the next step decodes them for nobody); a batch
        # that cannot even drop them starts over, keeping the policy's measurements.
        try:
            for seq in running:
                self.batch.remove(seq.req.request_id)
                self.sync.removed(seq)
        except Exception:
            log.exception("Could not remove the failed rows; starting a new batch")
            policy = self.batch.policy
            self.batch = BatchDecoder(self.model, self.batch.mtp, self.adaptive)
            self.batch.policy = policy
        for r in [s.req for s in running] + waiting:
            if not r.cancelled:
                self.metrics.request_failure.inc(reason="error")
                self._emit(r, Failed(status, message, code))

    def _remove(self, seq: _Seq):
        if seq in self.running:
            self.running.remove(seq)
        self.batch.remove(seq.req.request_id)
        self.sync.removed(seq)

    _emit = staticmethod(emit)
