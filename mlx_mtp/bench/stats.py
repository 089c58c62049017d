"""Small statistics helpers for the benchmark (no numpy needed).

* ``percentile``: linear interpolation between closest ranks, the same
  definition as ``numpy.percentile`` (method "linear").
* ``expected_tokens`` / ``ideal_speedup``: what a speculative step can buy at
  best, given per-position acceptance and the cost of its passes.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Sequence


def percentile(data: Iterable[float], p: float) -> float:
    """The ``p``-th percentile (0-100) of ``data``; NaN for empty data."""
    s = sorted(float(x) for x in data)
    if not s:
        return math.nan
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100] (got {p})")
    k = (len(s) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (k - lo) * (s[hi] - s[lo])


def median(data: Iterable[float]) -> float:
    return percentile(data, 50)


def mean(data: Sequence[float]) -> float:
    data = list(data)
    return sum(data) / len(data) if data else math.nan


def stdev(data: Sequence[float]) -> float:
    """Sample standard deviation (0 for fewer than two values)."""
    data = list(data)
    if len(data) < 2:
        return 0.0
    m = mean(data)
    return math.sqrt(sum((x - m) ** 2 for x in data) / (len(data) - 1))


def summarize(data: Sequence[float], percentiles=(50, 95, 99)) -> Dict[str, float]:
    """count, mean, min, max and the requested percentiles (``p50`` ...)."""
    data = [float(x) for x in data]
    out = {"count": len(data), "mean": mean(data),
           "min": min(data) if data else math.nan, "max": max(data) if data else math.nan}
    for p in percentiles:
        out[f"p{p:g}"] = percentile(data, p)
    return out


def geomean(data: Sequence[float]) -> float:
    data = [x for x in data if x > 0]
    return math.exp(sum(math.log(x) for x in data) / len(data)) if data else math.nan


# --- speculative decoding arithmetic ------------------------------------------------
def conditional_acceptance(cumulative: Sequence[float]) -> List[float]:
    """Per-position rates P(draft j accepted | drafts < j accepted).

    ``cumulative[j]`` is the share of drafts whose position j was accepted (the
    vLLM "per-position acceptance rate": accepted_per_pos / num_drafts).
    """
    out, prev = [], 1.0
    for c in cumulative:
        out.append(c / prev if prev > 0 else 0.0)
        prev = c
    return out


def expected_tokens(acceptance: Sequence[float]) -> float:
    """E[tokens per step] = 1 + sum_j prod_{i<=j} a_i, ``a_i`` conditional rates."""
    total, run = 1.0, 1.0
    for a in acceptance:
        run *= a
        total += run
    return total


def step_cost(k: int, c_verify: Dict[int, float], c_draft: float) -> float:
    """Cost of one K-step in plain steps: one verify over K+1 tokens + K drafts."""
    if k == 0:
        return 1.0
    return c_verify[k] + k * c_draft


def ideal_speedup(acceptance: Sequence[float], c_verify: float, c_draft: float) -> float:
    """Speedup over plain decoding if nothing but the passes cost time.

    ``acceptance``: conditional per-position rates a_1..a_K; ``c_verify``: one
    trunk pass over K+1 tokens relative to a plain step; ``c_draft``: one MTP
    draft call relative to a plain step.
    """
    k = len(acceptance)
    cost = c_verify + k * c_draft if k else 1.0
    return expected_tokens(acceptance) / cost


def ideal_speedup_mixed(steps_by_k: Dict[int, int], tokens: int, c_verify: Dict[int, float],
                        c_draft: float) -> Optional[float]:
    """Ideal speedup of a run whose steps used different K (the adaptive controller).

    ``steps_by_k``: number of steps taken at each K; ``tokens``: tokens those
    steps emitted. Equals ``ideal_speedup`` when every step used the same K.
    """
    if any(k and k not in c_verify for k in steps_by_k):
        return None
    cost = sum(n * step_cost(k, c_verify, c_draft) for k, n in steps_by_k.items())
    return tokens / cost if cost > 0 else None


def nan_to_none(x):
    """JSON has no NaN: map NaN/inf to None (recursively)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: nan_to_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [nan_to_none(v) for v in x]
    return x
