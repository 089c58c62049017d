"""Prometheus metrics for ``/metrics``, kept and rendered by ``prometheus_client``.

Names copy vLLM's with the ``mlx_mtp:`` prefix, so dashboards written for
``vllm:spec_decode_*`` work after a prefix substitution. Every sample carries
a ``model_name`` label. The small wrappers below bind that label and give the
engine and the live page one way to read a value back (``get``/``count``).

Speculative-decoding counters (``SpecStats``) render from their own dict and text forms
(``SpecStats.to_dict``, ``SpecStats.describe``): a response's ``mtp`` block, the live page
and the periodic log line; ``/metrics`` counts them step by step (``record_step``).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

import prometheus_client
from prometheus_client import CollectorRegistry

from ..decode.stats import SpecStats

PREFIX = "mlx_mtp:"
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000, 200000]


class _Series:
    """A ``prometheus_client`` metric with the server's ``model_name`` label bound."""

    def __init__(self, metric, sample_name: str, model_name: str, labelnames: Sequence[str]):
        self.metric = metric
        self.sample_name = sample_name
        self.model_name = model_name
        self.labelnames = tuple(labelnames)
        if not self.labelnames:
            self.child()  # an unlabelled series is exposed (at 0) from the start

    def child(self, labels: Optional[Dict[str, str]] = None):
        labels = labels or {}
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.sample_name} takes labels {self.labelnames}, "
                             f"got {tuple(labels)}")
        return self.metric.labels(model_name=self.model_name,
                                  **{k: str(v) for k, v in labels.items()})

    def samples(self, suffix: str = "") -> Dict[Tuple[str, ...], float]:
        """Current values of ``sample_name + suffix``, keyed by the extra label values."""
        name = self.sample_name + suffix
        return {tuple(s.labels[n] for n in self.labelnames): s.value
                for family in self.metric.collect() for s in family.samples if s.name == name}

    def _value(self, suffix: str, labels: Dict[str, str]) -> float:
        key = tuple(str(labels[n]) for n in self.labelnames if n in labels)
        return self.samples(suffix).get(key, 0)


class Counter(_Series):
    def inc(self, amount: float = 1, **labels):
        self.child(labels).inc(amount)

    def get(self, **labels) -> float:
        return self._value("", labels)


class Gauge(_Series):
    """A gauge that is either set or, when ``fn`` is given, read from ``fn`` at scrape time."""

    def __init__(self, *a, fn: Optional[Callable[[], float]] = None):
        super().__init__(*a)
        self.fn = fn

    @property
    def fn(self):
        return self._fn

    @fn.setter
    def fn(self, fn):
        self._fn = fn
        if fn is not None:
            self.child().set_function(fn)

    def set(self, v: float):
        self.child().set(v)

    def get(self) -> float:
        return self.fn() if self.fn is not None else self._value("", {})


class Histogram(_Series):
    def observe(self, v: float, **labels):
        self.child(labels).observe(v)

    def count(self, **labels) -> int:
        return int(self._value("_count", labels))

    def mean(self, **labels) -> Optional[float]:
        n = self.count(**labels)
        return self._value("_sum", labels) / n if n else None


class _Registry:
    """Builds the wrapped metrics into one ``CollectorRegistry``."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.collectors = CollectorRegistry()

    def counter(self, name, help, labelnames=()) -> Counter:
        metric = prometheus_client.Counter(name, help, ("model_name", *labelnames),
                                           registry=self.collectors)
        # prometheus_client drops a trailing _total from the family and adds it to the sample.
        sample = name if name.endswith("_total") else name + "_total"
        return Counter(metric, sample, self.model_name, labelnames)

    def gauge(self, name, help, fn=None) -> Gauge:
        metric = prometheus_client.Gauge(name, help, ("model_name",), registry=self.collectors)
        return Gauge(metric, name, self.model_name, (), fn=fn)

    def histogram(self, name, help, buckets, labelnames=()) -> Histogram:
        metric = prometheus_client.Histogram(name, help, ("model_name", *labelnames),
                                             buckets=buckets, registry=self.collectors)
        return Histogram(metric, name, self.model_name, labelnames)

    def render(self) -> str:
        return prometheus_client.generate_latest(self.collectors).decode()


class ServerMetrics:
    """The metrics the engine updates (vLLM names, ``mlx_mtp:`` prefix)."""

    def __init__(self, model_name: str, running: Callable[[], int] = None,
                 waiting: Callable[[], int] = None):
        # No `<name>_created` series: the exposition keeps exactly the names listed here.
        prometheus_client.disable_created_metrics()
        r = self.registry = _Registry(model_name)
        self.spec = SpecStats()  # the same counts, for the live page
        p = PREFIX
        self.num_requests_running = r.gauge(
            p + "num_requests_running", "Number of requests in the running batch.", fn=running)
        self.num_requests_waiting = r.gauge(
            p + "num_requests_waiting", "Number of requests waiting to be admitted.", fn=waiting)
        self.prompt_tokens = r.counter(p + "prompt_tokens_total", "Number of prefill tokens processed (cached tokens included).")
        self.generation_tokens = r.counter(p + "generation_tokens_total", "Number of generation tokens processed.")
        self.prefix_cache_queries = r.counter(
            p + "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = r.counter(
            p + "prefix_cache_hits_total", "Prompt tokens served from the prefix cache.")
        self.prefix_cache_disk_hits = r.counter(
            p + "prefix_cache_disk_hits_total",
            "Prompt tokens restored from the on-disk prompt cache (--prompt-cache-dir).")
        self.request_success = r.counter(
            p + "request_success_total", "Count of successfully finished requests.",
            ("finished_reason",))
        self.request_failure = r.counter(
            p + "request_failure_total", "Count of requests that failed or were aborted.",
            ("reason",))
        self.spec_drafts = r.counter(
            p + "spec_decode_num_drafts_total", "Number of spec decoding drafts.")
        self.spec_draft_tokens = r.counter(
            p + "spec_decode_num_draft_tokens_total", "Number of draft tokens.")
        self.spec_accepted = r.counter(
            p + "spec_decode_num_accepted_tokens_total", "Number of accepted tokens.")
        self.spec_accepted_per_pos = r.counter(
            p + "spec_decode_num_accepted_tokens_per_pos_total",
            "Accepted tokens per draft position.", ("position",))
        # Not in vLLM: with an adaptive K, positions are drafted unequally often, so the
        # acceptance at position j is accepted_per_pos / drafted_per_pos, not / num_drafts.
        self.spec_drafted_per_pos = r.counter(
            p + "spec_decode_num_drafted_tokens_per_pos_total",
            "Drafted tokens per draft position.", ("position",))
        # Not in vLLM: drafts by source, mtp (the head) or lookup (copied from the context).
        self.spec_draft_tokens_by_source = r.counter(
            p + "spec_decode_num_draft_tokens_by_source_total",
            "Draft tokens by source (mtp, lookup).", ("source",))
        self.spec_accepted_by_source = r.counter(
            p + "spec_decode_num_accepted_tokens_by_source_total",
            "Accepted tokens by source (mtp, lookup).", ("source",))
        # Not in vLLM: the memory budget (serve --memory-budget; 0: none), the bytes the
        # running sequences' caches hold, what admission reserved for their worst case, and
        # the prefix cache's entries (memory_budget.py).
        self.memory_budget = r.gauge(p + "memory_budget_bytes", "The memory budget (0: none).")
        self.memory_sequences = r.gauge(p + "memory_sequences_bytes",
                                        "Bytes the running sequences' caches hold.")
        self.memory_reserved = r.gauge(p + "memory_reserved_bytes",
                                       "Bytes admission reserved for the running sequences.")
        self.memory_prefixes = r.gauge(p + "memory_prefix_cache_bytes",
                                           "Bytes the prefix cache's entries hold.")
        self.ttft = r.histogram(p + "time_to_first_token_seconds",
                                "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = r.histogram(p + "inter_token_latency_seconds",
                               "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = r.histogram(p + "e2e_request_latency_seconds",
                               "Histogram of end to end request latency in seconds.", E2E_BUCKETS)
        self.prompt_len = r.histogram(p + "request_prompt_tokens",
                                      "Number of prefill tokens per request.", TOKEN_BUCKETS)
        self.generation_len = r.histogram(p + "request_generation_tokens",
                                          "Number of generation tokens per request.", TOKEN_BUCKETS)

    def record_step(self, num_drafted: int, num_accepted: int, lookup_drafted: int = 0,
                    lookup_accepted: int = 0, block_drafted: int = 0, block_accepted: int = 0):
        if num_drafted <= 0:
            return
        step = SpecStats()
        step.record(num_drafted, num_accepted, lookup_drafted, lookup_accepted, block_drafted,
                    block_accepted)
        for source, counts in step.by_source().items():
            self.spec_draft_tokens_by_source.inc(counts["drafted"], source=source)
            self.spec_accepted_by_source.inc(counts["accepted"], source=source)
        self.spec.merge(step)
        self.spec_drafts.inc()
        self.spec_draft_tokens.inc(num_drafted)
        self.spec_accepted.inc(num_accepted)
        for j in range(num_drafted):
            # Every drafted position gets a series (0 when rejected), as in vLLM.
            self.spec_accepted_per_pos.inc(1 if j < num_accepted else 0, position=str(j))
            self.spec_drafted_per_pos.inc(position=str(j))

    def snapshot(self) -> dict:
        """Running totals for the live page (``dashboard`` adds rates and engine state)."""
        spec = self.spec.to_dict(missing=None)
        return {
            "requests_running": self.num_requests_running.get(),
            "requests_waiting": self.num_requests_waiting.get(),
            "requests_finished": int(sum(self.request_success.samples().values())),
            "requests_failed": int(sum(self.request_failure.samples().values())),
            "prompt_tokens": int(self.prompt_tokens.get()),
            "generation_tokens": int(self.generation_tokens.get()),
            "prefix_cache_query_tokens": int(self.prefix_cache_queries.get()),
            "prefix_cache_hit_tokens": int(self.prefix_cache_hits.get()),
            "prefix_cache_disk_hit_tokens": int(self.prefix_cache_disk_hits.get()),
            **spec,
            "per_position": [{"position": j, "drafted": d, "accepted": a, "rate": a / d if d else None}
                             for j, (d, a) in enumerate(zip(spec["drafted_per_pos"],
                                                            spec["accepted_per_pos"]))],
            "memory": {"budget_bytes": self.memory_budget.get() or None,
                       "sequences_bytes": self.memory_sequences.get(),
                       "reserved_bytes": self.memory_reserved.get(),
                       "prefix_cache_bytes": self.memory_prefixes.get()},
            "mean_ttft_seconds": self.ttft.mean(),
            "mean_itl_seconds": self.itl.mean(),
        }

    def render(self) -> str:
        return self.registry.render()


class PeriodicLog:
    """The scheduler's periodic log line (vLLM's throughput figures, then ``SpecStats``'s
    line), every ``interval`` seconds (0: off)."""

    def __init__(self, interval: float, logger: Optional[logging.Logger] = None):
        self.interval = interval
        self.log = logger or logging.getLogger("mlx_mtp.server")
        self._t, self._stats, self._tokens = time.perf_counter(), SpecStats(), 0

    def record(self, num_drafted: int, num_accepted: int, num_tokens: int,
               lookup_drafted: int = 0, lookup_accepted: int = 0, block_drafted: int = 0,
               block_accepted: int = 0):
        self._stats.record(num_drafted, num_accepted, lookup_drafted, lookup_accepted,
                           block_drafted, block_accepted)
        self._tokens += num_tokens

    def maybe_log(self, running: int, waiting: int, policy: Callable[[], Optional[str]]):
        now = time.perf_counter()
        if self.interval <= 0 or now - self._t < self.interval:
            return
        if self._tokens or running:
            line = (f"Running: {running} reqs, Waiting: {waiting} reqs, "
                    f"Avg generation throughput: {self._tokens / (now - self._t):.1f} tokens/s")
            if self._stats.num_drafts:
                line += ". " + self._stats.describe()
            self.log.info(line)
            described = policy() if running else None
            if described:
                self.log.info("MTP draft policy at %s", described)
        self._t, self._stats, self._tokens = now, SpecStats(), 0
