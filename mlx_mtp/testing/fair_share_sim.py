"""Streams beside long prompts with injected costs: the engine's loop (``Engine._prefill_round``
then ``_decode_round``) with the real ``DraftPolicy`` and ``FairShare``, no model, no clock.

The costs follow the idle 8k + 30k trace of round 15 on the demo model (docs/reliability.md,
issue 43): at B rows a decode step costs (12 ms + 7.5 ms a row + 1.75 ms a row per 1,000
tokens of the longest context) x (1 + 0.75 K), so 4 rows: 42 ms + 7 ms per 1k, K=3 3.25
plain steps; a prompt chunk 10 ms + per token 4 ms and 0.9 ms per 1,000 tokens of its
context; 97 % of drafts land; 5 % log-normal noise. ``scale`` makes contexts that much
dearer, so a short run grows them as far as a long one. Used by
``tests/test_fair_share_drafting.py`` and ``benchmarks/fair_share_sim.py``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import List, Optional, Sequence

from ..decode.policy import DraftPolicy
from ..server.fair_share import FairShare


@dataclass
class CostModel:
    scale: float = 1.0  # contexts this much dearer
    fixed_s: float = 0.01  # a prompt chunk's fixed cost

    def step(self, rows: int, k: int, context: int) -> float:
        per_row = 0.0075 + 0.00175 * context * self.scale / 1000
        return (0.012 + rows * per_row) * (1 + 0.75 * k)

    def chunk(self, tokens: int, context: int) -> float:
        return self.fixed_s + tokens * (0.004 + 0.0009 * context * self.scale / 1000)


@dataclass
class Run:
    solo: List[float]  # the streams' gaps alone, before the prompts
    during: List[float] = field(default_factory=list)  # while prompts are in prefill
    ks: List[int] = field(default_factory=list)  # the streams' K per step during
    tokens: int = 0  # the streams' tokens during
    fair: Optional[FairShare] = None


class PlainAllowance(FairShare):
    """The prompts' turn sized by a plain step's cost (``plain_s``, from the cost table)
    instead of the measured rounds: the direction tried and left out (docs/reliability.md)."""

    plain_s = None

    def typical_s(self) -> float:
        return self.plain_s or super().typical_s()


def run(prompts: Sequence[int], seed: int = 0, streams: int = 4,
        costs: Optional[CostModel] = None, cap: Optional[float] = DraftPolicy.PROMPT_CAP,
        plain_allowance: bool = False, accept: float = 0.97) -> Run:
    """``streams`` alone for 300 steps, then ``prompts`` arriving together until every one
    is processed. ``cap``: the policy's ``PROMPT_CAP`` (None: K beside prompts as before
    the cap, the rows' own)."""
    rng, policy, costs = random.Random(seed), DraftPolicy(), costs or CostModel()
    fair = PlainAllowance() if plain_allowance else FairShare()
    if cap is None:
        policy.costs.deepest_within = lambda B, max_k, ratio: max_k
    else:
        policy.PROMPT_CAP = cap
    rows = [SimpleNamespace(schedule=None, max_k=3, can_draft=lambda: True)] * streams
    contexts = [100] * streams

    def decode(load: int, competing: bool):
        B = len(contexts)  # as BatchDecoder.choose_ks asks
        k = policy.row_ks(rows, max(B, load), load > B, list(contexts))[0]
        seconds = costs.step(B, k, max(contexts)) * rng.lognormvariate(0, 0.05)
        accepted = [next((j for j in range(k) if rng.random() > accept), k) for _ in rows]
        contexts[:] = [c + n + 1 for c, n in zip(contexts, accepted)]
        policy.record_step(B, k, seconds, accepted, contexts=list(contexts))
        fair.decode_ran(seconds, competing)
        return seconds, k, sum(accepted) + B

    for B in range(1, streams + 1):  # the streams join one by one
        for _ in range(30):
            k = policy.choose(B, 3, False, contexts[:B])
            policy.record_step(B, k, costs.step(B, k, 100), [k] * B, contexts=contexts[:B])
    out = Run(solo=[decode(streams, False)[0] for _ in range(300)], fair=fair)
    done, lengths = [0] * len(prompts), list(prompts)
    while any(d < n for d, n in zip(done, lengths)):
        if len(out.during) >= 10 ** 5:
            raise RuntimeError("the prompts did not finish")
        left = {p: lengths[p] - done[p] for p in range(len(prompts)) if done[p] < lengths[p]}
        if plain_allowance:
            fair.plain_s = policy.costs.predict(streams, 0)
        wall = _prompts_turn(fair, costs, rng, left, done, 128 - streams * 4)
        seconds, k, tokens = decode(streams + len(left), True)
        out.during.append(wall + seconds)
        out.ks.append(k)
        out.tokens += tokens
    return out


def _prompts_turn(fair, costs, rng, left, done, room) -> float:
    """One iteration's prompt chunks (``Engine._prefill_round``); returns their seconds."""
    spent, wall = 0, 0.0
    for p in fair.order(dict(left)):
        n = 1
        while left[p] and n:
            n = min(fair.budget(room - spent, 8, 512, p), left[p]) if room - spent >= 8 else 0
            if n:
                seconds = costs.chunk(n, done[p]) * rng.lognormvariate(0, 0.05)
                fair.prefill_ran(seconds, n, True, p)
                done[p], left[p], spent, wall = done[p] + n, left[p] - n, spent + n, wall + seconds
        if not n:
            break
    return wall


def p99(values: Sequence[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))]
