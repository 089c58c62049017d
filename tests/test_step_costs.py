"""Step costs kept across processes (decode/step_costs.py): stored, found again under
the same key, measured within a budget when missing, and used from the first step."""

import mlx.core as mx
import pytest
from mlx.utils import tree_map

from mlx_mtp.decode import step_costs
from mlx_mtp.decode.policy import DraftPolicy
from mlx_mtp.testing.tiny import build_model, tiny_text_config


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


def measured(policy):
    return {cell: list(v) for cell, v in policy.costs.cells.items()}


def test_costs_saved_are_loaded_under_the_same_key(tiny_model):
    policy = DraftPolicy(3)
    for s in (0.010, 0.011, 0.012):
        policy.record_step(1, 0, s)
        policy.record_step(1, 2, 2 * s, [1])
    step_costs.save(tiny_model, policy)
    fresh = DraftPolicy(3)
    assert step_costs.load(tiny_model, fresh)
    assert measured(fresh) == measured(policy)


def test_the_key_follows_shapes_and_dtypes_not_values():
    text = tiny_text_config("qwen3_5")
    a, b = build_model("qwen3_5", text, seed=0), build_model("qwen3_5", text, seed=1)
    assert step_costs.cost_key(a) == step_costs.cost_key(b)
    b.update(tree_map(lambda p: p.astype(mx.bfloat16), b.parameters()))
    assert step_costs.cost_key(a) != step_costs.cost_key(b)
    wider = build_model("qwen3_5", tiny_text_config("qwen3_5", hidden=128))
    assert step_costs.cost_key(a) != step_costs.cost_key(wider)


def test_missing_or_broken_files_load_nothing(tiny_model):
    assert not step_costs.load(tiny_model, DraftPolicy(2))
    path = step_costs.cost_file(tiny_model)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    policy = DraftPolicy(2)
    assert not step_costs.load(tiny_model, policy) and not policy.costs.cells


def test_calibration_stays_within_its_budget(tiny_model):
    policy = DraftPolicy(2)
    assert step_costs.calibrate(tiny_model, policy, budget=0.0) < 0.5
    assert not policy.costs.cells  # no time: nothing measured
    spent = step_costs.calibrate(tiny_model, policy, budget=5.0)
    assert spent < 5.0 + 1.0  # a tiny model's steps take milliseconds
    assert {(1, 0), (1, 1), (1, 2)} <= set(policy.costs.cells)


def test_a_fresh_process_calibrates_once_then_reads_the_file(tiny_model):
    first = step_costs.policy_for(tiny_model, 2, budget=5.0)
    assert hasattr(first, "calibration_seconds") and first.costs.cells
    step_costs.save(tiny_model, first)
    second = step_costs.policy_for(tiny_model, 2)
    assert not hasattr(second, "calibration_seconds")
    assert measured(second) == measured(first)


@pytest.mark.parametrize("verify_cost, drafts", [(1.15, True), (3.0, False)])
def test_stored_costs_decide_the_first_step(tiny_model, verify_cost, drafts):
    """Known costs: the first decision drafts where drafting pays (at the prior's
    acceptance) and stays off where it does not; nothing is probed first."""
    stored = DraftPolicy(1)
    for _ in range(4):
        stored.record_step(1, 0, 0.020)
        stored.record_step(1, 1, 0.020 * verify_cost, [1])
    step_costs.save(tiny_model, stored)
    policy = DraftPolicy(1)
    step_costs.load(tiny_model, policy)
    assert (policy.choose(1) > 0) is drafts


def test_serve_reads_stored_costs_and_times_only_missing_batch_sizes(tiny_model):
    """A server start calibrates what no earlier run stored (and stores it); a second
    start with the same key times nothing, a wider one only its new batch size."""
    from mlx_mtp.server.engine import Engine

    def start(max_concurrency):
        engine = Engine(tiny_model, None, num_draft_tokens=2, max_concurrency=max_concurrency,
                        log_interval=0)
        timed, real = [], engine.batch.calibrate
        engine.batch.calibrate = lambda sizes, **kw: timed.append(list(sizes)) or real(sizes, **kw)
        engine._calibrate()
        return engine, timed

    assert not step_costs.cost_file(tiny_model).exists()
    first, timed = start(1)
    assert timed == [[1]] and step_costs.cost_file(tiny_model).exists()
    second, timed = start(1)
    assert timed == []  # everything came from the file
    assert measured(second.batch.policy) == measured(first.batch.policy)
    wider, timed = start(4)
    assert timed == [[4]] and wider.batch.policy.costs.count(4, 2)
