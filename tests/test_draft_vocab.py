"""Draft vocabulary (``--draft-vocab``): drafts restricted to a ranked token subset read fewer
rows of the output layer and never change output; the ranking command and its file."""

import json
from argparse import Namespace
from collections import Counter
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.generate import generate_step as mlx_lm_generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model

from mlx_mtp.decode.sampling import SamplingParams, filtered_logprobs
from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.models.draft import vocab as draft_vocab
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.options import UserError, apply_model_options
from distribution_check import assert_follows, sample_rows, two_token_joint

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
VOCAB = 512  # make_tiny's default


def _load(path):
    return load_model(Path(path))[0]


def mtp_run(model, prompt, n, k, sampling=SamplingParams()):
    dec = MTPDecoder(model, k, sampling, adaptive=False)
    return [t for t, _, _ in generate_step(prompt, model, decoder=dec, max_tokens=n)], dec


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("bits", [None, 8])
def test_restricted_head_scores_the_subset_and_nothing_else(tiny_ckpt, tie, bits):
    model = _load(tiny_ckpt("qwen3_5", "oracle", trunk_scale=0.1, tie=tie))
    vocab = np.arange(0, VOCAB, 3)
    h = mx.random.normal((2, 3, model.text.args.hidden_size), key=mx.random.key(0))
    full = model.logits(h)
    model.set_draft_head(bits, vocab=vocab)
    draft = model.draft_logits(h)
    assert draft.shape == full.shape
    outside = np.setdiff1d(np.arange(VOCAB), vocab)
    assert mx.all(draft[..., mx.array(outside)] == -mx.inf).item()
    inside, ref = draft[..., mx.array(vocab)], full[..., mx.array(vocab)]
    tol = 1e-5 if bits is None else 0.02 * mx.abs(ref).max().item()
    assert mx.allclose(inside, ref, atol=tol, rtol=1e-5).item()
    # Under a grammar every token must stay possible: the restricted head is bypassed.
    assert mx.array_equal(model.draft_logits(h, any_token=True), full).item()
    model.set_draft_head(None)
    assert model.text.draft_head is None and mx.array_equal(model.draft_logits(h), full).item()


def test_restricted_head_keeps_a_quantized_output_layer_exact(tiny_ckpt):
    """Rows of a quantized output layer are sliced, not requantized: same values."""
    model = _load(tiny_ckpt("qwen3_5", "oracle", trunk_scale=0.1))
    nn.quantize(model.text, group_size=64, bits=4, class_predicate=lambda p, m: p == "lm_head")
    vocab = np.arange(1, VOCAB, 2)
    h = mx.random.normal((1, 2, model.text.args.hidden_size), key=mx.random.key(1))
    full = model.logits(h)
    model.set_draft_head(vocab=vocab)
    got = model.draft_logits(h)[..., mx.array(vocab)]
    assert mx.allclose(got, full[..., mx.array(vocab)], atol=1e-4, rtol=1e-4).item()


def test_greedy_output_equals_mlx_lm_with_half_the_vocabulary(tiny_ckpt):
    """Drafts outside the subset cannot be proposed (acceptance drops); output is mlx-lm's."""
    path = tiny_ckpt("qwen3_5", "oracle", trunk_scale=0.1)
    ref_model, _ = mlx_lm_load_model(Path(path))
    ref = [int(t) for t, _ in mlx_lm_generate_step(mx.array(PROMPT), ref_model, max_tokens=24)]
    model = _load(path)
    full, dec_full = mtp_run(model, PROMPT, 24, 3)
    assert full == ref
    # Every other token of the output itself is left out of the draft vocabulary.
    vocab = np.setdiff1d(np.arange(VOCAB), ref[1::2])
    model.set_draft_head(vocab=vocab)
    for k in (1, 3):
        got, dec = mtp_run(model, PROMPT, 24, k)
        assert got == ref, f"K={k}"
        assert 0 < dec.stats.num_accepted_tokens
    assert dec.stats.acceptance_rate < dec_full.stats.acceptance_rate


def test_sampling_with_a_draft_vocabulary_is_exact(tiny_ckpt):
    """The first two tokens of a K=2 step follow the target's joint distribution even when
    its likeliest first token lies outside the draft vocabulary (only recovery yields it)."""
    path = tiny_ckpt("qwen3_5", "noisy", trunk_scale=0.1)
    model = _load(path)
    ref_model, _ = mlx_lm_load_model(Path(path))
    params = SamplingParams(temperature=40.0, top_k=3)

    def target(prefix):
        logits = ref_model(mx.array(PROMPT + prefix)[None])[0, -1:].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return np.exp(np.array(filtered_logprobs(lp, params)[0]))

    joint = two_token_joint(target)
    first_mass = Counter()
    for (a, _), v in joint.items():
        first_mass[a] += v
    first = max(first_mass, key=first_mass.get)  # the likeliest first token
    model.set_draft_head(vocab=np.setdiff1d(np.arange(VOCAB), [first]))
    n_samples = 500
    seen, accepted, _ = sample_rows(model, PROMPT, 2, n_samples, sampling=params)
    assert accepted > n_samples // 10  # drafts from the subset were accepted
    assert sum(v for (a, _), v in seen.items() if a == first) > 0  # recovered from outside
    assert_follows(seen, joint, n_samples)


# -- the ranking file and the options -------------------------------------------------------

def test_ranking_file_round_trip_and_errors(tmp_path):
    counts = np.array([5, 0, 9, 9, 1, 0])
    out = draft_vocab.write(tmp_path, counts, corpus="c", default_size=3, first=[5])
    assert out == tmp_path / draft_vocab.FILE and [p.name for p in tmp_path.iterdir()] == [out.name]
    doc = json.loads(out.read_text())
    assert doc["ranking"] == [5, 2, 3, 0, 4, 1]  # added token first, then by count, ties by id
    assert doc["counts"] == [0, 9, 9, 5, 1, 0] and doc["tokens_counted"] == 24
    assert list(draft_vocab.select(tmp_path, 3, 6)) == [2, 3, 5]  # ascending ids
    assert list(draft_vocab.select(tmp_path, "auto", 6)) == [2, 3, 5]
    assert draft_vocab.select(tmp_path, 6, 6) is None  # the whole vocabulary: no subset
    assert draft_vocab.select(tmp_path / "none", "auto", 6) is None  # auto without a file: off
    with pytest.raises(draft_vocab.DraftVocabError, match="no draft_vocab.json"):
        draft_vocab.select(tmp_path / "none", 3, 6)
    with pytest.raises(draft_vocab.DraftVocabError, match="another model"):
        draft_vocab.select(tmp_path, 3, 7)
    with pytest.raises(draft_vocab.DraftVocabError, match="outside 1..6"):
        draft_vocab.write(tmp_path, counts, corpus="c", default_size=7)
    for bad in ("x", "-1", "0.5"):
        with pytest.raises(draft_vocab.DraftVocabError):
            draft_vocab.parse_size(bad)
    out.write_text("{not json")
    with pytest.raises(draft_vocab.DraftVocabError, match="not readable"):
        draft_vocab.read(tmp_path)


def test_options_apply_the_file_default_and_explicit_sizes(tiny_ckpt, tmp_path):
    path = tiny_ckpt("qwen3_5", "oracle", trunk_scale=0.1)
    model = _load(path)
    args = Namespace(model=str(path), draft_vocab="auto", draft_head_bits=None)
    apply_model_options(model, args)  # no ranking file: auto is off
    assert model.text.draft_head is None
    with pytest.raises(UserError, match="mlx-mtp draft-vocab --model"):
        apply_model_options(model, replace_ns(args, draft_vocab="100"))
    counts = np.arange(VOCAB)[::-1]  # token 0 most frequent
    made = draft_vocab.write(path, counts, corpus="test", default_size=64)
    try:
        apply_model_options(model, args)
        assert model.text.draft_head.size == 64
        apply_model_options(model, replace_ns(args, draft_vocab="100"))
        assert model.text.draft_head.size == 100
        model.set_draft_head(None)
        apply_model_options(model, replace_ns(args, draft_vocab="0"))
        assert model.text.draft_head is None
    finally:
        made.unlink()


def replace_ns(ns, **kw):
    return Namespace(**{**vars(ns), **kw})


def test_cli_ranks_a_corpus_and_generate_uses_it(tiny_ckpt, tmp_path, cli):
    """In this process (the ``cli`` fixture; test_hub.py starts ``draft-vocab`` as users do)."""
    import shutil

    model = tmp_path / "model"
    # The test tokenizer's 4096 ids must fit the model.
    shutil.copytree(tiny_ckpt("qwen3_5", "oracle", trunk_scale=0.1, vocab_size=4096), model)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("def f(x):\n    return x + 1\n" * 50)
    (corpus / "b.txt").write_text("hello world " * 20)
    code, _, err = cli("draft-vocab", "--model", str(model), "--corpus", str(corpus),
                       "--default-size", "40")
    assert code == 0, err
    assert "Wrote" in err
    doc = json.loads((model / draft_vocab.FILE).read_text())
    assert doc["default_size"] == 40 and len(doc["ranking"]) == doc["vocab_size"] == 4096
    assert doc["counts"][len(doc["counts"]) - 1] == 0 and doc["tokens_counted"] > 100
    assert not list(model.glob(".*tmp"))
    code, _, err = cli("generate", "--model", str(model), "--prompt", "def f", "--max-tokens",
                       "8", "--ignore-chat-template", "--draft-vocab", "oops")
    assert code == 2 and "token count or 'auto'" in err and "Traceback" not in err
    code, _, err = cli("draft-vocab", "--model", str(model), "--corpus", str(tmp_path / "missing"))
    assert code == 2 and "--corpus" in err and "Traceback" not in err
