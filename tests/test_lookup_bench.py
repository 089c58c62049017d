"""``mlx-mtp bench --draft-source``: context-drafting settings beside MTP, same greedy
output as plain decoding, acceptance by source in the rows."""

import json

import pytest

from mlx_mtp.bench.inprocess import make_settings
from mlx_mtp.bench.prompts import builtin_prompts
from mlx_mtp.cli import main
from mlx_mtp.testing.tiny import make_tiny


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    return str(make_tiny(tmp_path_factory.mktemp("lookup_bench"), "qwen3_5", "oracle",
                         vocab_size=4096, trunk_scale=0.1))


def test_settings_by_source():
    names = [s.name for s in make_settings([0, 2], True, ["mtp", "lookup", "both"])]
    assert names == ["plain", "K=2", "auto", "lookup", "both"]
    assert [s.name for s in make_settings([0], True, ["lookup"])] == ["plain", "lookup"]
    assert len(builtin_prompts("builtin:copy")) == 7
    assert all("copy" != p.category for p in builtin_prompts("builtin:all"))


def test_cli_bench_compares_draft_sources(oracle, tmp_path):
    out_dir = tmp_path / "out"
    rc = main(["bench", "--model", oracle, "--num-draft-tokens", "0,2", "--max-tokens", "10",
               "--repeats", "1", "--prompts", "builtin:copy", "--cost-reps", "1",
               "--warmup-tokens", "2", "-o", str(out_dir), "--quiet", "--no-plots",
               "--draft-source", "mtp,lookup,both", "--ignore-chat-template"])
    assert rc == 0
    data = json.loads((out_dir / "inprocess.json").read_text())
    rows = {r["setting"]: r for r in data["settings"]}
    assert list(rows) == ["plain", "K=2", "auto", "lookup", "both"]
    assert all(r["outputs_match_plain"] for r in rows.values())
    assert rows["lookup"]["lookup_draft_tokens"] == rows["lookup"]["num_draft_tokens"]
    assert rows["K=2"]["lookup_draft_tokens"] == 0
    assert data["config"]["draft_sources"] == ["mtp", "lookup", "both"]
    assert data["config"]["repetition_penalty"] == 1.0
    assert {"8", "16", "32"} <= set(data["costs"]["c_verify"])  # verify measured that deep


def test_cli_bench_rejects_a_bad_source(oracle, tmp_path, capsys):
    assert main(["bench", "--model", oracle, "--draft-source", "mtp,ngram",
                 "-o", str(tmp_path)]) == 2
    assert "--draft-source takes a comma-separated list" in capsys.readouterr().err
