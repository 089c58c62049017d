"""``--draft-head-bits``: the flag reaches the loaded model in generate and bench; greedy
output is unchanged; bad values exit 2."""

import json

import pytest

from mlx_mtp.cli import main
from mlx_mtp.models.interface import MTPModel


@pytest.fixture(scope="module")
def oracle(tiny_ckpt):
    return str(tiny_ckpt("qwen3_5", "oracle", trunk_scale=0.1, vocab_size=4096))


@pytest.fixture
def draft_calls(monkeypatch):
    """Record every draft-head call (bits of the head that made it)."""
    calls = []
    real = MTPModel.draft_logits

    def spy(self, hidden, any_token=False):
        calls.append(None if self.draft_head is None else self.draft_head.bits)
        return real(self, hidden, any_token)

    monkeypatch.setattr(MTPModel, "draft_logits", spy)
    return calls


def _generate(capsys, model, *flags):
    rc = main(["generate", "--model", model, "--prompt", "def f():", "-m", "12",
               "--verbose", "False", *flags])
    out = capsys.readouterr().out
    assert rc == 0
    return out


@pytest.mark.parametrize("bits", [4, 8])
def test_generate_drafts_from_the_quantized_head_and_output_is_unchanged(
        oracle, capsys, draft_calls, bits):
    plain = _generate(capsys, oracle, "--no-mtp")
    assert draft_calls == []
    got = _generate(capsys, oracle, "--num-draft-tokens", "2", "--fixed-k",
                    "--draft-head-bits", str(bits))
    assert got == plain
    assert draft_calls and set(draft_calls) == {bits}


def test_default_is_the_full_precision_head(oracle, capsys, draft_calls):
    _generate(capsys, oracle, "--num-draft-tokens", "2", "--fixed-k")
    assert draft_calls and set(draft_calls) == {None}


def test_bench_applies_the_flag_and_records_it(oracle, tmp_path, draft_calls):
    out = tmp_path / "out"
    rc = main(["bench", "--model", oracle, "--num-draft-tokens", "0,1", "--max-tokens", "4",
               "--repeats", "1", "--prompts", "builtin:qa", "--cost-reps", "1", "--no-auto",
               "--warmup-tokens", "2", "--no-plots", "--quiet", "--draft-head-bits", "8",
               "-o", str(out)])
    assert rc == 0
    assert draft_calls and set(draft_calls) == {8}
    data = json.loads((out / "inprocess.json").read_text())
    assert data["config"]["draft_head_bits"] == 8
    assert "--draft-head-bits 8" in data["command"]
    assert all(r["outputs_match_plain"] for r in data["settings"])


@pytest.mark.parametrize("verb", ["generate", "bench", "serve"])
def test_bad_bits_exit_2(oracle, capsys, verb):
    with pytest.raises(SystemExit) as e:
        main([verb, "--model", oracle, "--prompt", "x", "--draft-head-bits", "3"]
             if verb == "generate" else [verb, "--model", oracle, "--draft-head-bits", "3"])
    assert e.value.code == 2
    assert "--draft-head-bits" in capsys.readouterr().err
