"""Benchmark arithmetic: percentiles (against numpy) and the ideal-speedup model."""

import math

import numpy as np
import pytest

from mlx_mtp.bench import stats as st
from mlx_mtp.decode.speculative import SpecStats


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101, 1000])
def test_percentile_matches_numpy(n):
    rng = np.random.default_rng(n)
    data = rng.lognormal(size=n).tolist()
    for p in [0, 1, 5, 25, 50, 75, 90, 95, 99, 99.9, 100]:
        assert st.percentile(data, p) == pytest.approx(np.percentile(data, p), rel=1e-12, abs=1e-12)
    assert st.median(data) == pytest.approx(np.median(data))
    assert st.mean(data) == pytest.approx(np.mean(data))
    if n > 1:
        assert st.stdev(data) == pytest.approx(np.std(data, ddof=1))


def test_percentile_edge_cases():
    assert math.isnan(st.percentile([], 50))
    assert st.percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input
    with pytest.raises(ValueError):
        st.percentile([1.0], 101)
    s = st.summarize([1, 2, 3, 4])
    assert s["count"] == 4 and s["p50"] == 2.5 and s["min"] == 1 and s["max"] == 4


def test_expected_tokens_and_ideal_speedup_on_made_up_costs():
    a = [0.8, 0.5]  # conditional acceptance at positions 1, 2
    # E = 1 + 0.8 + 0.8 * 0.5 = 2.2 tokens per step; cost = 1.2 + 2 * 0.1 = 1.4 plain steps.
    assert st.expected_tokens(a) == pytest.approx(2.2)
    assert st.ideal_speedup(a, c_verify=1.2, c_draft=0.1) == pytest.approx(2.2 / 1.4)
    # Perfect acceptance, free passes: K+1 tokens per plain step.
    assert st.ideal_speedup([1.0] * 3, 1.0, 0.0) == pytest.approx(4.0)
    # No acceptance: the step only costs more.
    assert st.ideal_speedup([0.0] * 3, 1.5, 0.2) == pytest.approx(1 / 2.1)
    assert st.ideal_speedup([], 1.0, 0.3) == 1.0
    assert st.step_cost(0, {}, 0.3) == 1.0
    assert st.step_cost(2, {2: 1.2}, 0.1) == pytest.approx(1.4)


def test_conditional_from_cumulative_matches_engine_mean_acceptance_length():
    s = SpecStats()
    # K = 3, accepted counts per step
    for n in [3, 3, 2, 1, 0, 3, 2, 0, 1, 3]:
        s.record(3, n)
    cond = st.conditional_acceptance(s.acceptance_per_pos)
    assert cond[0] == pytest.approx(s.acceptance_per_pos[0])
    for j in range(1, 3):
        assert cond[j] == pytest.approx(s.acceptance_per_pos[j] / s.acceptance_per_pos[j - 1])
    # With a fixed K, E[tokens/step] from conditional rates = engine's mean acceptance length.
    assert st.expected_tokens(cond) == pytest.approx(s.mean_acceptance_length)
    assert st.conditional_acceptance([0.5, 0.0, 0.0]) == [0.5, 0.0, 0.0]


def test_mixed_ideal_reduces_to_fixed_k():
    c_verify, c_draft = {1: 1.1, 2: 1.25}, 0.2
    # 10 steps at K=2 with E = 2.5 tokens each
    assert st.ideal_speedup_mixed({2: 10}, 25, c_verify, c_draft) == pytest.approx(2.5 / 1.65)
    # 4 plain steps (4 tokens) + 6 K=1 steps (9 tokens)
    assert st.ideal_speedup_mixed({0: 4, 1: 6}, 13, c_verify, c_draft) == pytest.approx(
        13 / (4 + 6 * 1.3))
    assert st.ideal_speedup_mixed({3: 1}, 4, c_verify, c_draft) is None  # K=3 cost unknown


def test_nan_to_none_is_recursive():
    assert st.nan_to_none({"a": [1.0, float("nan")], "b": float("inf")}) == {"a": [1.0, None],
                                                                               "b": None}
