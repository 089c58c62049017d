"""``benchmarks/real_shape.py`` at a tiny shape (a smoke test, no timing claims): one
interleaved run reports, per head and K, tok/s against our own plain decoding and
against mlx-lm, acceptance per position, c_verify(K), c_draft, the ideal
E[tokens] / (c_verify(K) + K c_draft) and realised/ideal; greedy tokens equal our plain
decoding's, and our plain decoding at the stored dtype equals mlx-lm's own generation."""

import importlib.util
import json
import statistics
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "real_shape.py"


@pytest.fixture(scope="module")
def real_shape():
    spec = importlib.util.spec_from_file_location("real_shape", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_tiny_run_reports_realised_over_ideal_per_k(real_shape, tmp_path, capsys):
    out = tmp_path / "out.json"
    real_shape.main(["--hidden", "64", "--layers", "2", "--vocab", "512", "--tokens", "6",
                     "--rounds", "1", "--heads", "oracle,random", "--ks", "1,2",
                     "--dtypes", "bfloat16", "--cost-reps", "1", "--dir",
                     str(tmp_path / "ckpt"), "-o", str(out)])
    printed = capsys.readouterr().out
    assert "realised/ideal" in printed and "vs mlx-lm" in printed
    result = json.loads(out.read_text())
    assert result["chosen"]["bfloat16"]["plain_tokens_equal_mlx_lm"] is True
    costs = result["costs"]["bfloat16"]
    lm = statistics.median(result["mlx_lm_tps"])
    for head in ("oracle", "random"):
        rows = {r["setting"]: r for r in result["tables"][f"bfloat16 {head}"]}
        assert list(rows) == ["plain", "K=1", "K=2", "auto"]
        assert rows["plain"]["speedup"] == pytest.approx(1.0)
        for r in rows.values():
            assert r["outputs_match_plain"] is True
            assert r["vs_mlx_lm"] == pytest.approx(r["gen_tps_median"] / lm)
        for k in (1, 2):
            r = rows[f"K={k}"]
            assert r["c_verify"] == pytest.approx(costs["c_verify"][str(k)])
            expected = 1.0
            run = 1.0
            for a in r["acceptance_per_pos_conditional"]:
                run *= a
                expected += run
            ideal = expected / (costs["c_verify"][str(k)] + k * costs["c_draft"])
            assert r["ideal_speedup"] == pytest.approx(ideal)
            assert r["efficiency"] == pytest.approx(r["speedup"] / ideal)
    # The oracle's drafts are always right, the random head's never.
    assert result["tables"]["bfloat16 oracle"][2]["acceptance_per_pos"] == [1.0, 1.0]
    assert result["tables"]["bfloat16 random"][2]["acceptance_per_pos"] == [0.0, 0.0]
