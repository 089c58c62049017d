"""Step costs kept across processes (decode/step_costs.py): stored, found again under
the same key, measured within a budget when missing, and used from the first step."""

import time

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
    policy = DraftPolicy()
    for s in (0.010, 0.011, 0.012):
        policy.record_step(1, 0, s)
        policy.record_step(1, 2, 2 * s, [1])
    step_costs.save(tiny_model, policy.costs)
    fresh = DraftPolicy()
    assert step_costs.load(tiny_model, fresh.costs)
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
    assert not step_costs.load(tiny_model, DraftPolicy().costs)
    path = step_costs.cost_file(tiny_model)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    policy = DraftPolicy()
    assert not step_costs.load(tiny_model, policy.costs) and not policy.costs.cells


def test_a_file_of_the_old_format_is_ignored(tiny_model):
    """Format 1 kept two tables ((B, K) cells and context cells): not read, no error."""
    import json

    path = step_costs.cost_file(tiny_model)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"format": "mlx-mtp-step-costs-1", "cells": [[1, 0, [0.01]]],
                                "context_cells": [[1, 16, 0, [0.03]]]}))
    policy = DraftPolicy()
    assert not step_costs.load(tiny_model, policy.costs) and not policy.costs.cells


def test_calibration_stays_within_its_budget(tiny_model):
    policy = DraftPolicy()
    assert step_costs.calibrate(tiny_model, policy, 2, budget=0.0) < 0.5
    assert not policy.costs.cells  # no time: nothing measured
    spent = step_costs.calibrate(tiny_model, policy, 2, budget=5.0)
    assert spent < 5.0 + 1.0  # a tiny model's steps take milliseconds
    assert {(1, 0, 0), (1, 1, 1), (1, 2, 2)} <= set(policy.costs.cells)


def test_a_fresh_process_calibrates_once_then_reads_the_file(tiny_model):
    first = step_costs.policy_for(tiny_model, 2, budget=5.0)
    assert hasattr(first, "calibration_seconds") and first.costs.cells
    step_costs.save(tiny_model, first.costs)
    second = step_costs.policy_for(tiny_model, 2)
    assert not hasattr(second, "calibration_seconds")
    assert measured(second) == measured(first)


@pytest.mark.parametrize("verify_cost, drafts", [(1.15, True), (3.0, False)])
def test_stored_costs_decide_the_first_step(tiny_model, verify_cost, drafts):
    """Known costs: the first decision drafts where drafting pays (at the prior's
    acceptance) and stays off where it does not; nothing is probed first."""
    stored = DraftPolicy()
    for _ in range(4):
        stored.record_step(1, 0, 0.020)
        stored.record_step(1, 1, 0.020 * verify_cost, [1])
    step_costs.save(tiny_model, stored.costs)
    policy = DraftPolicy()
    step_costs.load(tiny_model, policy.costs)
    assert (policy.choose(1, 1) > 0) is drafts


def test_serve_reads_stored_costs_and_times_only_missing_batch_sizes(tiny_model):
    """A server start calibrates what no earlier run stored (and stores it); a second
    start with the same key times nothing, a wider one only its new batch size."""
    from mlx_mtp.server.engine import Engine

    def start(max_concurrency):
        engine = Engine(tiny_model, None, num_draft_tokens=2, max_concurrency=max_concurrency,
                        log_interval=0)
        timed, real = [], engine.batch.calibrate
        engine.batch.calibrate = lambda k, sizes, **kw: (timed.append(list(sizes))
                                                         or real(k, sizes, **kw))
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


def test_context_draft_costs_are_kept_beside_the_head_step_costs(tiny_model):
    """Context drafts' step costs (8-32 positions deep, measured only by live steps) are
    cells of the same table and survive the process with it; saving an empty table keeps
    the stored one."""
    policy = DraftPolicy()
    for s in (0.010, 0.012):
        policy.record_step(1, 0, s)
        policy.record_step(1, 16, 3 * s, [0], [0], starts=[16], head_passes=0)
        policy.record_step(1, 18, 4 * s, [0], [2], starts=[16], head_passes=18)
    assert set(policy.costs.cells) == {(1, 0, 0), (1, 16, 0), (1, 18, 18)}
    step_costs.save(tiny_model, policy.costs)
    fresh = DraftPolicy()
    assert step_costs.load(tiny_model, fresh.costs)
    assert measured(fresh) == measured(policy)
    # A fresh process predicts the cost of a 16-deep context step from its first step.
    assert DraftPolicy().costs.predict_plan(1, 16, 0) is None
    assert fresh.costs.predict_plan(1, 16, 0) == pytest.approx(0.036)
    step_costs.save(tiny_model, DraftPolicy().costs)  # nothing measured: the file stays
    again = DraftPolicy()
    assert step_costs.load(tiny_model, again.costs)
    assert measured(again) == measured(policy)


def test_serve_keeps_context_draft_costs_across_starts(tiny_model):
    """What a server's live steps measured (context drafts too) is stored at shutdown and
    read at the next start (with calibration, i.e. this machine's costs, on)."""
    from mlx_mtp.decode.draft_source import DraftSources
    from mlx_mtp.server.engine import Engine

    def engine():
        return Engine(tiny_model, None, num_draft_tokens=2, max_concurrency=1, log_interval=0,
                      draft_sources=DraftSources("both"))

    first = engine()
    first.start()
    first.batch.policy.costs.observe(1, 16, 0, 0.05)  # as a live 16-deep context step would
    first.shutdown()
    second = engine()
    second.start()
    try:
        deadline = time.time() + 60
        costs = second.batch.policy.costs
        while (1, 16, 0) not in costs.cells and time.time() < deadline:
            time.sleep(0.05)  # the engine thread loads before its calibration
        assert list(costs.cells.get((1, 16, 0), [])) == [0.05]
    finally:
        second.shutdown()


def test_generate_stores_what_its_context_drafts_cost(tiny_ckpt, tmp_path):
    """The oracle trunk predicts id + 1 and the digits' ids are consecutive: the answer
    runs "./0123..." and copies the prompt's digits once it reaches them (a context step
    after the first, which has no previous read to be timed from)."""
    import json
    import os
    import subprocess
    import sys

    model = tiny_ckpt("qwen3_5", "oracle", trunk_scale=0.1, vocab_size=4096)
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    p = subprocess.run([sys.executable, "-m", "mlx_mtp.cli", "generate", "--model", str(model),
                        "--prompt", "0123456789-", "-m", "24",
                        "--ignore-chat-template", "--draft-source", "lookup"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    files = list((tmp_path / "cache" / "mlx-mtp" / "step-costs").glob("*.json"))
    assert len(files) == 1
    stored = json.loads(files[0].read_text())
    assert any(k > 1 and head == 0 for _, k, head, _ in stored["cells"]), stored
