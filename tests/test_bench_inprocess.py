"""In-process benchmark on tiny checkpoints: every field present, acceptance = engine stats."""

import csv
import json

import pytest

from mlx_mtp.bench import stats as st
from mlx_mtp.bench.inprocess import BenchConfig, make_settings, run_inprocess
from mlx_mtp.bench.prompts import builtin_prompts, load_prompts
from mlx_mtp.cli import main
from mlx_mtp.decode.prompt import encode_prompt
from mlx_mtp.models.io.loader import load
from mlx_mtp.testing.tiny import make_tiny

ROW_FIELDS = [
    "gen_tps_median", "gen_tps_run_p25", "gen_tps_run_p75", "gen_tps_min", "gen_tps_max",
    "gen_tps_aggregate", "speedup", "prompt_tps_median", "ttft_ms_median", "step_ms",
    "tokens_per_step", "step_cost_measured", "peak_memory_gb", "ideal_speedup", "efficiency",
]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    path = make_tiny(tmp_path_factory.mktemp("oracle"), "qwen3_5", "oracle", vocab_size=4096,
                     trunk_scale=0.1)
    return str(path), *load(str(path))


@pytest.fixture(scope="module")
def random_head(tmp_path_factory):
    path = make_tiny(tmp_path_factory.mktemp("random"), "qwen3_5", "random", vocab_size=4096)
    return str(path), *load(str(path))


def _run(model, tok, ks, max_tokens=12, repeats=1, prompts="builtin:qa"):
    prompts = builtin_prompts(prompts)[:2]
    encoded = [encode_prompt(tok, p.text) for p in prompts]
    cfg = BenchConfig(ks=ks, max_tokens=max_tokens, repeats=repeats, cost_reps=2,
                      warmup_tokens=4, ignore_eos=True)
    ticks = []
    out = run_inprocess(model, prompts, encoded, cfg, progress=ticks.append)
    return out, ticks, prompts


def test_settings_always_include_plain_and_auto():
    names = [s.name for s in make_settings([2, 1])]
    assert names == ["plain", "K=1", "K=2", "auto"]
    assert [s.name for s in make_settings([0], auto=True)] == ["plain"]
    assert make_settings([3], auto=True)[-1].adaptive


def test_inprocess_oracle_every_field_and_engine_consistency(oracle):
    _, model, tok = oracle
    out, ticks, prompts = _run(model, tok, [0, 1, 2])
    rows = {r["setting"]: r for r in out["settings"]}
    assert list(rows) == ["plain", "K=1", "K=2", "auto"]
    from mlx_mtp.bench.inprocess import work_units

    assert len(ticks) == work_units(4, len(prompts), 1)
    for name, r in rows.items():
        for f in ROW_FIELDS:
            assert r[f] is not None and r[f] == r[f], (name, f)  # present and not NaN
        assert r["runs"] == len(prompts)
        assert r["outputs_match_plain"] is True, name  # lossless (greedy)
        assert r["gen_tps_min"] <= r["gen_tps_median"] <= r["gen_tps_max"]
        assert r["peak_memory_gb"] > 0
    assert rows["plain"]["speedup"] == pytest.approx(1.0)
    assert rows["plain"]["num_drafts"] == 0 and rows["plain"]["acceptance_per_pos"] == []
    costs = out["costs"]
    assert set(costs["c_verify"]) == {1, 2} and costs["c_draft"] > 0 and costs["plain_step_ms"] > 0

    for k in (1, 2):
        r = rows[f"K={k}"]
        runs = [x for x in out["runs"] if x.setting == r["setting"]]
        # Acceptance reported = the engine's own SpecStats, summed over runs ...
        assert r["num_drafts"] == sum(x.spec.num_drafts for x in runs)
        assert r["num_draft_tokens"] == sum(x.spec.num_draft_tokens for x in runs)
        assert r["num_accepted_tokens"] == sum(x.spec.num_accepted_tokens for x in runs)
        # ... and matches what the decode loop saw step by step.
        assert r["num_draft_tokens"] == sum(x.own_drafted for x in runs)
        assert r["num_accepted_tokens"] == sum(x.own_accepted for x in runs)
        # The oracle head: every draft accepted, K+1 tokens per step.
        assert r["acceptance_per_pos"] == [1.0] * k
        assert r["mean_acceptance_length"] == pytest.approx(k + 1)
        assert r["acceptance_rate"] == pytest.approx(1.0)
        assert r["c_verify"] == pytest.approx(costs["c_verify"][k])
        assert r["ideal_speedup"] == pytest.approx(
            (k + 1) / (costs["c_verify"][k] + k * costs["c_draft"]))
        assert r["efficiency"] == pytest.approx(r["speedup"] / r["ideal_speedup"])
        assert r["steps_by_k"] == {str(k): r["num_drafts"]}  # fixed K: every step drafts K
    auto = rows["auto"]
    assert auto["k"] == 2 and auto["adaptive"] and auto["c_verify"] is None

    # Per-step figures: one host sync per step, graphs split by part.
    n_gdn = sum(layer.is_linear for layer in model.layers)
    graphs = out["graphs"]
    assert graphs["plain"]["recurrence_calls"] == n_gdn
    for name, r in rows.items():
        assert r["host_syncs_per_step"] == 1.0, name
        assert r["realised_over_ideal"] == r["efficiency"]
    for k in (1, 2):
        g, r = graphs[k], rows[f"K={k}"]
        # verify: one recurrence call per DeltaNet layer; the head has none; a rejection
        # replays one call per layer.
        assert g["verify"]["recurrence_calls"] == n_gdn
        assert g["draft"]["recurrence_calls"] == 0 and g["draft"]["nodes"] > 0
        assert g["replay"]["recurrence_calls"] == n_gdn
        for part in ("draft", "verify", "replay"):
            assert g[part]["own_nodes"] == g[part]["nodes"] - g[part]["recurrence_nodes"]
        # The oracle accepts everything: no replay, one state per DeltaNet layer written.
        assert r["nodes_per_step"] == g["draft"]["nodes"] + g["verify"]["nodes"]
        assert r["state_bytes_per_step"] == g["state_bytes_verify"] == graphs["plain"]["state_bytes"]
    assert graphs[2]["draft"]["nodes"] > graphs[1]["draft"]["nodes"]
    # The cost model on this run: measured profile first, then the hypothetical ones.
    pred = out["predictions"]
    from mlx_mtp.bench.cost_model import HYPOTHETICAL

    assert [p["profile"] for p in pred[::2]] == ["this machine (measured)"] + [
        h.name for h in HYPOTHETICAL]
    measured = {p["k"]: p["speedup"] for p in pred if p["profile"] == "this machine (measured)"}
    assert measured == {k: pytest.approx(rows[f"K={k}"]["ideal_speedup"]) for k in (1, 2)}


def test_inprocess_random_head_accepts_almost_nothing(random_head):
    _, model, tok = random_head
    out, _, _ = _run(model, tok, [0, 2], max_tokens=10)
    r = {r["setting"]: r for r in out["settings"]}["K=2"]
    assert r["num_drafts"] > 0
    assert r["acceptance_rate"] < 0.2
    assert r["mean_acceptance_length"] == pytest.approx(1 + r["num_accepted_tokens"] / r["num_drafts"])
    cond = r["acceptance_per_pos_conditional"]
    assert r["ideal_speedup"] == pytest.approx(
        st.expected_tokens(cond) / (r["c_verify"] + 2 * r["c_draft"]))


def test_cli_bench_writes_all_outputs(oracle, tmp_path):
    path = oracle[0]
    out_dir = tmp_path / "out"
    rc = main(["bench", "--model", path, "--num-draft-tokens", "0,1", "--max-tokens", "8",
               "--repeats", "1", "--prompts", "builtin:qa", "--cost-reps", "1",
               "--warmup-tokens", "2", "-o", str(out_dir), "--quiet"])
    assert rc == 0
    for f in ["inprocess.json", "inprocess.csv", "inprocess_runs.csv", "tok_s_vs_k.png",
              "acceptance_per_pos.png", "README_snippet.md"]:
        assert (out_dir / f).stat().st_size > 0, f
    data = json.loads((out_dir / "inprocess.json").read_text())
    assert [r["setting"] for r in data["settings"]] == ["plain", "K=1", "auto"]
    assert len(data["runs"]) == 3 * 3  # 3 qa prompts x 3 settings
    assert "--num-draft-tokens 0,1" in data["command"] and "--max-tokens 8" in data["command"]
    with open(out_dir / "inprocess.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["setting"] for r in rows] == ["plain", "K=1", "auto"]
    snippet = (out_dir / "README_snippet.md").read_text()
    assert data["command"] in snippet and "| K=1 |" in snippet
    for head in ("realised/ideal", "nodes/step (own)", "state KB/step", "syncs/step"):
        assert head in snippet, head
    assert "| K=1 verify (K+1 tokens) |" in snippet and "Cost model" in snippet
    assert set(data["graphs"]) == {"plain", "1"}
    with open(out_dir / "inprocess.csv") as f:
        header = f.readline()
    assert "nodes_per_step" in header and "host_syncs_per_step" in header


def test_cli_bench_rejects_bad_input(oracle, tmp_path, capsys):
    path = oracle[0]
    assert main(["bench", "--model", path, "--num-draft-tokens", "0,x", "-o", str(tmp_path)]) == 2
    assert main(["bench", "--model", path, "--num-draft-tokens", "0,9", "-o", str(tmp_path)]) == 2
    assert main(["bench", "--model", path, "--prompts", "builtin:nope", "-o", str(tmp_path)]) == 2
    assert main(["bench", "--model", path, "--max-tokens", "1", "-o", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--num-draft-tokens" in err and "unknown built-in prompt set" in err


def test_prompt_files(tmp_path):
    assert {p.category for p in builtin_prompts()} == {"code", "prose", "qa", "long"}
    assert len(builtin_prompts("builtin:all")) >= 10
    (tmp_path / "p.txt").write_text("first prompt\nstill first\n\nsecond prompt\n")
    ps = load_prompts(str(tmp_path / "p.txt"))
    assert [p.text for p in ps] == ["first prompt\nstill first", "second prompt"]
    (tmp_path / "p.jsonl").write_text('{"prompt": "a", "category": "x"}\n"b"\n')
    ps = load_prompts(str(tmp_path / "p.jsonl"))
    assert [(p.text, p.category) for p in ps] == [("a", "x"), ("b", "p")]
    with pytest.raises(ValueError):
        load_prompts(str(tmp_path / "missing.txt"))
