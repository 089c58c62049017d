"""Predict the MTP speedup on other hardware from pass-cost ratios and acceptance.

A speculative step at K drafts K tokens (K calls of the MTP head, each
``c_draft`` plain steps) and verifies them in one trunk pass over K+1 tokens
(``c_verify(K)`` plain steps). With conditional per-position acceptance
a_1..a_K it emits E_K = 1 + a_1 + a_1 a_2 + ... tokens, so

    speedup(K) = E_K / (c_verify(K) + K * c_draft + overhead)

where ``overhead`` (plain steps) is what Python, sampling and the host sync add;
``bench`` measures it as realised ÷ ideal. Costs are ratios to a plain decoding
step on the same machine, so acceptance measured anywhere carries over and only
the ratios change with the hardware.

    python -m mlx_mtp.bench.cost_model       # the table for hypothetical profiles
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from .stats import expected_tokens


@dataclass(frozen=True)
class CostProfile:
    """Pass costs in plain steps: c_verify(K) = verify_base + verify_per_draft * K."""

    name: str
    verify_base: float
    verify_per_draft: float
    draft: float
    overhead: float = 0.0

    def c_verify(self, k: int) -> float:
        return self.verify_base + self.verify_per_draft * k


class MeasuredProfile:
    """The costs ``bench`` measured (c_verify per K, c_draft), as a profile."""

    def __init__(self, name: str, c_verify: Dict[int, float], c_draft: float,
                 overhead: float = 0.0):
        self.name, self._c_verify, self.draft, self.overhead = name, dict(c_verify), c_draft, overhead

    def c_verify(self, k: int) -> float:
        return self._c_verify[k]


# Bandwidth-bound decoding (Apple GPUs): a verify over K+1 tokens reads the weights
# once, so it costs little more than a plain step; the draft reads one decoder layer
# and the output layer (a 27B Qwen3.5/3.6: about 6% of the weights at bf16, half of
# that with a 4-bit draft head).
HYPOTHETICAL: List[CostProfile] = [
    CostProfile("GPU-like: verify 1.1 at K=3, draft 0.06", 1.0, 0.1 / 3, 0.06),
    CostProfile("GPU-like: verify 1.3 at K=3, draft 0.06", 1.0, 0.1, 0.06),
    CostProfile("GPU-like: verify 1.3 at K=3, 4-bit draft head 0.03", 1.0, 0.1, 0.03),
    CostProfile("compute-bound: verify K+1, draft 0.06", 1.0, 1.0, 0.06),
]

# Conditional per-position acceptance, for tables without a measured run.
ACCEPTANCE_EXAMPLES: Dict[str, List[float]] = {
    "100%": [1.0, 1.0, 1.0],
    "80% per position": [0.8, 0.8, 0.8],
    "65% first, decaying": [0.65, 0.55, 0.45],
    "0%": [0.0, 0.0, 0.0],
}


def step_cost(profile, k: int) -> float:
    """One step at K in plain steps (K = 0: a plain step)."""
    if k == 0:
        return 1.0
    return profile.c_verify(k) + k * profile.draft + profile.overhead


def predicted_speedup(acceptance: Sequence[float], profile) -> float:
    """E_K / step cost for conditional acceptance a_1..a_K (K = len(acceptance))."""
    k = len(acceptance)
    return expected_tokens(acceptance) / step_cost(profile, k)


def best_k(acceptance: Sequence[float], profile, max_k: Optional[int] = None) -> int:
    """The K (0 = plain) with the highest predicted speedup, drafting the first K
    positions of ``acceptance``."""
    max_k = len(acceptance) if max_k is None else min(max_k, len(acceptance))
    speed = {k: predicted_speedup(acceptance[:k], profile) for k in range(max_k + 1)}
    return max(speed, key=lambda k: (speed[k], -k))


def prediction_rows(acceptance_by_k: Dict[int, Sequence[float]], profiles) -> List[dict]:
    """For each profile and K: c_verify, c_draft, E_K and the predicted speedup."""
    rows = []
    for p in profiles:
        for k, acc in sorted(acceptance_by_k.items()):
            acc = list(acc)[:k]
            if len(acc) != k or k < 1:
                raise ValueError(f"K={k} needs {k} acceptance rates (got {len(acc)})")
            rows.append({"profile": p.name, "k": k, "c_verify": p.c_verify(k),
                         "c_draft": p.draft, "expected_tokens": expected_tokens(acc),
                         "speedup": predicted_speedup(acc, p)})
    return rows


def markdown(rows: List[dict]) -> str:
    """Profiles down, K across: predicted speedup (c_verify(K) in brackets)."""
    ks = sorted({r["k"] for r in rows})
    lines = ["| cost profile | " + " | ".join(f"K={k}" for k in ks) + " |",
             "|---|" + "---:|" * len(ks)]
    for name in dict.fromkeys(r["profile"] for r in rows):
        by_k = {r["k"]: r for r in rows if r["profile"] == name}
        cells = [f"{by_k[k]['speedup']:.2f}× ({by_k[k]['c_verify']:.2f})" if k in by_k else "-"
                 for k in ks]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    for label, acc in ACCEPTANCE_EXAMPLES.items():
        print(f"\nacceptance {label} (conditional per position {acc}): predicted speedup "
              "(c_verify(K))")
        print(markdown(prediction_rows({k: acc[:k] for k in (1, 2, 3)}, HYPOTHETICAL)))


if __name__ == "__main__":
    main()
