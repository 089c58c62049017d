"""The oracle checkpoints ``benchmarks/families_oracle.py`` builds for issue 37's families that
have an MTP head to draft with (``qwen4_exp``, ``glm5_next``, ``deepseek_v4``,
``bailing_hybrid``; MiniMax-M3's head is refused, ``step3p7`` and ``mellum`` are covered where
their builders are tested): each loads through the real loader and its head is an oracle.

The stream families' writers (``testing/tiny_streams.py``) are checked against the released
layout as transformers 5.24 writes it: the model loaded from each family's committed fixture
(``tests/fixtures/{qwen4_exp,glm5_next,deepseek_v4}``, recorded from transformers' classes by
the generator scripts beside them) written back gives the fixture's tensors, names, shapes and
values (vision tensors aside: the writer's are placeholders)."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import family_checks as fc
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.testing import tiny_streams
from mlx_mtp.testing.tiny_bailing import make_tiny_bailing_hybrid

FIXTURES = Path(__file__).parent / "fixtures"
# Past every family's window (8), index budget (8 keys; DeepSeek-V4: 2 entries of 4) and
# compressed windows (4, 8) before decoding starts, so the sparse paths run.
PROMPT = [int(x) for x in np.random.default_rng(0).integers(2, 128, 24)]
BUILDERS = {"qwen4_exp": tiny_streams.make_tiny_qwen4_exp,
            "glm5_next": tiny_streams.make_tiny_glm5_next,
            "deepseek_v4": tiny_streams.make_tiny_deepseek_v4,
            "bailing_hybrid": make_tiny_bailing_hybrid}
WRITERS = {"qwen4_exp": (tiny_streams.qwen4_exp_to_hf, "qwen4_exp/checkpoint"),
           "glm5_next": (tiny_streams.glm5_next_to_hf, "glm5_next/checkpoint"),
           "deepseek_v4": (tiny_streams.deepseek_v4_to_hf, "deepseek_v4")}


@pytest.mark.parametrize("family", WRITERS)
def test_writer_gives_the_released_tensors_back(family):
    to_hf, fixture = WRITERS[family]
    raw = fc.raw_tensors(FIXTURES / fixture)
    written = to_hf(load_model(FIXTURES / fixture)[0])
    placeholders = {k for k in written if k.startswith("model.visual.")}
    assert written.keys() - placeholders == {k for k in raw if not k.startswith("model.visual.")}
    for k in written.keys() - placeholders:
        got = np.array(written[k])
        assert got.shape == raw[k].shape and got.dtype == raw[k].dtype, k
        np.testing.assert_allclose(got, raw[k], atol=1e-6, err_msg=k)


@pytest.mark.parametrize("family", BUILDERS)
def test_oracle_checkpoint_accepts_everything(family, tmp_path):
    """bf16 as the benchmark stores it: acceptance 1.0 at K = 1..3, output plain decoding's."""
    path = BUILDERS[family](tmp_path / family, "oracle", dtype=mx.bfloat16)
    fc.assert_oracle_accepts_everything(load_model(path)[0], PROMPT)


def test_bench_runs_a_family_without_a_final_norm(tmp_path):
    """``mlx-mtp bench`` (as the benchmark runs it) on Qwen4-Exp, whose output layer reads
    the streams' mixer, not a final norm: it once failed reading that norm's dtype for its
    report. Every draft of the oracle is accepted."""
    import json

    from mlx_mtp.cli import main

    path = BUILDERS["qwen4_exp"](tmp_path / "qwen4_exp", "oracle", vocab_size=4096,
                                 dtype=mx.bfloat16)
    out = tmp_path / "bench"
    assert main(["bench", "--model", str(path), "--num-draft-tokens", "0,2", "--max-tokens",
                 "8", "--repeats", "1", "--prompts", "builtin:qa", "--cost-reps", "1",
                 "--warmup-tokens", "2", "--ignore-eos", "--no-plots", "--quiet",
                 "--draft-source", "mtp", "-o", str(out)]) == 0
    report = json.loads((out / "inprocess.json").read_text())
    assert report["model_type"] == "qwen4_exp"
    rows = {r["setting"]: r for r in report["settings"]}
    assert rows["K=2"]["mean_acceptance_length"] == 3 and rows["K=2"]["outputs_match_plain"]
