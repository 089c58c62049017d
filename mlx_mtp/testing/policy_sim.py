"""The K policy on a fake clock: a fresh ``DraftPolicy`` driven by an acceptance stream and
a stored step-cost table, no model. Used by ``tests/test_policy_sim.py`` and
``benchmarks/policy_sim.py`` (issue 40: the policy's exploration priced by the cost table).

A step drafting K costs ``c_verify(K) + K * c_draft`` plain steps (``c_verify(0) = 1``),
as ``benchmarks/real_shape.py`` measures them; the policy starts as a new process does
(``step_costs.policy_for``): the stored table loaded, no acceptance evidence. Simulated
throughput is tokens per plain step of simulated time, so 1.0 is plain decoding.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from ..decode.policy import DraftPolicy

PLAIN_S = 0.25  # a plain step's simulated seconds (only ratios matter)


@dataclass(frozen=True)
class Machine:
    name: str
    c_verify: Tuple[float, float, float]  # trunk over K+1 tokens / plain step, K = 1..3
    c_draft: float  # one head pass / plain step

    def step(self, k: int) -> float:
        """A step drafting k, in plain steps."""
        return 1.0 if k == 0 else self.c_verify[k - 1] + k * self.c_draft


MACHINES = {
    # benchmarks/results/real_shape_r15_xeon.txt: the real 0.8B shape on a 2-core Xeon
    "xeon": Machine("xeon", (1.86, 2.4, 2.95), 0.11),
    # issue 40: the same shape on a 2-core EPYC
    "epyc": Machine("epyc", (1.1, 1.15, 1.2), 0.09),
    # issue 40: the hidden-1024 tiny model (8 layers, vocab 8k)
    "hidden-1024": Machine("hidden-1024", (1.2, 1.58, 1.82), 0.22),
}

Lands = Callable[[int, int], bool]  # (step, draft position) -> accepted


def never(i: int, j: int) -> bool:
    return False


def always(i: int, j: int) -> bool:
    return True


def bernoulli(p: float = 0.65, seed: int = 0) -> Lands:
    """Each draft position of each step lands with probability p, independently; the same
    (step, position) gives the same answer in every run, so fixed K and the policy read one
    stream."""
    rng, draws = random.Random(seed), []

    def lands(i: int, j: int) -> bool:
        while len(draws) <= i:
            draws.append([rng.random() < p for _ in range(3)])
        return draws[i][j]
    return lands


HEADS: Dict[str, Callable[[], Lands]] = {
    "never right": lambda: never, "~65 %": bernoulli, "always right": lambda: always}


def fresh_policy(machine: Machine) -> DraftPolicy:
    """A policy as a new process has it: the stored table loaded (a few steps of each K
    at one row, as ``calibrate`` leaves it), no acceptance."""
    policy = DraftPolicy()
    for _ in range(3):
        for k in range(4):
            policy.costs.observe(1, k, k, machine.step(k) * PLAIN_S)
    return policy


@dataclass
class Run:
    tokens: int
    time: float  # plain steps
    ks: List[int]

    @property
    def throughput(self) -> float:
        """Tokens per plain step of time: 1.0 is plain decoding."""
        return self.tokens / self.time


def run(machine: Machine, lands: Lands, tokens: int, k: Optional[int] = None) -> Run:
    """One sequence until ``tokens`` are emitted (the last step's extra tokens dropped, its
    time kept), by a fresh policy or, with ``k``, at fixed K."""
    policy = fresh_policy(machine)
    out = Run(0, 0.0, [])
    while out.tokens < tokens:
        kk = policy.choose(1, 3) if k is None else k
        n = 0
        while n < kk and lands(len(out.ks), n):
            n += 1
        policy.record_step(1, kk, machine.step(kk) * PLAIN_S, [n])
        out.ks.append(kk)
        out.tokens = min(tokens, out.tokens + n + 1)
        out.time += machine.step(kk)
    return out


def compare(machine: Machine, head: str, tokens: int) -> Tuple[Run, Dict[int, Run]]:
    """The policy and every fixed K (0: plain) on one head's stream."""
    return (run(machine, HEADS[head](), tokens),
            {k: run(machine, HEADS[head](), tokens, k) for k in range(4)})
