"""The block drafter's width and pause by the K policy (issue 36, "No harm"), checked
load-independently: ``mlx_mtp.testing.block_pace_sim`` runs one row through the real chooser
(``RowDrafter`` and its ``BlockPolicy``) and the real step-cost table, fed injected step costs
(the demo model and the real shape on this CPU, a machine where verifying is nearly free) and
seeded acceptance; no model, no clock. Each run starts from a fresh chooser."""

import pytest

from mlx_mtp.decode.costs import BlockSteps, StepCosts
from mlx_mtp.testing.block_pace_sim import MACHINES, best_fixed, run, run_with_head

SEEDS = range(3)


@pytest.mark.parametrize("machine", list(MACHINES))
def test_a_useless_drafter_drafts_at_most_4_steps_per_128_tokens(machine):
    """Nothing lands: a few first misses, then re-checks within the budget; at least 0.95x
    plain decoding over 128 tokens and over 512."""
    for seed in SEEDS:
        for tokens in (128, 512):
            auto = run("useless", machine, tokens, seed=seed)
            plain = run("useless", machine, tokens, fixed=0, seed=seed)
            assert auto.drafting_steps <= 4 * tokens // 128, (tokens, seed, auto.widths)
            assert auto.speed >= 0.95 * plain.speed, (tokens, seed)


@pytest.mark.parametrize("machine", list(MACHINES))
def test_an_always_right_drafter_reaches_its_whole_block(machine):
    """Every draft lands: the width climbs, one position past those that landed, to the
    block (4) within the first 64 tokens from a fresh chooser (where one or two positions
    cannot pay, this CPU's real shape, after its re-checks) and stays there (a thin width's
    cost probe aside)."""
    for seed in SEEDS:
        run_ = run("right", machine, 512, seed=seed)
        first = run_.widths.index(4)
        assert sum(w + 1 for w in run_.widths[:first]) <= 64, run_.widths[:first + 1]
        rest = run_.widths[first:]
        assert sum(w == 4 for w in rest) >= 0.95 * len(rest), rest


@pytest.mark.parametrize("machine", list(MACHINES))
def test_a_half_right_drafter_is_within_5_percent_of_the_best_fixed_width(machine):
    """Each position lands with chance 1/2: plain decoding is best where verifying is dear
    (this CPU), width 3-4 where it is nearly free; the chooser finds either within 5 % over
    512 tokens, against the best fixed width on the same draws."""
    for seed in SEEDS:
        auto = run("half", machine, 512, seed=seed)
        best = best_fixed("half", machine, 512, seed=seed)
        assert auto.speed >= 0.95 * best.speed, (seed, best.widths[-1], auto.widths[-16:])


@pytest.mark.parametrize("machine", list(MACHINES))
def test_block_mtp_keeps_the_head_when_the_block_drafter_does_not_pay(machine):
    """``block+mtp`` with a useless drafter runs the head (80 % per position) at the K
    policy's K while the block rests: within 3 % of the head alone over six seeds (one
    seed's draws part ways after the first block step); with an always-right drafter it
    beats the head alone."""
    seeds = range(6)
    head = [run_with_head("useless", machine, "mtp", 512, seed=s) for s in seeds]
    fused = [run_with_head("useless", machine, "block+mtp", 512, seed=s) for s in seeds]

    def speed(runs):
        return sum(r.tokens for r in runs) / sum(r.seconds for r in runs)
    assert speed(fused) >= 0.97 * speed(head)
    assert all(r.drafting_steps <= 16 for r in fused), [r.drafting_steps for r in fused]
    right = [run_with_head("right", machine, "block+mtp", 512, seed=s) for s in seeds]
    assert speed(right) > speed(head)


def test_a_width_wider_than_any_measured_is_unknown():
    """The block drafter's widths read from the table (``BlockSteps``): a measured width is
    its pass plus its verify; one wider than any block step measured is unknown (the verify
    would read flat from the shorter ones and every deeper width look free)."""
    costs = StepCosts()
    for _ in range(3):
        costs.observe(1, 0, 0, 10.0)
        costs.observe(1, 1, 0, 16.0, block=1)
    steps = BlockSteps(costs)
    assert steps.predict(1, 0) == 10.0 and steps.count(1, 0) == 3
    assert steps.predict(1, 1) == 16.0 and steps.count(1, 1) == 3
    assert steps.predict(1, 2) is None and steps.count(1, 2) == 0
    costs.observe(1, 3, 0, 18.0, block=1)
    assert steps.predict(1, 2) is not None  # between measured widths: the table's estimate
    assert not steps.stale(1, 1)
    per_draft = BlockSteps(costs, pass_per_draft=True)
    assert per_draft.predict(1, 3) > steps.predict(1, 3)  # an autoregressive drafter's passes
