"""The long-context workload of ``mlx-mtp bench`` on a tiny checkpoint at tiny lengths:
prompts exactly as long as asked, every field present and consistent, MTP's greedy output
identical to plain decoding, and plain decoding identical to mlx-lm's own
``stream_generate`` on the same checkpoint (the reference)."""

import json

import pytest
from mlx_lm.utils import load as lm_load

from mlx_mtp.bench.long_context import (QUESTION, LongContextConfig, long_prompts, parse_lengths,
                                        run_long_context)
from mlx_mtp.cli import main
from mlx_mtp.models.io.loader import load
from mlx_mtp.testing import tiny as builders

LENGTHS = [256, 512]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A noisy head (some drafts rejected), head size 32 for --kv-group-size 32."""
    text = dict(builders.tiny_text_config("qwen3_5", vocab_size=4096), head_dim=32)
    model = builders.make_oracle(builders.build_model("qwen3_5", text, seed=0), trunk_scale=0.1,
                                 fc_noise=1.5)
    path = builders.save_hf_checkpoint(model, "qwen3_5", text, tmp_path_factory.mktemp("long"))
    return str(path), *load(str(path))


def test_lengths_parse_and_bad_ones_say_so():
    assert parse_lengths("8k,32k,128k") == [8192, 32768, 131072]
    assert parse_lengths("256, 512") == [256, 512]
    assert parse_lengths("speed") == [1024, 2048, 4096, 8192, 16384, 32768]
    for bad in ("", "8q", "0", "-5", "k"):
        with pytest.raises(ValueError, match="--long-context"):
            parse_lengths(bad)


def test_prompts_are_exactly_as_long_as_asked_and_end_with_the_question(tiny):
    _, _, tok = tiny
    prompts = long_prompts(tok, LENGTHS)
    assert [len(p) for p in prompts] == LENGTHS
    q = tok.encode(QUESTION, add_special_tokens=False)
    assert all(p[-len(q):] == q for p in prompts)
    assert prompts[0][:-len(q)] == prompts[1][:256 - len(q)]  # one text, cut at each length
    assert long_prompts(tok, LENGTHS) == prompts  # deterministic


def test_rows_per_length_consistent_and_lossless_against_mlx_lm(tiny):
    path, model, tok = tiny
    cfg = LongContextConfig(lengths=LENGTHS, k=2, max_tokens=12)
    ticks = []
    rows = run_long_context(model, long_prompts(tok, LENGTHS), cfg, mlx_lm=lm_load(path),
                            progress=ticks.append)
    assert [(r["context_tokens"], r["setting"]) for r in rows] == [
        (n, s) for n in LENGTHS for s in ("plain", "K=2", "mlx-lm")]
    assert len(ticks) == 3 * len(LENGTHS)
    for r in rows:
        assert r["outputs_match_plain"] is True  # MTP and mlx-lm: plain's tokens
        assert r["prompt_tps_median"] > 0 and r["gen_tps_median"] > 0
        assert 0 < r["peak_memory_gb"] < 1
        if r["setting"] != "mlx-lm":
            assert r["prompt_tokens"] == r["context_tokens"]
            assert r["total_tokens"] == cfg.max_tokens  # EOS ignored
            assert r["gen_tokens"] < cfg.max_tokens  # the first step's come with the prefill
    for r in rows:
        if r["setting"] == "K=2":
            cond = r["acceptance_per_pos_conditional"]
            assert len(cond) == 2 and all(0 <= a <= 1 for a in cond)
            assert r["num_draft_tokens"] > 0 and 0 <= r["acceptance_rate"] <= 1
            assert r["num_accepted_tokens"] <= r["num_draft_tokens"]
    # The longer context holds more KV: its peak memory is higher (reset between runs).
    plain = [r for r in rows if r["setting"] == "plain"]
    assert plain[1]["peak_memory_gb"] > plain[0]["peak_memory_gb"]


def test_cli_with_kv_bits_writes_the_table_and_json(tiny, tmp_path, capsys):
    """With --kv-bits 4 (quantized after the prompt, as mlx-lm's quantized_kv_start does):
    MTP and mlx-lm with its kv_bits emit plain decoding's tokens."""
    path, _, _ = tiny
    code = main(["bench", "--model", path, "--long-context", "256", "--num-draft-tokens", "1",
                 "--max-tokens", "8", "--repeats", "1", "--kv-bits", "4", "--kv-group-size", "32",
                 "--quantized-kv-start", "64", "--compare-mlx-lm", "--quiet", "-o",
                 str(tmp_path)])
    assert code == 0
    out = json.loads((tmp_path / "long_context.json").read_text())
    assert out["meta"]["config"]["kv_bits"] == 4
    assert [r["setting"] for r in out["rows"]] == ["plain", "K=1", "mlx-lm"]
    assert all(r["outputs_match_plain"] for r in out["rows"])
    assert (tmp_path / "long_context.csv").read_text().startswith("context_tokens,setting")
    assert "prefill tok/s" in capsys.readouterr().out


def test_cli_bad_lengths_exit_2(tiny, capsys):
    path, _, _ = tiny
    assert main(["bench", "--model", path, "--long-context", "8q"]) == 2
    err = capsys.readouterr().err
    assert "--long-context" in err and "Traceback" not in err
