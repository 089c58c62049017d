"""Cost model: exact arithmetic on given acceptance and pass-cost ratios."""

import pytest

from mlx_mtp.bench import cost_model as cm


def test_speedup_is_expected_tokens_over_step_cost():
    p = cm.CostProfile("x", verify_base=1.0, verify_per_draft=0.1, draft=0.05)
    # E_2 = 1 + 0.8 + 0.8 * 0.5 = 2.2; cost = (1.0 + 0.2) + 2 * 0.05 = 1.3
    assert cm.step_cost(p, 2) == pytest.approx(1.3)
    assert cm.predicted_speedup([0.8, 0.5], p) == pytest.approx(2.2 / 1.3)
    assert cm.step_cost(p, 0) == 1.0 and cm.predicted_speedup([], p) == 1.0
    # all accepted, free passes: K+1 tokens per plain step
    free = cm.CostProfile("free", 1.0, 0.0, 0.0)
    assert cm.predicted_speedup([1.0] * 3, free) == pytest.approx(4.0)
    # overhead counts as plain steps
    slow = cm.CostProfile("o", 1.0, 0.0, 0.0, overhead=1.0)
    assert cm.predicted_speedup([1.0], slow) == pytest.approx(1.0)


def test_measured_profile_and_rows():
    m = cm.MeasuredProfile("cpu", {1: 1.5, 3: 2.5}, 0.25)
    rows = cm.prediction_rows({1: [0.5], 3: [1.0, 0.5, 0.5]}, [m])
    assert [(r["k"], r["c_verify"], r["c_draft"]) for r in rows] == [(1, 1.5, 0.25), (3, 2.5, 0.25)]
    assert rows[0]["expected_tokens"] == pytest.approx(1.5)
    assert rows[0]["speedup"] == pytest.approx(1.5 / 1.75)
    assert rows[1]["expected_tokens"] == pytest.approx(1 + 1 + 0.5 + 0.25)
    assert rows[1]["speedup"] == pytest.approx(2.75 / 3.25)
    with pytest.raises(ValueError, match="K=2"):
        cm.prediction_rows({2: [0.5]}, [m])
    table = cm.markdown(rows)
    assert "| cpu | 0.86× (1.50) | 0.85× (2.50) |" in table


def test_gpu_like_profiles_and_best_k():
    gpu = cm.HYPOTHETICAL[0]
    assert gpu.c_verify(3) == pytest.approx(1.1)
    assert cm.HYPOTHETICAL[1].c_verify(3) == pytest.approx(1.3)
    # Cheap verify: drafting deeper pays while acceptance holds ...
    assert cm.best_k([1.0, 1.0, 1.0], gpu) == 3
    # ... never with a head that is always wrong ...
    assert cm.best_k([0.0, 0.0, 0.0], gpu) == 0
    # ... and a verify that costs K+1 plain steps never pays, even at 100%.
    bound = cm.HYPOTHETICAL[-1]
    assert cm.predicted_speedup([1.0], bound) == pytest.approx(2 / 2.06)
    assert cm.best_k([1.0, 1.0, 1.0], bound) == 0


def test_main_prints_every_example(capsys):
    cm.main()
    out = capsys.readouterr().out
    for label in cm.ACCEPTANCE_EXAMPLES:
        assert label in out
    assert out.count("| GPU-like: verify 1.1 at K=3, draft 0.06 |") == len(cm.ACCEPTANCE_EXAMPLES)
