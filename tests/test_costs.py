"""The one step-cost table (decode/costs.py): each reader's question answered from the same
cells, and the driver recording every step once, with one clock."""

from pathlib import Path

import pytest

from mlx_mtp.decode.costs import StepCosts
from mlx_mtp.decode.draft_source import DraftSources
from mlx_mtp.drafters.lookup import LookupSettings
from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.decode.speculative import MTPDecoder
from mlx_mtp.models.io.loader import load_model

# The oracle trunk predicts t+1: restarting the cycle makes the answer a copy of the context.
CYCLE = list(range(100, 150))
COPY_PROMPT = CYCLE + [7, 8] + CYCLE[:6]


def head_steps(costs, ms):
    for B in (1, 2, 4):
        for K, t in enumerate(ms):
            for _ in range(3):
                costs.observe(B, K, K, B * t)


def test_the_policy_reads_head_steps_the_chooser_every_cell():
    costs, with_context = StepCosts(), StepCosts()
    head_steps(costs, (10.0, 12.0, 14.0))
    head_steps(with_context, (10.0, 12.0, 14.0))
    for _ in range(3):
        with_context.observe(1, 16, 0, 11.0)  # a context run: verified, no head pass
        with_context.observe(1, 6, 2, 99.0)  # a run extended by two head passes
    for B, K in [(1, 3), (2, 3), (8, 1)]:  # fitted, unmeasured: context cells left out
        assert with_context.predict(B, K) == costs.predict(B, K)
    assert with_context.count(1, 0) == 3 and with_context.count(1, 16) == 0
    # The chooser interpolates verify costs over plain and context-only steps...
    assert with_context.verify(1, 8) == pytest.approx(10.0 + 1.0 * 8 / 16)
    # ...and a step it never measured costs that plus its head passes.
    assert with_context.predict_plan(1, 16, 16) == pytest.approx(
        11.0 + 16 * with_context.head_pass(1))
    assert with_context.predict_plan(1, 6, 2) == 99.0  # measured


class CountingTuner:
    def __init__(self):
        self.seen, self.rejected = [], []

    def observe(self, tokens, table, rejected=()):
        self.seen.append(list(tokens))
        self.table = table
        self.rejected.append(list(rejected))
        return [False] * len(rejected)


def test_the_driver_records_each_step_once_and_feeds_the_tuner(tiny_ckpt):
    model, _ = load_model(Path(tiny_ckpt("qwen3_5", "oracle", trunk_scale=0.1)))
    model.use_draft_vocab_tuner(CountingTuner())
    sources = DraftSources("both", LookupSettings(), adaptive=False)
    dec = MTPDecoder(model, 3, SamplingParams(), adaptive=False, overlap=False,
                     drafter=sources.drafter())
    observed = []
    observe = dec.policy.costs.observe
    dec.policy.costs.observe = lambda *cell: observed.append(cell[:3]) or observe(*cell)
    dec.prefill(COPY_PROMPT)
    outs = [dec.step() for _ in range(12)]
    assert model.draft_vocab_tuner.seen == [o.tokens for o in outs]
    assert model.draft_vocab_tuner.table is dec.policy.costs  # the one table, read by the tuner
    # The target's token where a head draft was rejected (not where a context draft was).
    assert model.draft_vocab_tuner.rejected == [
        [o.tokens[o.num_accepted]] if o.lookup_drafted <= o.num_accepted < o.num_drafted else []
        for o in outs]
    shapes = [(1, o.num_drafted, o.num_drafted if o.head_drafted else 0) for o in outs]
    assert observed == shapes[1:]  # the first step: no read before it to time from
    assert any(o.lookup_drafted for o in outs[1:]) and any(o.head_drafted for o in outs)
    assert all(o.num_drafted and o.head_drafted <= 3 for o in outs)
