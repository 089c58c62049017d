"""Prometheus metrics in the text exposition format (no prometheus_client needed).

Names copy vLLM's with the ``mlx_mtp:`` prefix, so dashboards written for
``vllm:spec_decode_*`` work after a prefix substitution. Every sample carries
a ``model_name`` label.
"""

from __future__ import annotations

import bisect
import math
import threading
from typing import Callable, Dict, List, Optional, Sequence, Tuple

PREFIX = "mlx_mtp:"

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000, 200000]


def _escape(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(pairs: Sequence[Tuple[str, str]]) -> str:
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}"


def _num(v: float) -> str:
    if isinstance(v, float):
        if math.isinf(v):
            return "+Inf" if v > 0 else "-Inf"
        if math.isnan(v):
            return "NaN"
        return repr(v)
    return str(v)


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labelnames: Sequence[str], const: Dict[str, str],
                 lock: threading.Lock):
        self.name = name
        self.help = help
        self.labelnames = tuple(labelnames)
        self.const = tuple(const.items())
        self._lock = lock

    def _key(self, labels: Dict[str, str]) -> Tuple[str, ...]:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {tuple(labels)}")
        return tuple(str(labels[n]) for n in self.labelnames)

    def _pairs(self, key) -> List[Tuple[str, str]]:
        return list(self.const) + list(zip(self.labelnames, key))

    def header(self) -> List[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.values: Dict[Tuple[str, ...], float] = {}
        if not self.labelnames:
            self.values[()] = 0

    def inc(self, amount: float = 1, **labels):
        if amount < 0:
            raise ValueError("counters only go up")
        key = self._key(labels)
        with self._lock:
            self.values[key] = self.values.get(key, 0) + amount

    def get(self, **labels) -> float:
        return self.values.get(self._key(labels), 0)

    def render(self) -> List[str]:
        out = self.header()
        for key, v in sorted(self.values.items()):
            out.append(f"{self.name}{_labels(self._pairs(key))} {_num(v)}")
        return out


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, *a, fn: Optional[Callable[[], float]] = None, **kw):
        super().__init__(*a, **kw)
        self.fn = fn
        self.value = 0

    def set(self, v: float):
        self.value = v

    def get(self) -> float:
        return self.fn() if self.fn is not None else self.value

    def render(self) -> List[str]:
        return self.header() + [f"{self.name}{_labels(list(self.const))} {_num(self.get())}"]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, *a, buckets: Sequence[float], **kw):
        super().__init__(*a, **kw)
        self.buckets = list(buckets)
        self.series: Dict[Tuple[str, ...], list] = {}  # key -> [counts..., sum, count]
        if not self.labelnames:
            self.series[()] = [0] * len(self.buckets) + [0.0, 0]

    def observe(self, v: float, **labels):
        key = self._key(labels)
        with self._lock:
            s = self.series.setdefault(key, [0] * len(self.buckets) + [0.0, 0])
            i = bisect.bisect_left(self.buckets, v)
            if i < len(self.buckets):
                s[i] += 1
            s[-2] += v
            s[-1] += 1

    def count(self, **labels) -> int:
        s = self.series.get(self._key(labels))
        return s[-1] if s else 0

    def render(self) -> List[str]:
        out = self.header()
        for key, s in sorted(self.series.items()):
            pairs = self._pairs(key)
            cum = 0
            for b, c in zip(self.buckets, s):
                cum += c
                out.append(f"{self.name}_bucket{_labels(pairs + [('le', _num(float(b)))])} {cum}")
            out.append(f"{self.name}_bucket{_labels(pairs + [('le', '+Inf')])} {s[-1]}")
            out.append(f"{self.name}_sum{_labels(pairs)} {_num(float(s[-2]))}")
            out.append(f"{self.name}_count{_labels(pairs)} {s[-1]}")
        return out


class Registry:
    def __init__(self, const_labels: Optional[Dict[str, str]] = None):
        self.const = dict(const_labels or {})
        self._lock = threading.Lock()
        self.metrics: List[_Metric] = []

    def _add(self, m):
        self.metrics.append(m)
        return m

    def counter(self, name, help, labelnames=()) -> Counter:
        return self._add(Counter(name, help, labelnames, self.const, self._lock))

    def gauge(self, name, help, fn=None) -> Gauge:
        return self._add(Gauge(name, help, (), self.const, self._lock, fn=fn))

    def histogram(self, name, help, buckets, labelnames=()) -> Histogram:
        return self._add(Histogram(name, help, labelnames, self.const, self._lock, buckets=buckets))

    def render(self) -> str:
        with self._lock:
            lines = []
            for m in self.metrics:
                lines.extend(m.render())
        return "\n".join(lines) + "\n"


class ServerMetrics:
    """The metrics the engine updates (vLLM names, ``mlx_mtp:`` prefix)."""

    def __init__(self, model_name: str, running: Callable[[], int] = None,
                 waiting: Callable[[], int] = None):
        r = self.registry = Registry({"model_name": model_name})
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
                    lookup_accepted: int = 0):
        if num_drafted <= 0:
            return
        for source, d, a in (("mtp", num_drafted - lookup_drafted,
                              num_accepted - lookup_accepted),
                             ("lookup", lookup_drafted, lookup_accepted)):
            self.spec_draft_tokens_by_source.inc(d, source=source)
            self.spec_accepted_by_source.inc(a, source=source)
        self.spec_drafts.inc()
        self.spec_draft_tokens.inc(num_drafted)
        self.spec_accepted.inc(num_accepted)
        for j in range(num_drafted):
            # Every drafted position gets a series (0 when rejected), as in vLLM.
            self.spec_accepted_per_pos.inc(1 if j < num_accepted else 0, position=str(j))
            self.spec_drafted_per_pos.inc(position=str(j))

    def snapshot(self) -> dict:
        """Running totals for the live page (``dashboard`` adds rates and engine state)."""
        def per_pos(counter):
            with self.registry._lock:
                items = list(counter.values.items())
            return {int(key[0]): v for key, v in items}

        def mean(h):
            s = h.series.get((), [0.0, 0])
            return s[-2] / s[-1] if s[-1] else None

        accepted, drafted = per_pos(self.spec_accepted_per_pos), per_pos(self.spec_drafted_per_pos)
        with self.registry._lock:
            finished = sum(self.request_success.values.values())
            failed = sum(self.request_failure.values.values())
        return {
            "requests_running": self.num_requests_running.get(),
            "requests_waiting": self.num_requests_waiting.get(),
            "requests_finished": finished,
            "requests_failed": failed,
            "prompt_tokens": self.prompt_tokens.get(),
            "generation_tokens": self.generation_tokens.get(),
            "prefix_cache_query_tokens": self.prefix_cache_queries.get(),
            "prefix_cache_hit_tokens": self.prefix_cache_hits.get(),
            "prefix_cache_disk_hit_tokens": self.prefix_cache_disk_hits.get(),
            "num_drafts": self.spec_drafts.get(),
            "num_draft_tokens": self.spec_draft_tokens.get(),
            "num_accepted_tokens": self.spec_accepted.get(),
            "lookup_draft_tokens": self.spec_draft_tokens_by_source.get(source="lookup"),
            "lookup_accepted_tokens": self.spec_accepted_by_source.get(source="lookup"),
            "per_position": [{"position": j, "drafted": drafted[j], "accepted": accepted.get(j, 0)}
                             for j in sorted(drafted)],
            "mean_ttft_seconds": mean(self.ttft),
            "mean_itl_seconds": mean(self.itl),
        }

    def render(self) -> str:
        return self.registry.render()
