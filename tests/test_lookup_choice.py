"""The per-row choice of draft source (decode/draft_source.py): measured acceptance per
source against the measured cost of verifying that many positions."""

import pytest

from mlx_mtp.decode import check_draft_source
from mlx_mtp.decode.costs import StepCosts
from mlx_mtp.decode.draft_source import DraftPlan, DraftSources
from mlx_mtp.drafters.lookup import LookupSettings


def test_costs_interpolate_between_measured_lengths_and_add_head_passes():
    c = StepCosts()
    for _ in range(3):
        c.observe(1, 0, 0, 10.0)
        c.observe(1, 8, 0, 14.0)
        c.observe(1, 3, 3, 17.0)  # verify(3) = 11.5, so 3 head passes cost 5.5
    assert c.verify(1, 4) == pytest.approx(12.0)
    assert c.verify(1, 20) == pytest.approx(14.0)  # past the longest: optimistic
    assert c.head_pass(1) == pytest.approx(5.5 / 3)
    assert c.predict_plan(1, 3, 3) == pytest.approx(17.0)  # measured
    assert c.predict_plan(1, 5, 5) == pytest.approx(12.5 + 5 * 5.5 / 3)
    assert c.verify(2, 4) is None  # another batch size: nothing measured


def test_first_step_of_a_shape_does_not_decide():
    c = StepCosts()
    c.observe(1, 16, 0, 100.0)  # one-off cost of a new shape
    assert c.verify(1, 16) == 100.0
    c.observe(1, 16, 0, 12.0)
    assert c.verify(1, 16) == 12.0


def _drafter(source="both", max_draft=8, **kw):
    sources = DraftSources(source, LookupSettings(min_match=2, max_match=4,
                                                  max_draft=max_draft), **kw)
    d = sources.drafter()
    d.extend([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2])  # proposal: 3..10
    return sources, d


def _cheap_verify(per_position=0.05):
    costs = StepCosts()
    for _ in range(3):
        for k in (0, 4, 8):
            costs.observe(1, k, 0, 1.0 + per_position * k)
        costs.observe(1, 3, 3, 1.6)
    return costs


def test_copies_when_the_context_has_been_right():
    sources, d = _drafter()
    costs = _cheap_verify()
    for _ in range(10):
        d.record(DraftPlan([0] * 8), 8)
    assert d.plan(3, True, 1, costs) == DraftPlan([3, 4, 5, 6, 7, 8, 9, 10])


def test_uses_the_head_when_the_context_has_been_wrong_and_probes_it_again():
    sources, d = _drafter()
    costs = _cheap_verify()
    for _ in range(10):
        d.record(DraftPlan([0] * 8), 0)
        d.record(DraftPlan([], 3), 3)
    plans = [d.plan(3, True, 1, costs) for _ in range(12)]
    assert plans[0] == DraftPlan([], 3)
    probes = [i for i, p in enumerate(plans) if p.fixed]
    assert probes == [3, 11]  # after 4 steps, then 8 (doubling)


def test_verify_cost_sets_the_length():
    sources, d = _drafter()
    costs = _cheap_verify(per_position=0.5)  # each verified position costs half a step
    for _ in range(10):
        d.record(DraftPlan([0] * 8), 2)  # the first two land, the third never
    assert d.plan(0, False, 1, costs) == DraftPlan([3, 4])


def test_a_run_that_ends_with_the_context_is_extended_by_the_head():
    sources, d = _drafter(max_draft=16, adaptive=False)
    costs = StepCosts()
    assert d.plan(2, True, 1, costs) == DraftPlan([3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2], 2)
    assert d.plan(0, False, 1, costs).head == 0  # the head paused or absent: the context alone
    lookup_only = DraftSources("lookup", LookupSettings(min_match=2, max_draft=16),
                               adaptive=False).drafter()
    lookup_only.extend([1, 2, 3, 1, 2])
    assert lookup_only.plan(3, True, 1, costs) == DraftPlan([3, 1, 2])


def test_no_match_leaves_the_head_its_k():
    sources, d = _drafter()
    d.extend([99])
    assert d.plan(3, True, 1, StepCosts()) == DraftPlan([], 3)
    assert DraftSources("mtp").drafter() is None
    with pytest.raises(ValueError, match="draft_source must be one of mtp, lookup, both"):
        check_draft_source("ngram")


def test_a_rows_drafting_is_chosen_once():
    """``for_row``: the row's head cap and context drafter, from its own fields or the
    setting's; num_draft_tokens 0 drafts from no source (issue 43)."""
    both = DraftSources("both")
    k, d = both.for_row(3)
    assert k == 3 and d.source == "both"
    assert both.for_row(3, k=0) == (0, None)  # no drafts at all, the default source both
    assert both.for_row(3, k=0, source="lookup") == (0, None)
    assert both.for_row(3, k=2, source="mtp") == (2, None)
    k, d = both.for_row(3, source="lookup")
    assert k == 0 and d.source == "lookup"  # the head does not draft
    k, d = both.for_row(0, has_head=False)  # a server without head: the context alone
    assert k == 0 and d.source == "both"
    assert DraftSources("mtp").for_row(3) == (3, None)


def test_drafting_must_beat_a_plain_step_by_the_margin():
    from mlx_mtp.decode.policy import AcceptanceEstimate

    sources, d = _drafter()
    costs = StepCosts()
    for _ in range(3):
        for k in (0, 8):
            costs.observe(1, k, 0, 1.0 + 0.07 * k)
    d.acceptance["lookup"] = AcceptanceEstimate(32, 0.97, 1e9, prior=0.1)  # a1 = 0.1
    # One context draft: 1.1 tokens for 1.07 of a plain step, 2.8 % better: not enough.
    assert d.plan(0, False, 1, costs) == DraftPlan()
    d.acceptance["lookup"] = AcceptanceEstimate(32, 0.97, 1e9, prior=0.2)
    assert d.plan(0, False, 1, costs) == DraftPlan([3])
