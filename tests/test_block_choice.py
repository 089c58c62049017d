"""The chooser prices the block drafter's pass (decode/draft_source.py, decode/costs.py):
one more cost kind in the step-cost table, and a row that drafts from the block drafter
pauses it, like the head, when its measured acceptance does not pay for the pass. Decided
on a synthetic cost table and synthetic acceptance, not by timing."""

import pytest

from mlx_mtp.decode.block_policy import RECHECKS
from mlx_mtp.decode.costs import StepCosts
from mlx_mtp.decode.draft_source import DraftPlan, DraftSources

PLAIN, PER_POSITION, HEAD_PASS = 10.0, 0.5, 2.0  # ms: a step, a verified position, a head pass
WIDTH = 4  # the block drafter's drafts per pass


def _costs(block_pass=6.0, head_pass=HEAD_PASS) -> StepCosts:
    """Measured steps: verifies of 0, 2, 4 and 8 positions, the same after a block pass,
    and head chains of 2 and 4."""
    costs = StepCosts()
    for _ in range(3):
        for k in (0, 2, 4, 8):
            costs.observe(1, k, 0, PLAIN + PER_POSITION * k)
            costs.observe(1, k, 0, PLAIN + PER_POSITION * k + block_pass, block=1)
        for k in (2, 4):
            costs.observe(1, k, k, PLAIN + (PER_POSITION + head_pass) * k)
    return costs


def _seconds(plan: DraftPlan, block_pass=6.0) -> float:
    """What the synthetic machine takes for a row's step."""
    return (PLAIN + PER_POSITION * plan.total + HEAD_PASS * plan.head
            + (block_pass if plan.block else 0.0))


def _row(source="block"):
    d = DraftSources(source).drafter()
    d.fit_block(WIDTH)
    return d


def test_the_block_pass_is_a_cost_kind_of_its_own():
    costs = _costs()
    assert costs.block_pass(1) == pytest.approx(6.0)
    assert costs.predict_plan(1, 3, 0, block=1) == pytest.approx(PLAIN + 1.5 + 6.0)
    assert costs.predict_plan(1, 3, 0) == pytest.approx(PLAIN + 1.5)  # no pass, no cost
    assert costs.verify(1, 4) == pytest.approx(PLAIN + 2.0)  # block steps leave it alone
    assert costs.head_pass(1) == pytest.approx(HEAD_PASS)
    assert costs.predict(1, 4) == pytest.approx(PLAIN + 10.0)  # the K policy's head cell
    assert (1, 4, 0) in costs.block_cells and costs.cells[(1, 4, 0)][0] == PLAIN + 2.0
    costs.observe(1, 6, 6, PLAIN + 3.0 + 6 * HEAD_PASS + 6.0, block=1)  # block + head chain
    assert costs.block_pass(1) == pytest.approx(6.0)
    assert StepCosts().block_pass(1) == 0.0  # unmeasured: optimistic, as the head pass


def test_a_useless_drafter_pauses_and_runs_at_least_095_of_plain():
    """Nothing it drafts lands: it drafts until its upper estimate stops paying, then
    probes now and then (doubling gaps); over 400 steps the row emits tokens at >= 0.95x
    the plain rate of the same machine."""
    row, costs = _row(), _costs()
    tokens, seconds, drafting = 0, 0.0, []
    for _ in range(400):
        plan = row.plan(0, True, 1, costs, cap=WIDTH)
        row.record(plan, 0)
        tokens, seconds = tokens + 1, seconds + _seconds(plan)
        drafting.append(plan.block > 0)
    assert tokens / seconds >= 0.95 / PLAIN
    assert drafting[0] and not all(drafting[-100:]) and any(drafting[50:])  # paused, probed


def test_a_drafter_that_lands_drafts_its_whole_block_even_with_the_head_paused():
    row, costs = _row(), _costs()
    for _ in range(10):
        row.record(DraftPlan(block=WIDTH), WIDTH)
    assert row.plan(0, True, 1, costs, cap=WIDTH) == DraftPlan(block=WIDTH)
    assert row.plan(0, True, 1, costs, cap=2) == DraftPlan(block=2)  # the row's own K
    assert row.plan(0, False, 1, costs, cap=WIDTH) == DraftPlan()  # the row cannot draft


def test_the_price_of_the_pass_decides_at_the_same_acceptance():
    """Half of each position's drafts land: worth a 6 ms pass (1.94 tokens in 17 ms against
    1 in 10), not a 30 ms one."""
    for block_pass, drafts in ((6.0, True), (30.0, False)):
        row, costs = _row(), _costs(block_pass)
        for n in [0, 1, 2, 1, 0, 3, 1, 0, 4, 1] * 10:  # a_j about 1/2 at each position
            row.record(DraftPlan(block=WIDTH), n)
        assert (row.plan(0, True, 1, costs, cap=WIDTH).block > 0) is drafts, block_pass


def test_block_mtp_picks_the_head_or_the_block_by_their_acceptance():
    """``block+mtp``: the head alone where the block drafter misses and the head lands; the
    block where the block drafter lands; extended by the head past it where the head lands
    too and its passes (fed every block token) are cheap enough."""
    costs = _costs()
    row = _row("block+mtp")
    for _ in range(20):
        row.record(DraftPlan(block=WIDTH), 0)
        row.record(DraftPlan([], 4), 4)
    assert row.plan(4, True, 1, costs, cap=4) == DraftPlan([], 4)
    row = _row("block+mtp")
    for _ in range(20):
        row.record(DraftPlan(block=WIDTH), WIDTH)
        row.record(DraftPlan([], 4), 0)
    assert row.plan(4, True, 1, costs, cap=4) == DraftPlan(block=WIDTH)
    for head_pass, plan in ((HEAD_PASS, DraftPlan(block=WIDTH)),
                            (0.25, DraftPlan(block=WIDTH + 2))):
        row = _row("block+mtp")
        for _ in range(20):
            row.record(DraftPlan(block=WIDTH, head=2), WIDTH + 2)  # both land
        assert row.plan(4, True, 1, _costs(head_pass=head_pass), cap=WIDTH + 2) == plan


def test_an_autoregressive_drafter_pays_a_pass_per_draft():
    """EAGLE-3 runs one pass per draft (``fit_block(width, pass_per_draft=True)``; the
    driver records a step's passes): the table fits a pass's price from steps of several
    widths and prices a plan by its drafts (an unmeasured width too: priced as one pass,
    3 drafts would look cheaper than the measured 2 and 4), so it drafts as far as its
    drafts land, no further."""
    per_pass, costs = 3.0, StepCosts()
    for _ in range(3):
        for k in (0, 1, 2, 4):
            costs.observe(1, k, 0, PLAIN + PER_POSITION * k)
            if k:
                costs.observe(1, k, 0, PLAIN + PER_POSITION * k + per_pass * k, block=k)
    assert costs.block_pass(1) == pytest.approx(per_pass)
    assert costs.predict_plan(1, 3, 0, block=3) == pytest.approx(PLAIN + 1.5 + 3 * per_pass)
    for landed in (1, 2, WIDTH):
        row = DraftSources("block").drafter()
        row.fit_block(WIDTH, pass_per_draft=True)
        for _ in range(40):
            row.record(DraftPlan(block=WIDTH), landed)
        assert row.plan(0, True, 1, costs, cap=WIDTH) == DraftPlan(block=landed)


def test_a_plain_step_is_timed_before_the_block_drafts():
    """With no plain step measured at this batch size every plan would cost the same and a
    useless drafter would never pause: the row waits for one (``block+mtp``: the head at the
    K policy's choice meanwhile)."""
    assert _row().plan(0, True, 1, StepCosts(), cap=WIDTH) == DraftPlan()
    assert _row("block+mtp").plan(2, True, 1, StepCosts(), cap=WIDTH) == DraftPlan([], 2)
    costs = StepCosts()
    costs.observe(1, 0, 0, PLAIN)
    assert _row().plan(0, True, 1, costs, cap=WIDTH) == DraftPlan(block=1)  # depth 1 first


def test_depth_is_earned_one_position_past_those_that_landed():
    row, costs = _row(), _costs(block_pass=1.0)
    widths = []
    for _ in range(6):
        plan = row.plan(0, True, 1, costs, cap=WIDTH)
        widths.append(plan.block)
        row.record(plan, plan.block)  # every draft lands
    assert widths == [1, 2, 3, 4, 4, 4]


def test_a_resting_block_row_follows_the_k_policy_and_lets_plain_steps_run_ahead():
    """``block+mtp`` with a useless drafter: the head alone at the K policy's K (never a plain
    step the K policy did not choose, whatever the row's own head estimate); a plain step
    when the K policy chose 0. ``has_proposal`` is False while it rests with no probe due (the
    driver may launch a plain step ahead), True before every step that drafts the block. A
    drafter that never landed is first re-checked after ``RECHECKS[1]`` steps."""
    costs = _costs()
    row = _row("block+mtp")
    for _ in range(20):
        row.record(DraftPlan(block=WIDTH), 0)
        row.record(DraftPlan([], 2), 0)  # the row's own head estimate says it misses too
    assert row.plan(2, True, 1, costs, cap=WIDTH) == DraftPlan([], 2)
    plans, ready = [], []
    for _ in range(RECHECKS[1] + 16):
        ready.append(row.has_proposal())
        plans.append(row.plan(0, True, 1, costs, cap=WIDTH))
    assert all(r for r, p in zip(ready, plans) if p.total)
    assert not all(ready) and 1 <= sum(p.block > 0 for p in plans) <= 4  # probes only


def _rested(sources, steps: int, rows: int = 1) -> list:
    """``rows`` rows one after another, ``steps`` steps each, of a useless drafter: whether
    each step drafted."""
    drafted = []
    for _ in range(rows):
        row = sources.drafter()
        row.fit_block(WIDTH)
        for _ in range(steps):
            plan = row.plan(0, True, 1, _COSTS, cap=WIDTH)
            row.record(plan, 0)
            drafted.append(plan.block > 0)
    return drafted


_COSTS = _costs()


def test_rows_joining_later_take_up_the_resting_rows_rechecks():
    """The drafter is the same weights for every row: a row joining resting rows rests until
    their next re-check is due, instead of re-learning with drafts of its own that the
    drafter does not pay; rows of ten steps each, one after another, draft exactly where one
    row of as many steps does (so short requests still re-check it, on schedule)."""
    sources = DraftSources("block")
    one = _rested(sources, 200)
    gap, wait = sources.block_rest
    assert gap >= 16 and wait > 1 and 3 <= sum(one) <= 4  # first misses, then re-checks
    later = sources.drafter()
    later.fit_block(WIDTH)
    assert not later.has_proposal()
    plans = [later.plan(0, True, 1, _COSTS, cap=WIDTH) for _ in range(wait)]
    assert [p.block > 0 for p in plans] == [False] * (wait - 1) + [True]
    assert _rested(DraftSources("block"), 10, rows=20) == one
