"""One row decoding with a block drafter, with injected step costs and acceptance: the real
chooser (``draft_source.RowDrafter`` and its ``block_policy.BlockPolicy``) over the real
step-cost table (``costs.StepCosts``, fed each step's simulated time as the driver feeds
it), no model, no clock. Used by ``tests/test_block_pace.py`` and
``benchmarks/block_pace_sim.py``.

A step verifying w drafts costs ``verify[w]`` plain steps (linear past the table), plus the
drafter's pass if it ran and a head pass per position the MTP head chained, with 5 %
log-normal noise. Machines (plain step = 1):

* ``demo``: the demo model on this CPU (r16 idle bench: c_verify(3) = 1.71, so 0.237 a
  position, c_draft 0.18) and its demo DFlash drafter's pass (2 layers of the trunk's 12
  over an 8-slot block and the 4096-token head: 0.3, an estimate);
* ``xeon``: the real shape on this CPU (``benchmarks/results/real_shape_r15_xeon.txt``:
  c_verify 1.86, 2.4, 2.95 at 1..3, c_draft 0.11) with the same pass;
* ``cheap``: a machine where verifying is nearly free (the EPYC's 1.1, 1.15, 1.2, c_draft
  0.09) and the pass 0.1.

Drafters: ``useless`` (no draft ever lands), ``half`` (each position lands with chance 1/2,
given the ones before it did, seeded) and ``right`` (every draft lands). ``run_with_head``
adds the MTP head (the K policy, ``policy.DraftPolicy``) whose drafts land at ``head_lands``:
``block+mtp`` against the head alone.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

from ..decode.costs import StepCosts
from ..decode.draft_source import DraftPlan, DraftSources
from ..decode.policy import DraftPolicy


@dataclass
class Machine:
    verify: Sequence[float]  # plain steps for a verify of 0, 1, 2, .. positions
    block_pass: float  # plain steps the drafter's pass adds
    head_pass: float  # plain steps one chained MTP head pass adds
    noise: float = 0.05

    def step(self, positions: int, block: bool = True, head_passes: int = 0) -> float:
        """A step's cost in plain steps (no noise): ``positions`` verified, after the block
        drafter's pass (``block``, if it drafted any) and ``head_passes`` head passes."""
        v, n = self.verify, len(self.verify) - 1
        cost = v[positions] if positions <= n else v[n] + (positions - n) * (v[n] - v[n - 1])
        return cost + (self.block_pass if block and positions else 0.0) + head_passes * self.head_pass


MACHINES: Dict[str, Machine] = {
    "demo": Machine([1.0, 1.237, 1.474, 1.711], 0.3, 0.18),
    "xeon": Machine([1.0, 1.86, 2.4, 2.95], 0.3, 0.11),
    "cheap": Machine([1.0, 1.1, 1.15, 1.2], 0.1, 0.09),
}

LANDS: Dict[str, float] = {"useless": 0.0, "half": 0.5, "right": 1.0}


@dataclass
class Run:
    tokens: int = 0
    seconds: float = 0.0  # in plain steps
    widths: List[int] = field(default_factory=list)  # block drafts per step

    @property
    def speed(self) -> float:
        """Tokens per plain step's time: 1.0 is plain decoding."""
        return self.tokens / self.seconds

    @property
    def drafting_steps(self) -> int:
        return sum(w > 0 for w in self.widths)


def run(drafter: str, machine: str, tokens: int = 128, width: int = 4,
        fixed: Optional[int] = None, seed: int = 0) -> Run:
    """``tokens`` tokens of one row from a fresh chooser (``fixed``: that width every step
    instead, 0 = plain decoding); ``width``: the drafter's block."""
    rng, m, land = random.Random(seed), MACHINES[machine], LANDS[drafter]
    row, costs = DraftSources("block").drafter(), StepCosts()
    row.fit_block(width)
    out = Run()
    while out.tokens < tokens:
        plan = DraftPlan(block=fixed) if fixed is not None else row.plan(0, True, 1, costs,
                                                                          cap=width)
        w = plan.block
        accepted = next((j for j in range(w) if rng.random() >= land), w)
        seconds = m.step(w) * rng.lognormvariate(0, m.noise)
        costs.observe(1, w, 0, seconds, block=int(w > 0))
        row.record(plan, accepted)
        out.tokens, out.seconds = out.tokens + accepted + 1, out.seconds + seconds
        out.widths.append(w)
    return out


def run_with_head(drafter: str, machine: str, source: str = "block+mtp", tokens: int = 128,
                  head_lands: float = 0.8, width: int = 4, cap: int = 3, seed: int = 0) -> Run:
    """``tokens`` tokens of one row drafting from the head at the K policy's K (up to
    ``cap``) and, for ``block+mtp``, the block drafter (``source="mtp"``: the head alone),
    both fresh; each step recorded as the driver records it. ``widths``: block drafts."""
    rng, m, land = random.Random(seed), MACHINES[machine], LANDS[drafter]
    policy, out = DraftPolicy(), Run()
    row = DraftSources(source).drafter() if source != "mtp" else None
    if row is not None:
        row.fit_block(width)
    while out.tokens < tokens:
        k = policy.choose(1, cap)
        plan = row.plan(k, True, 1, policy.costs, cap) if row is not None else DraftPlan([], k)
        block = min(plan.block, width)  # past the block, the head chains (fit_plans)
        plan = DraftPlan(block=block, head=plan.head + plan.block - block)
        lands = [land] * block + [head_lands] * plan.head
        accepted = next((j for j, p in enumerate(lands) if rng.random() >= p), len(lands))
        passes = plan.total if plan.head else 0
        seconds = m.step(plan.total, block > 0, passes) * rng.lognormvariate(0, m.noise)
        policy.record_step(1, plan.total, seconds, [accepted], [plan.head], starts=[block],
                           head_passes=passes, block=int(block > 0))
        if row is not None:
            row.record(plan, accepted)
        out.tokens, out.seconds = out.tokens + accepted + 1, out.seconds + seconds
        out.widths.append(block)
    return out


def best_fixed(drafter: str, machine: str, tokens: int = 128, width: int = 4,
               seed: int = 0) -> Run:
    """The fastest fixed width (0 = plain) on the same draws."""
    return max((run(drafter, machine, tokens, width, w, seed) for w in range(width + 1)),
               key=lambda r: r.speed)


def table(tokens: int = 128, seeds: Sequence[int] = range(4),
          report: Callable[[str], None] = print):
    """Adaptive against plain and the best fixed width, per machine and drafter."""
    report(f"{'machine':8} {'drafter':8} {'auto/plain':>10} {'auto/best':>10} {'best w':>6} "
           f"{'drafting steps':>14} {'widths (last 8)':>16} {'block+mtp/mtp':>13}")
    for machine in MACHINES:
        for drafter in LANDS:
            for seed in seeds:
                auto = run(drafter, machine, tokens, seed=seed)
                plain = run(drafter, machine, tokens, fixed=0, seed=seed)
                best = best_fixed(drafter, machine, tokens, seed=seed)
                fused, head = (run_with_head(drafter, machine, s, tokens, seed=seed)
                               for s in ("block+mtp", "mtp"))
                report(f"{machine:8} {drafter:8} {auto.speed / plain.speed:10.3f} "
                       f"{auto.speed / best.speed:10.3f} {best.widths[-1]:6d} "
                       f"{auto.drafting_steps:14d} {str(auto.widths[-8:]):>16} "
                       f"{fused.speed / head.speed:13.3f}")
