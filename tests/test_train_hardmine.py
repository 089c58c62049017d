"""Hard copy tokens for the demo model's fine-tune (issue 41): the ``repeat-tricky`` kind of
the ``hard-anneal`` mix, ``--hard-weight`` (``mlx_mtp.train.hardmine``), and the copy
benchmark's modules kept out of the training data."""

import importlib.util
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_mtp.train import codetasks as K
from mlx_mtp.train import copydata as C
from mlx_mtp.train import hardmine as H
from mlx_mtp.train import trainer as T
from mlx_mtp.train.data import ENDOFTEXT_ID, TOKENIZER_DIR, _load_tokenizer

INLINE = '''\
def _deepcopy_method(x, memo): # Copy instance methods
    return type(x)(x.__func__, deepcopy(x.__self__, memo))
d[types.MethodType] = _deepcopy_method
'''
PREFIX = '''\
def merge_settings(base, override):
    merged = dict(base)
    for key, value in override.items():
        merged[key] = value
    return merged
'''
PLAIN = '''\
def total(items, start=0):
    value = start
    for item in items:
        value += item
    return value
'''
BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "copy_rate.py"


def test_tricky_copy_finds_inline_comments_and_recent_prefix_sharing_names():
    assert C.tricky_copy(INLINE)  # "):" then a comment, not the likelier "):\n"
    assert C.tricky_copy(PREFIX)  # "merge_settings" then "merged"
    assert not C.tricky_copy(PLAIN)
    # a name extending an earlier one ("merge" -> "merged") is not the trap, nor a far one
    assert not C.tricky_copy("merge = 1\nmerged = merge\n")
    fruit = ("apple", "berry", "cherry", "damson", "elder", "figgy", "grape", "hazel")
    far = "merged = 1\n" + "".join(f"value = {f}(value)\n" for f in fruit) + "merge_all()\n"
    assert not C.tricky_copy(far) and C.tricky_copy(far, recent=30)


def test_hard_anneal_mix_repeats_tricky_snippets_verbatim():
    texts = [INLINE + "\n" + PLAIN * 3, PLAIN * 4, PREFIX + "\n" + PLAIN * 2]
    docs = C.build_documents(texts, 300, seed=3, mix="hard-anneal")
    assert docs == C.build_documents(texts, 300, seed=3, mix="hard-anneal")
    repeats = [d for d in docs if any(a in d for a in C._ASK_REPEAT)]
    answers = [d[C.answer_start(d):].split("```python\n", 1)[1].rsplit("```", 1)[0]
               for d in repeats]
    assert all(a in d[:C.answer_start(d)] for a, d in zip(answers, repeats))
    # repeat-tricky is 0.15 of the mix and repeat 0.15: far more tricky repeats than the
    # third of snippets that happen to be tricky in these texts
    tricky = sum(C.tricky_copy(a) for a in answers)
    assert tricky > 0.6 * len(answers)
    assert K.MIXES["hard-anneal"]["repeat-tricky"] > 0


def _stream(docs):
    return C.tokenize_documents(docs, _load_tokenizer(TOKENIZER_DIR), ENDOFTEXT_ID)


def test_copyable_flags_mark_answer_tokens_that_repeat_the_given_code():
    rng = np.random.default_rng(0)
    repeat = C.make_document(INLINE, "repeat", rng)
    write = C.chat("Write a function that adds two numbers.", "def add(a, b):\n    return a + b\n")
    ids, starts, answer = _stream([repeat, write])
    flags = H.copyable_flags(ids, starts, answer)
    assert not np.any(flags & (answer == 0))  # never a token of the given part
    first = slice(int(starts[0]), int(starts[1]))
    code = _load_tokenizer(TOKENIZER_DIR).encode(INLINE, add_special_tokens=False).ids
    # the repeat's answer copies the code: all but its first few tokens are copyable
    assert flags[first].sum() >= len(code) - 4
    # the request's answer is new code: no 4-token run of it was given
    assert flags[int(starts[1]):].sum() == 0


def test_hard_weights_weigh_only_flagged_targets_the_model_misses():
    logits = mx.array(np.eye(4, dtype=np.float32)[[0, 1, 2, 3]][None])  # top-1: 0, 1, 2, 3
    targets = mx.array([[0, 2, 2, 1]])  # hits at 0 and 2, misses at 1 and 3
    weights = mx.array([[1.0, 1.0, 0.5, 1.0]])
    hard = mx.array([[1, 1, 1, 0]], dtype=mx.uint8)
    out = H.hard_weights(logits, targets, weights, hard, 5.0)
    assert out.tolist() == [[1.0, 5.0, 0.5, 1.0]]


def _trainer(tmp_path, **kw):
    src = tmp_path / "code.py"
    src.write_text((INLINE + "\n" + PREFIX + "\n" + PLAIN) * 12)
    cfg = T.TrainConfig(mode="scratch", corpus=str(src), out=str(tmp_path / "run"), size="tiny",
                        steps=1, batch_size=4, seq_len=320, save_every=0, eval_every=0,
                        progress=False, compile=False, copy_fraction=1.0, copy_docs=30,
                        copy_context_weight=0.0, copy_mix="hard-anneal", seed=1, **kw)
    return T.Trainer(cfg)


def test_hard_weight_loss_is_the_mean_with_missed_copyable_targets_weighed_up(tmp_path):
    """--hard-weight W: the trunk loss equals the weighted mean computed by hand with the
    copyable targets the model misses at top-1 weighing W; the default (1) feeds the step
    the same two arrays as before."""
    assert len(_trainer(tmp_path)._batch()) == 2
    tr = _trainer(tmp_path, hard_weight=5.0)
    rows, weights, hard = tr._batch()
    assert hard.any() and not np.any(hard & (weights == 0))
    ce, _ = T.scratch_losses(tr.model, mx.array(rows), mx.array(weights), mx.array(hard), 5.0)
    text = tr.model.text
    logits = text.logits(text.trunk(mx.array(rows[:, :-1]))[0]).astype(mx.float32)
    per = np.array(nn.losses.cross_entropy(logits, mx.array(rows[:, 1:])))
    miss = np.array(mx.argmax(logits, axis=-1)) != rows[:, 1:]
    w = np.where(miss & (hard[:, 1:] > 0), 5.0, 1.0) * weights[:, 1:]
    assert miss[hard[:, 1:] > 0].any()  # an untrained model misses: the weight is exercised
    assert ce.item() == pytest.approx(float((per * w).sum() / w.sum()), rel=1e-4)
    plain, _ = T.scratch_losses(tr.model, mx.array(rows), mx.array(weights))
    assert plain.item() != pytest.approx(ce.item(), rel=1e-3)
    assert np.isfinite(tr.run()["last"]["loss"])
    with pytest.raises(Exception, match="--hard-weight"):
        T.Trainer(T.TrainConfig(**{**tr.cfg.__dict__, "hard_weight": 0.5}))


def test_copy_benchmark_modules_are_not_in_the_training_files():
    """The copy benchmark's modules (seeds 0-2) come from the held-out split, and none of
    their code (nor the copy workload's module) occurs in a file ``--corpus stdlib`` trains
    on, from which the copy documents are built too."""
    from mlx_mtp.bench.copy_prompts import _MODULE
    from mlx_mtp.text_corpus import corpus_files, read_corpus_file

    spec = importlib.util.spec_from_file_location("copy_rate", BENCH)
    copy_rate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy_rate)
    train = corpus_files("train")
    heldout_names = {f.name for f in corpus_files("heldout")}
    assert train and not set(train) & set(corpus_files("heldout"))
    modules = [code for seed in (0, 1, 2) for _, code in copy_rate.heldout_modules(6, 30, seed)]
    assert len(modules) == 18
    texts = [read_corpus_file(f) for f in train]
    for code in modules + [_MODULE]:
        assert not any(code in t for t in texts), code[:200]
    assert all(name.split(":")[0] in heldout_names
               for seed in (0, 1, 2) for name, _ in copy_rate.heldout_modules(6, 30, seed))


def test_repeat_inline_moves_comments_after_a_colon_inline_and_repeats_that():
    code = ('def size(self):\n    # how many\n    return len(self.items)\n'
            'if ready:  \n        # go\n    x = {"a":\n         1}\n# top-level note\n')
    assert C.inline_comments(code, "  ") == (
        'def size(self):  # how many\n    return len(self.items)\n'
        'if ready:  # go\n    x = {"a":\n         1}\n# top-level note\n')
    doc = C.make_document(code, "repeat-inline", np.random.default_rng(0))
    answer = doc[C.answer_start(doc):].split("```python\n", 1)[1].rsplit("```", 1)[0]
    assert answer in (C.inline_comments(code, " "), C.inline_comments(code, "  "))
    assert answer in doc[:C.answer_start(doc)]  # given and asked back verbatim
    texts = [PLAIN * 3, code + PLAIN * 2]
    docs = C.build_documents(texts, 60, seed=0, mix="inline-anneal")
    assert sum("self):  # how many" in d or "self): # how many" in d for d in docs) > 0
