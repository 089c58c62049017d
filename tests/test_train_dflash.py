"""``mlx-mtp train --mode dflash``: a DFlash block drafter trained for a frozen tiny Qwen3.5
hybrid. The training pass is the decoding pass (the loss equals the one computed anchor by
anchor through the drafter's own ``add_context`` / ``block_logits``, and the ``trunk`` labels
are the trunk's greedy picks); a few steps lower the loss; the export is z-lab's layout,
loads through ``--draft-model``'s loader and decodes greedily identical to plain decoding
(the CLI too); a resumed run ends where an uninterrupted one does; bad input is one line."""

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from block_checks import decode
from mlx_mtp.drafters.block.load import attach_block_drafter, describe
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.options import UserError
from mlx_mtp.testing.tiny import make_tiny
from mlx_mtp.train import dflash as D
from mlx_mtp.train import trainer as T

CODE = '''
def add(a, b):
    """Return the sum of a and b."""
    return a + b


class Counter:
    def __init__(self):
        self.count = 0

    def increment(self, step=1):
        self.count += step
        return self.count
'''
BLOCK = 5


@pytest.fixture(scope="module")
def trunk(tmp_path_factory):
    # the demo tokenizer's vocabulary, so the corpus tokenizes into it
    return make_tiny(tmp_path_factory.mktemp("trunk"), "qwen3_5", "random", vocab_size=4096,
                     trunk_scale=0.1)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    f = tmp_path_factory.mktemp("corpus") / "code.py"
    f.write_text(CODE * 40)
    return f


def _cfg(tmp_path, trunk, corpus, **kw):
    base = dict(mode="dflash", model=trunk and str(trunk), corpus=str(corpus), out=str(tmp_path / "run"),
                steps=30, batch_size=4, seq_len=48, lr=3e-3, warmup=2, save_every=0,
                eval_every=0, progress=False, block_size=BLOCK, anchors=4, labels="data")
    base.update(kw)
    return T.TrainConfig(**base)


def _fixed_loss(trainer, n=2):
    out = []
    for i in range(n):
        b = mx.array(T.sample_batch(trainer.train_tokens, 4, 49, 123, i))
        anchors = D.sample_anchors(4, 49, BLOCK, 4, 123, i)
        out.append(trainer.dflash_loss(b, anchors)[0].item())
    return float(np.mean(out))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, trunk, corpus):
    tr = T.Trainer(_cfg(tmp_path_factory.mktemp("dflash"), trunk, corpus))
    before = _fixed_loss(tr)
    res = tr.run()
    return tr, before, _fixed_loss(tr), res


@pytest.mark.parametrize("labels", ["data", "trunk"])
def test_the_training_pass_is_the_decoding_pass(trunk, labels):
    """One pass over many anchors gives the loss the drafter's decoding path gives anchor by
    anchor (context = the taps before the anchor; slot j labelled with position p+j)."""
    model = load_model(trunk, mtp=False, dtype=mx.float32)[0]
    config = D.drafter_config(json.loads((trunk / "config.json").read_text())["text_config"],
                              [0, 2], BLOCK, 2, 4095)
    drafter = D.build_drafter(config, seed=3)
    decay = 2.0
    loss_fn = D.DFlashLoss(model, drafter, labels, decay)
    tokens = mx.array(np.random.default_rng(0).integers(0, 4000, (2, 24)), dtype=mx.int32)
    anchors = np.array([[1, 7, 19], [4, 5, 12]], np.int32)
    loss, _ = loss_fn(tokens, anchors)

    _, _, taps = model.trunk_with_taps(tokens, [0, 2])
    weights = np.exp(-np.arange(BLOCK - 1) / decay)
    total = 0.0
    for b, row in enumerate(anchors):
        for p in row.tolist():
            cache = drafter.make_cache()
            drafter.add_context([t[b:b + 1, :p] for t in taps], cache)
            logits = drafter.block_logits(tokens[b:b + 1, p], cache)[0]
            want = []
            for j in range(1, BLOCK):
                if labels == "data":
                    want.append(tokens[b, p + j].item())
                else:  # the trunk's greedy pick after the text before p + j
                    h, _ = model.trunk(tokens[b:b + 1, :p + j])
                    want.append(mx.argmax(model.logits(h[:, -1]), axis=-1).item())
            lp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
            total += float((-lp[np.arange(BLOCK - 1), want] * weights).sum() / weights.sum())
    np.testing.assert_allclose(loss.item(), total / anchors.size, rtol=1e-5)


def test_steps_lower_the_loss(trained):
    tr, before, after, res = trained
    assert res["step"] == 30
    assert after < before - 0.5, (before, after)
    rows = [r for r in T.read_metrics(tr.metrics_path) if r["kind"] == "train"]
    assert len(rows) == 30 and {"ce", "slot1_acc"} <= rows[0].keys()


def test_the_export_is_zlab_dflash_and_decodes_like_plain(trained, trunk):
    tr, *_ = trained
    out = tr.run_dir / "dflash"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"] == {"mask_token_id": 4095,
                                       "target_layer_ids": D.default_taps(4)}
    assert describe(config)["block_size"] == BLOCK
    saved = mx.load(str(out / "model.safetensors"))
    assert saved.keys() == dict(tree_flatten(tr.model.parameters())).keys()
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in saved)

    model = load_model(trunk)[0]
    drafter = attach_block_drafter(model, str(out))
    for k, v in tree_flatten(drafter.parameters()):
        np.testing.assert_array_equal(np.array(v), np.array(dict(tree_flatten(
            tr.model.parameters()))[k]))
    prompt = tr.train_tokens[:20].tolist()
    plain, _ = decode(model, prompt, 0)
    for k in (1, BLOCK - 1):
        got, dec = decode(model, prompt, k)
        assert got == plain and dec.stats.block_draft_tokens > 0, k


def test_resume_ends_where_an_uninterrupted_run_does(tmp_path, trunk, corpus):
    whole = T.Trainer(_cfg(tmp_path / "a", trunk, corpus, steps=6))
    whole.run()
    stopped = T.Trainer(_cfg(tmp_path / "b", trunk, corpus, steps=6, save_every=2))
    batch = stopped._batch

    def interrupted():  # killed after step 4's checkpoint
        if stopped.step == 4:
            raise KeyboardInterrupt
        return batch()
    stopped._batch = interrupted
    with pytest.raises(KeyboardInterrupt):
        stopped.run()
    resumed = T.Trainer(_cfg(tmp_path / "b", trunk, corpus, steps=6, save_every=2, resume=True))
    assert resumed.step == 4 and resumed.optimizer.state["step"].item() == 4
    resumed.run()
    a = dict(tree_flatten(whole.model.parameters()))
    for k, v in tree_flatten(resumed.model.parameters()):
        np.testing.assert_allclose(np.array(v), np.array(a[k]), atol=1e-6, err_msg=k)


def test_bad_input_is_one_line(tmp_path, trunk, corpus):
    with pytest.raises(UserError, match="needs --model"):
        T.Trainer(_cfg(tmp_path, None, corpus))
    with pytest.raises(UserError, match=r"target_layer_ids \[1, 9\] taps past"):
        T.Trainer(_cfg(tmp_path, trunk, corpus, target_layers=(1, 9)))
    with pytest.raises(UserError, match="--block-size"):
        T.Trainer(_cfg(tmp_path, trunk, corpus, block_size=1))
    with pytest.raises(UserError, match="--seq-len"):
        T.Trainer(_cfg(tmp_path, trunk, corpus, seq_len=4, block_size=8))
    with pytest.raises(UserError, match="--copy-fraction"):
        T.Trainer(_cfg(tmp_path, trunk, corpus, copy_fraction=0.5))


@pytest.mark.slow
def test_cli_trains_a_drafter_that_generate_loads(tmp_path, trunk, corpus, cli):
    def run(*args):  # ``train`` as users start it; ``generate`` in this process (``cli``)
        p = subprocess.run([sys.executable, "-m", "mlx_mtp.cli", *args], capture_output=True,
                           text=True, timeout=300)
        return p.returncode, p.stdout, p.stderr

    code, out, err = run("train", "--mode", "dflash", "--model", str(trunk), "--corpus",
                         str(corpus), "--out", str(tmp_path / "run"), "--steps", "3",
                         "--batch-size", "2", "--seq-len", "32", "--block-size", "4",
                         "--target-layers", "1,3", "--no-progress")
    assert code == 0, err
    drafter = json.loads(out.strip().splitlines()[-1])["drafter"]
    gen = ["generate", "--model", str(trunk), "--prompt", "def f():", "-m", "12", "--temp", "0",
           "--verbose", "False"]
    code, plain, err = cli(*gen)
    assert code == 0, err
    code, drafted, err = cli(*gen, "--draft-model", drafter, "--draft-source", "block")
    assert code == 0 and drafted == plain, err
    code, _, err = run("train", "--mode", "dflash", "--corpus", str(corpus), "--out",
                       str(tmp_path / "x"), "--steps", "1")
    assert code == 2 and "needs --model" in err and "Traceback" not in err, err
