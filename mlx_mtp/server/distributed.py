"""``mlx-mtp serve`` over several ranks: rank 0 schedules, the others replay its steps.

Every collective op of a split model (``models/distributed.py``) must be issued by every
rank in the same order, so the other ranks run exactly the model calls rank 0's engine
runs. Rank 0 serves HTTP and runs the scheduler (``engine.Engine``) with a
``LeaderSync``; the engine tells it what it does to the model (``StepSync`` hooks) and it
sends that, before the model work it describes, as one small JSON message over the group
(``DistributedModel.broadcast``). Each message lists operations:

  config   K, adaptive, prompt chunk size         (the first message)
  admit    row id, prompt ids, sampling params, K, seed, prefix-cache entry to restore
  prefill  row id, end of the chunk, whether the MTP head sees it
  store / forget   prefix-cache entries (rank 0's cache decides; ids name them)
  step     drafts per row of the batch (rank 0's draft policy decides)
  remove   row id (finished, cancelled, failed)
  calibrate  batch sizes (the draft policy's timing run)
  stop

A scheduler iteration that only decodes sends one message; each prompt chunk adds one.
An idle rank 0 sends an empty message every ``heartbeat`` seconds. Tokens, acceptance and
rollback are decided inside the step (``DistributedModel.share``), as in ``generate``.
The other ranks (``Follower``) apply the operations to the same objects the engine uses
(``Sequence``, ``BatchDecoder``), keyed by row id.

A lost rank: the ring backend raises at once when a peer's socket closes (measured:
"[ring] connection to a peer was lost" within milliseconds) but blocks forever on a peer
that hangs. Rank 0 therefore also runs a watchdog: no completed exchange for ``timeout``
seconds marks the group lost. Then every queued and running request fails with a 503
(``distributed_rank_lost``), new ones get a 503, ``/health`` answers 503. A follower exits
(status 1) when rank 0 is gone or silent for as long; ``mlx.launch`` then stops the rest.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from typing import Dict, List, Optional

import mlx.core as mx

from ..decode.batch import BatchDecoder, BatchStepError
from ..decode.sampling import SamplingParams
from ..decode.sequence import Sequence

log = logging.getLogger("mlx_mtp.server")

HEARTBEAT_SECONDS = 1.0
DEFAULT_TIMEOUT = 120.0


class StepSync:
    """What the engine tells the other ranks; a single process needs none of it."""

    idle_seconds: Optional[float] = None  # wake an idle engine this often (heartbeats)
    lost: Optional[str] = None  # why the group can no longer serve

    def admitted(self, seq, entry): pass
    def prefill(self, seq, end: int, run_head: bool): pass
    def stored(self, seq, key, state): pass
    def removed(self, seq): pass
    def decoding(self, ks): pass
    def calibrating(self, sizes): pass
    def end_step(self): pass
    def stopped(self): pass
    def shutting_down(self): pass

    def group_lost(self, error: Exception) -> bool:
        """Whether ``error`` means the group is gone (requests were failed with a 503)."""
        return False


class GroupLost(RuntimeError):
    """A rank stopped answering: the split model cannot run any more."""


def params_to_json(params: SamplingParams) -> dict:
    d = dataclasses.asdict(params)
    d["logit_bias"] = {str(t): v for t, v in params.logit_bias or ()}
    return d


def params_from_json(d: dict) -> SamplingParams:
    return SamplingParams(**{**d, "logit_bias": d.get("logit_bias") or None})


class LeaderSync(StepSync):
    """Rank 0's side: queue the engine's operations and send them before model work."""

    def __init__(self, model, timeout: float = DEFAULT_TIMEOUT,
                 heartbeat: float = HEARTBEAT_SECONDS):
        self.model = model
        self.timeout = timeout
        self.idle_seconds = heartbeat
        self.lost = None
        self.engine = None
        self.ops: List[list] = []
        self.seq = 0
        self.rows: Dict[str, int] = {}  # request id -> row id
        self.entries: Dict[tuple, int] = {}  # prefix-cache key -> entry id
        self._next_id = 0
        self._last_exchange: Optional[float] = None  # None: watchdog not armed yet
        self._lock = threading.Lock()

    def attach(self, engine):
        """Bind to ``engine`` (before it starts) and start the watchdog."""
        self.engine = engine
        self.ops.append(["config", {"K": engine.num_draft_tokens, "adaptive": engine.adaptive,
                                    "prefill_step_size": engine.prefill_step_size}])
        threading.Thread(target=self._watch, name="mlx-mtp-watchdog", daemon=True).start()

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    # -- hooks ------------------------------------------------------------------------
    def admitted(self, seq, entry):
        restore = None if entry is None else self.entries.get(tuple(entry.key))
        if entry is not None and restore is None:  # e.g. read from disk on rank 0 only
            raise RuntimeError("a prompt-cache entry the other ranks do not hold was restored")
        rid = self.rows[seq.req.request_id] = self._new_id()
        dec = seq.dec
        self.ops.append(["admit", rid, list(seq.req.prompt), params_to_json(dec.params),
                         dec.row.max_k, dec.sampler.seed, restore])

    def prefill(self, seq, end: int, run_head: bool):
        self.ops.append(["prefill", self.rows[seq.req.request_id], end, run_head])
        self._send()

    def stored(self, seq, key, state):
        key = tuple(key)
        cache = self.engine.prefix_cache
        entry = cache.entries.get(key)
        if entry is not None and entry.state is state:  # a new state under this key
            old = self.entries.pop(key, None)
            if old is not None:
                self.ops.append(["forget", old])
            self.entries[key] = self._new_id()
            self.ops.append(["store", self.rows[seq.req.request_id], self.entries[key]])
        for gone in [k for k in self.entries if k not in cache.entries]:  # evicted
            self.ops.append(["forget", self.entries.pop(gone)])

    def removed(self, seq):
        rid = self.rows.pop(seq.req.request_id, None)
        if rid is not None:
            self.ops.append(["remove", rid])

    def decoding(self, ks):
        self.ops.append(["step", [int(k) for k in ks]])  # the K rank 0 picked, every rank runs
        self._send()

    def calibrating(self, sizes):
        self.ops.append(["calibrate", list(sizes)])
        self._send()
        self._last_exchange = None  # a long run without messages: re-armed after it

    def end_step(self):
        if self._last_exchange is None:
            self._last_exchange = time.monotonic()  # armed after calibration
        # Operations that need no model work (rows leaving, cache evictions) wait for the
        # next message: an iteration that only decodes stays one message.
        if self.lost is None and time.monotonic() - self._last_exchange >= self.idle_seconds:
            try:
                self._send()
            except GroupLost:
                pass  # requests already failed

    def stopped(self):
        if self.lost is None:
            self.ops.append(["stop"])
            try:
                self._send()
            except GroupLost:
                pass

    def shutting_down(self):
        """SIGTERM / Ctrl-C: if the engine thread does not stop within a second (it may
        sit in a collective of a lost rank), fail its requests from here."""
        engine = self.engine

        def fail_if_stuck():
            if engine is not None and not engine._stopped.is_set():
                engine._fail_all(503, "The server is shutting down.", code="shutting_down")

        timer = threading.Timer(1.0, fail_if_stuck)
        timer.daemon = True
        timer.start()

    def group_lost(self, error: Exception) -> bool:
        if self.lost is not None or isinstance(error, GroupLost):
            return True
        # A peer that died mid-step fails the next exchange at once, unless that exchange
        # waits on the failed collective (measured: it then blocks): start a new chain.
        self.model.restart_comm_chain()
        try:
            self._send()
        except GroupLost:
            return True
        return False

    # -- exchange and failure -----------------------------------------------------------
    def _send(self):
        if self.lost is not None:
            raise GroupLost(self.lost)
        payload = json.dumps({"seq": self.seq, "ops": self.ops}).encode()
        self.ops = []
        try:
            self.model.broadcast(payload)
        except Exception as e:
            self._lose(f"{type(e).__name__}: {e}")
            raise GroupLost(self.lost) from e
        self.seq += 1
        self._last_exchange = time.monotonic()

    def _lose(self, why: str):
        with self._lock:
            if self.lost is not None:
                return
            self.lost = (f"A rank of the distributed model is unreachable ({why}); the "
                         "server cannot generate until it is restarted.")
        log.error(self.lost)
        engine = self.engine
        if engine is not None:
            engine.alive = False
            engine._fail_all(503, self.lost, code="distributed_rank_lost")

    def _watch(self):
        while self.lost is None:
            time.sleep(min(1.0, self.timeout / 4))
            last = self._last_exchange
            if last is not None and time.monotonic() - last > self.timeout:
                self._lose(f"no answer within {self.timeout:g} s")


class Follower:
    """A rank > 0: apply rank 0's operations until it says stop."""

    def __init__(self, model, timeout: float = DEFAULT_TIMEOUT):
        self.model = model
        self.timeout = timeout
        self.batch: Optional[BatchDecoder] = None
        self.config: dict = {}
        self.seqs: Dict[int, tuple] = {}  # row id -> (decoder, prompt)
        self.joining: List[int] = []  # prefilled rows joining the batch before the next op
        self.entries: Dict[int, object] = {}
        self.seq = 0
        self._last = time.monotonic()
        self._done = threading.Event()  # run returned: the watchdog must not exit the process

    def run(self) -> int:
        threading.Thread(target=self._watch, name="mlx-mtp-watchdog", daemon=True).start()
        try:
            return self._follow()
        finally:
            self._done.set()

    def _follow(self) -> int:
        while True:
            try:
                message = json.loads(self.model.broadcast())
            except Exception as e:
                log.error("Lost rank 0 (%s: %s); exiting", type(e).__name__, e)
                return 1
            self._last = time.monotonic()
            if message.get("seq") != self.seq:
                log.error("Out of step with rank 0 (message %s, expected %d); exiting",
                          message.get("seq"), self.seq)
                return 1
            self.seq += 1
            for op in message["ops"]:
                if op[0] == "stop":
                    return 0
                if op[0] == "calibrate":  # a long run without messages
                    self._last = None
                self._apply(op)
                self._last = time.monotonic()

    def _watch(self):
        # Waiting on rank 0 past this means it hangs; its heartbeats come every second.
        while not self._done.wait(1.0):
            last = self._last
            if last is not None and time.monotonic() - last > self.timeout + HEARTBEAT_SECONDS:
                log.error("No message from rank 0 for %.0f s; exiting", self.timeout)
                os._exit(1)

    def _apply(self, op: list):
        kind, *a = op
        if kind not in ("store", "forget"):  # rank 0 adds a prompt after its snapshot
            self._join()
        try:
            getattr(self, "_" + kind)(*a)
        except BatchStepError:
            pass  # rank 0's step failed the same way: it removes the row next
        except Exception:
            log.exception("Operation %s failed on this rank", kind)

    def _join(self):
        for rid in self.joining:
            if rid in self.seqs:
                self.batch.add(rid, self.seqs[rid][0])
        self.joining = []

    # -- operations ---------------------------------------------------------------------
    def _config(self, config: dict):
        self.config = config
        self.batch = self._new_batch()

    def _new_batch(self) -> BatchDecoder:
        return BatchDecoder(self.model, self.config["K"] > 0, self.config["adaptive"])

    def _admit(self, rid, prompt, params, k, seed, restore):
        dec = Sequence(self.model, k, params_from_json(params),
                       adaptive=self.config["adaptive"],
                       prefill_step_size=self.config["prefill_step_size"])
        dec.sampler.seed = seed
        if restore is not None:
            dec.restore(self.entries[restore])
        self.seqs[rid] = (dec, prompt)

    def _prefill(self, rid, end, run_head):
        dec, prompt = self.seqs[rid]
        dec.prefill(prompt[: end + 1], run_head=run_head)
        if end == len(prompt) - 1:
            self.joining.append(rid)

    def _store(self, rid, entry_id):
        state = self.seqs[rid][0].snapshot()
        mx.eval(state.arrays())
        self.entries[entry_id] = state

    def _forget(self, entry_id):
        self.entries.pop(entry_id, None)

    def _remove(self, rid):
        self.seqs.pop(rid, None)
        self.batch.remove(rid)

    def _step(self, ks):
        self.batch.step(ks=ks)

    def _calibrate(self, sizes):
        try:
            self.batch.calibrate(self.config["K"], sizes)
        except Exception:  # as the engine: a fresh batch, costs learnt live
            log.exception("MTP step-cost calibration failed")
            self.batch = self._new_batch()


def run_follower(model, timeout: float = DEFAULT_TIMEOUT) -> int:
    """A rank > 0 of ``serve``: follow rank 0 until it stops, then exit the process."""
    log.info("Rank %d of %d following rank 0 (%s)", model.rank, model.size, model.mode)
    code = Follower(model, timeout).run()
    logging.shutdown()
    os._exit(code)  # a collective with a lost rank may still hold MLX's stream
