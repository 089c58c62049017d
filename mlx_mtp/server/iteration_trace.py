"""An opt-in record of what each scheduler iteration ran and how long each part took.

``IterationTrace.attach(engine, path)`` wraps the engine's own steps on that one engine
object (nothing changes, and nothing is paid, when no trace is attached) and writes one
JSON line per iteration (``Engine.step``):

- ``wall_ms``: the iteration; ``admit_ms``: admissions (prefix-cache restores);
- ``chunks``: each prompt chunk: the prompt's key, its context ``offset`` and ``tokens``,
  the fair share's estimate (``est_ms``: its per-token cost before the chunk x tokens)
  against the measured ``ms``, whether the MTP head read it (``run_head``), and inside it
  the prefix-cache store (``store_ms``) and the join of a finished prompt (``joined``,
  ``join_ms``: building the merge; MLX runs it in the next decode step);
- ``decode``: the step's rows, K per row, tokens emitted, ``ms``, each row's context and
  the batch caches' bytes (padding shows there);
- ``remove_ms``: rows leaving (the batch's caches filtered); ``gc_ms``: Python GC pauses;
  ``active_mb`` / ``cache_mb``: MLX memory at the end; ``other_ms``: what no part covers.

Used by ``benchmarks/long_prompt_itl.py --trace FILE``, whose ``summarize`` reads a trace back
and names the long iterations' parts.
"""

from __future__ import annotations

import gc
import json
import time
from typing import Optional

import mlx.core as mx

MB = 1 << 20


class IterationTrace:
    def __init__(self, engine, path: str):
        self.engine = engine
        self.file = open(path, "w")
        self.t0 = time.perf_counter()
        self.n = 0
        self.it: Optional[dict] = None
        self._gc_start: Optional[float] = None

    @classmethod
    def attach(cls, engine, path: str) -> "IterationTrace":
        trace = cls(engine, path)
        for name in ("step", "_admit", "_prefill_chunk", "_store_prefix", "_decode_step",
                     "_remove"):
            setattr(engine, name, getattr(trace, name)(getattr(engine, name)))
        prefill = engine.sync.prefill

        def on_prefill(seq, end, run_head):  # the engine tells other ranks; we listen
            if trace.it is not None and trace.it["chunks"]:
                trace.it["chunks"][-1]["run_head"] = run_head
            prefill(seq, end, run_head)

        engine.sync.prefill = on_prefill
        decoding = engine.sync.decoding

        def on_decoding(ks):
            if trace.it is not None:
                trace.it["ks"] = list(ks)
            decoding(ks)

        engine.sync.decoding = on_decoding
        gc.callbacks.append(trace._gc)
        return trace

    def close(self):
        if self._gc in gc.callbacks:
            gc.callbacks.remove(self._gc)
        self.file.close()

    # -- the wrapped parts -----------------------------------------------------------
    def step(self, run):
        def traced():
            start = time.perf_counter()
            self._wrap_batch()
            self.it = {"i": self.n, "t": round(start - self.t0, 4), "admit_ms": 0.0,
                       "chunks": [], "decode": None, "remove_ms": 0.0, "gc_ms": 0.0}
            try:
                return run()
            finally:
                self._write(time.perf_counter() - start)
        return traced

    def _admit(self, run):
        return self._timed(run, "admit_ms")

    def _remove(self, run):
        return self._timed(run, "remove_ms")

    def _prefill_chunk(self, run):
        def traced(seq, max_tokens, below_grid=False):
            key, offset = seq.req.request_id, seq.dec.n_processed
            token_s = self.engine.fair._token_s(key)
            chunk = {"prompt": key, "offset": offset, "run_head": None, "store_ms": 0.0,
                     "joined": False, "join_ms": 0.0, "below_grid": below_grid}
            self._chunks().append(chunk)
            start = time.perf_counter()
            n = run(seq, max_tokens, below_grid)
            chunk.update(tokens=n, ms=_ms(time.perf_counter() - start),
                         est_ms=None if not token_s else _ms(token_s * n))
            return n
        return traced

    def _store_prefix(self, run):
        def traced(seq, end):
            start = time.perf_counter()
            run(seq, end)
            if self._chunks():
                self._chunks()[-1]["store_ms"] += _ms(time.perf_counter() - start)
        return traced

    def _decode_step(self, run):
        def traced(decoding):
            batch = self.engine.batch
            contexts = batch._contexts()
            before = {r.key: r.n_out for r in batch.rows}
            start = time.perf_counter()
            run(decoding)
            seconds = time.perf_counter() - start
            if self.it is not None:
                self.it["decode"] = {
                    "rows": len(contexts), "ks": self.it.pop("ks", None), "ms": _ms(seconds),
                    "tokens": sum(r.n_out - before[r.key] for r in batch.rows
                                  if r.key in before),
                    "contexts": contexts,
                    "cache_mb": round(sum(c.nbytes for c in batch.cache or []) / MB, 2)}
        return traced

    def _wrap_batch(self):
        """Time joins on the engine's current batch (it is replaced after a failure)."""
        batch = self.engine.batch
        if getattr(batch.add, "_traced", False):
            return
        add = batch.add

        def traced(*args, **kwargs):
            start = time.perf_counter()
            add(*args, **kwargs)
            if self._chunks():
                self._chunks()[-1].update(joined=True, join_ms=_ms(time.perf_counter() - start))

        traced._traced = True
        batch.add = traced

    # -- helpers ----------------------------------------------------------------------
    def _timed(self, run, field: str):
        def traced(*args, **kwargs):
            start = time.perf_counter()
            try:
                return run(*args, **kwargs)
            finally:
                if self.it is not None:
                    self.it[field] += _ms(time.perf_counter() - start)
        return traced

    def _chunks(self) -> list:
        return self.it["chunks"] if self.it is not None else []

    def _gc(self, phase: str, info: dict):
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None and self.it is not None:
            self.it["gc_ms"] += _ms(time.perf_counter() - self._gc_start)
            self._gc_start = None

    def _write(self, seconds: float):
        it, self.it = self.it, None
        self.n += 1
        if not it["chunks"] and it["decode"] is None and not it["admit_ms"]:
            return  # an idle iteration
        parts = it["admit_ms"] + it["remove_ms"] + sum(c["ms"] for c in it["chunks"])
        parts += it["decode"]["ms"] if it["decode"] else 0.0
        it.update(wall_ms=_ms(seconds), other_ms=_ms(seconds - parts / 1e3),
                  active_mb=round(mx.get_active_memory() / MB, 1),
                  cache_mb=round(mx.get_cache_memory() / MB, 1))
        self.file.write(json.dumps(it) + "\n")
        self.file.flush()


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 2)
