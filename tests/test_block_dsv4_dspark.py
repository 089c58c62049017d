"""DeepSeek-V4's DSpark stages under ``mtp.*`` (``drafters/block/dsv4_dspark.py``): parity with
mlx-vlm 0.7.10's ``deepseek_v4_dspark`` drafter, loading from the model's own checkpoint,
the refusals, ``inspect``, ``convert``, greedy decoding identical to plain decoding and
sampled decoding following the target's distribution (chi-square).

The reference is recorded once into ``tests/fixtures/dsv4_dspark/`` by
``tests/fixtures/dsv4_dspark_reference.py`` (its docstring says how to rerun it): the same
stage weights and the same taps, two rounds on one context cache (the second appends the
accepted rows' taps), every block width, a batch of two rows.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from block_checks import assert_block_samples_follow_target, decode, decode_batch
from mlx_mtp.convert.main import convert
from mlx_mtp.drafters.block.dsv4_dspark import DeepseekV4DSpark, stage_spec
from mlx_mtp.drafters.block.load import (BlockDrafterError, attach_block_drafter, describe,
                                          describe_own)
from mlx_mtp.models.families.deepseek_v4 import ModelArgs
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.testing.tiny_dsv4_dspark import make_tiny_deepseek_v4_dspark
from mlx_mtp.tools.inspect_model import inspect_model, render

FIXTURE = Path(__file__).parent / "fixtures" / "dsv4_dspark"
ANCHORS = ((7, 11), (20, 3))  # as the recorder's


def greedy(logits, j):
    return mx.argmax(logits, axis=-1), nn.log_softmax(logits, axis=-1)


def fixture_drafter():
    config = json.loads((FIXTURE / "config.json").read_text())
    weights = dict(mx.load(str(FIXTURE / "stages.safetensors")))
    embed, head = nn.Embedding(1, 1), nn.Linear(1, 1, bias=False)
    embed.weight, head.weight = weights.pop("embed.weight"), weights.pop("head.weight")
    drafter = DeepseekV4DSpark(ModelArgs.from_dict(config), stage_spec(config),
                               config["dspark_markov_rank"])
    drafter.load_weights(list(drafter.sanitize(weights).items()), strict=True)
    return drafter.bind(embed, head), config


def test_block_logits_and_drafts_match_mlx_vlm_over_two_rounds():
    drafter, config = fixture_drafter()
    taps, ref = np.load(FIXTURE / "taps.npz"), np.load(FIXTURE / "reference.npz")
    n_taps = len(config["dspark_target_layer_ids"])
    for width in range(1, config["dspark_block_size"] + 1):
        cache = drafter.make_cache()
        for r, key in enumerate(("round1", "round2")):
            drafter.add_context(mx.split(mx.array(taps[key]), n_taps, axis=-1), cache)
            anchor = mx.array(ANCHORS[r], mx.int32)
            logits = drafter.block_logits(anchor, cache, width)
            np.testing.assert_allclose(np.array(logits), ref[f"logits_{key}_w{width}"],
                                       atol=1e-4, rtol=0)
            drafts, _ = drafter.propose(anchor, cache, width, greedy)
            assert np.array(drafts).tolist() == ref[f"drafts_{key}_w{width}"].tolist()


def test_the_fixture_is_not_degenerate():
    """The recorded drafts differ between rows and rounds (the parity above could not pass
    with a drafter that ignored its context)."""
    ref = np.load(FIXTURE / "reference.npz")
    a, b = ref["logits_round1_w3"], ref["logits_round2_w3"]
    assert np.abs(a - b).max() > 1e-2 and np.abs(a[0] - a[1]).max() > 1e-2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_deepseek_v4_dspark(tmp_path_factory.mktemp("dsv4") / "ck")


def test_the_checkpoint_carries_its_drafter(checkpoint):
    model, config = load_model(checkpoint)
    assert model.num_mtp_layers == 0  # mtp.* holds the stages, not a head
    drafter = attach_block_drafter(model, str(checkpoint))
    assert isinstance(drafter, DeepseekV4DSpark) and len(drafter.stages) == 2
    assert describe(config) is None  # a model, not a drafter alone
    report = inspect_model(str(checkpoint))
    own = report["own_block_drafter"]
    assert (own["kind"], own["taps"], own["block_size"], own["max_draft"]) == \
        ("deepseek_v4_dspark", [1, 3], 4, 3)
    assert "deepseek_v4_dspark stages (taps after layers [1, 3]" in render(report)


def test_a_head_beside_the_stages_is_refused(checkpoint, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    weights = dict(mx.load(str(bad / "model.safetensors")))
    weights["mtp.0.e_proj.weight"] = mx.zeros((64, 64))
    mx.save_safetensors(str(bad / "model.safetensors"), weights)
    with pytest.raises(BlockDrafterError, match="MTP head beside DSpark stages"):
        attach_block_drafter(load_model(bad)[0], str(bad))


def test_a_bad_stage_config_is_refused(checkpoint, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    config = json.loads((bad / "config.json").read_text())
    config["dspark_target_layer_ids"] = [1, 9]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(BlockDrafterError, match=r"dspark_target_layer_ids \[1, 9\]"):
        describe_own(config)


PROMPT = [5, 60, 11, 7, 9, 3, 41, 17]
PROMPTS = [[3, 9, 27], [100, 4, 8, 15, 16, 23, 42], [7, 50, 51, 52]]


@pytest.fixture(scope="module")
def model(checkpoint):
    model = load_model(checkpoint)[0]
    attach_block_drafter(model, str(checkpoint))
    return model


def test_greedy_identical_at_every_width(model):
    """Batch 1, widths 1..dspark_block_size; ``block+mtp`` on a checkpoint with no head (its
    ``mtp.*`` holds the stages) drafts from the block alone."""
    plain, _ = decode(model, PROMPT, 0)
    for k in range(1, model.block_drafter.spec.max_draft + 1):
        got, dec = decode(model, PROMPT, k)
        assert got == plain, f"width {k}"
        assert dec.stats.block_draft_tokens == dec.stats.num_draft_tokens > 0
        assert dec.stats.block_accepted_tokens > 0
    got, dec = decode(model, PROMPT, model.block_drafter.spec.block_size, "block+mtp")
    assert got == plain and dec.stats.block_draft_tokens > 0 == dec.stats.head_draft_tokens


def test_a_batch_of_three_decodes_each_rows_plain_tokens(model):
    """Rows joining one per step (different context lengths, so different window phases)."""
    want = [decode(model, p, 0, n=10)[0] for p in PROMPTS]
    got, decs = decode_batch(model, PROMPTS, ["block", "block+mtp", "block"], 3, 10)
    assert got == want
    assert all(d.stats.block_draft_tokens > 0 for d in decs)


def test_sampled_tokens_follow_the_target_distribution(model):
    """Two drafts from the Markov-corrected q, many seeds: the next two tokens follow the
    target's exact joint distribution (temperature 40, top-3), drafts accepted and rejected."""
    accepted = assert_block_samples_follow_target(model, PROMPT[:4])
    assert 50 < accepted < 2 * 400


@pytest.mark.slow
def test_generate_drafts_with_the_checkpoints_own_stages(tmp_path):
    """No ``--draft-model``: the default source is the model's own drafter (``block+mtp``,
    headless, so the block); a head-only source is refused in one line."""
    ck = make_tiny_deepseek_v4_dspark(tmp_path / "ck", vocab_size=4096)  # the CLI's tokenizer

    def run(*args):
        p = subprocess.run([sys.executable, "-m", "mlx_mtp.cli", *args], capture_output=True,
                           text=True, timeout=300)
        return p.returncode, p.stdout, p.stderr

    gen = ["generate", "--model", str(ck), "--prompt", "def f():", "-m", "10", "--temp", "0"]
    code, plain, err = run(*gen, "--verbose", "False", "--no-mtp")
    assert code == 0, err
    code, out, err = run(*gen, "--fixed-k", "--num-draft-tokens", "3")
    assert code == 0 and plain.strip() in out, err
    assert "head 0/0, block " in out and "block 0/0" not in out, out
    code, out, err = run(*gen, "--draft-source", "mtp")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "DeepSeek-V4 DSpark stages" in err and "--draft-source block" in err


def test_convert_keeps_the_stages(checkpoint, model, tmp_path):
    """An MLX conversion carries the stages as released: its drafter is the same."""
    convert(str(checkpoint), str(tmp_path / "mlx"), verbose=False)
    converted = load_model(tmp_path / "mlx")[0]
    drafter = attach_block_drafter(converted, str(tmp_path / "mlx"))
    want = dict(tree_flatten(model.block_drafter.parameters()))
    got = dict(tree_flatten(drafter.parameters()))
    assert got.keys() == want.keys()
    assert all(mx.array_equal(got[k], want[k]).item() for k in want)
    assert decode(converted, PROMPT, 2)[0] == decode(model, PROMPT, 0)[0]
