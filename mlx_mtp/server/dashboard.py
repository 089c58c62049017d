"""The live page (chat and dashboard): its static files and its data feed.

Its routes (``routers/dashboard``):

* ``GET /`` and ``GET /static/<file>``: the page (``static/``; no build step, no CDN).
  Served without a key, since it holds no data; the page asks for the key.
* ``GET /v1/dashboard``: one snapshot (JSON).
* ``GET /v1/dashboard/events``: a server-sent event stream, one snapshot per second.

Both data routes need the same key as the API (``Authorization: Bearer KEY``).
Browsers' ``EventSource`` cannot send headers, so the page reads the stream with
``fetch``; with no ``--api-key`` an ``EventSource`` works as well.
"""

from __future__ import annotations

import copy
import re
import time
from collections import deque
from importlib import resources
from typing import Callable, List, Optional

SNAPSHOT_INTERVAL = 1.0  # seconds between two events of the stream
RATE_WINDOW = 3.0  # tokens/s is measured over this many seconds

STATIC_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
# The page loads nothing from elsewhere and may not be framed (clickjacking).
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                               "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def static_files() -> dict:
    """name -> (bytes, content type) of every file under ``static/``, read once."""
    root = resources.files(__package__).joinpath("static")
    files = {}
    for entry in root.iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1]
        if entry.is_file() and suffix in STATIC_TYPES:
            files[entry.name] = (entry.read_bytes(), STATIC_TYPES[suffix])
    return files


def _batch_sizes(max_concurrency: int, current: int) -> List[int]:
    """Powers of two up to the concurrency limit, the limit itself and the current size."""
    sizes = {max_concurrency}
    b = 1
    while b < max_concurrency:
        sizes.add(b)
        b *= 2
    if current:
        sizes.add(current)
    return sorted(sizes)


def _policy_copy(policy, attempts: int = 5):
    """A private copy of the engine thread's DraftPolicy, so that ``describe`` never
    races with the engine: its measurements (``costs``, ``acceptance``) are copied
    deeply, the rest (settings) shallowly. Copying only reads; it is retried if the
    engine changes a container in the middle of it."""
    for _ in range(attempts):
        try:
            mine = copy.copy(policy)
            mine.costs, mine.acceptance = copy.deepcopy((policy.costs, policy.acceptance))
            return mine
        except RuntimeError:  # "dictionary/deque changed size during iteration"
            continue
    return None


def draft_policy_view(engine) -> Optional[dict]:
    """The K the batch's DraftPolicy picks now at each batch size (from ``describe``)."""
    batch = engine.batch
    policy = getattr(batch, "policy", None)
    if policy is None:
        return None
    current = len(batch)
    view = {"max_k": engine.num_draft_tokens, "adaptive": bool(getattr(policy, "adaptive", False)),
            "batch_size": current, "by_batch_size": []}
    policy = _policy_copy(policy)
    if policy is None:
        return view
    for size in _batch_sizes(engine.max_concurrency, current):
        line = policy.describe(size, engine.num_draft_tokens)
        found = re.search(r"\bK=(\d+)", line)
        view["by_batch_size"].append({"batch_size": size,
                                      "k": int(found.group(1)) if found else None,
                                      "detail": line})
    return view


class DashboardFeed:
    """Snapshots for the page: the metrics' totals, rates over the last seconds,
    the engine's queue, prefix cache and draft policy. One feed serves every viewer."""

    def __init__(self, state, clock: Callable[[], float] = time.monotonic):
        self.state = state
        self.clock = clock
        self.samples: deque = deque()  # (time, generation tokens, prompt tokens)
        self._last: Optional[tuple] = None  # (time, snapshot), shared by viewers

    def _rates(self, now: float, generated: float, prompt: float):
        self.samples.append((now, generated, prompt))
        while len(self.samples) > 2 and now - self.samples[1][0] >= RATE_WINDOW:
            self.samples.popleft()
        t0, g0, p0 = self.samples[0]
        dt = now - t0
        if dt <= 0:
            return 0.0, 0.0
        return (generated - g0) / dt, (prompt - p0) / dt

    def snapshot(self) -> dict:
        """The current snapshot; viewers asking within half an interval share one (copying
        the draft policy costs a few milliseconds of the engine's interpreter time)."""
        now = self.clock()
        if self._last is not None and now - self._last[0] < SNAPSHOT_INTERVAL / 2:
            return self._last[1]
        snap = self._take(now)
        self._last = (now, snap)
        return snap

    def _take(self, now: float) -> dict:
        state, engine = self.state, self.state.engine
        totals = engine.metrics.snapshot()
        gen_rate, prompt_rate = self._rates(now, totals["generation_tokens"],
                                            totals["prompt_tokens"])
        pc = engine.prefix_cache
        return {
            "time": time.time(),
            "model": state.model_name,
            "alive": bool(engine.alive),
            "max_concurrency": engine.max_concurrency,
            "generation_tokens_per_second": gen_rate,
            "prompt_tokens_per_second": prompt_rate,
            **totals,  # MTP counters and rates rendered by SpecStats.to_dict
            "prefix_cache": {"enabled": pc.enabled, "entries": len(pc), "bytes": pc.nbytes,
                             "max_bytes": pc.max_bytes, "hits": pc.hits, "misses": pc.misses},
            "draft_policy": draft_policy_view(engine),
        }
