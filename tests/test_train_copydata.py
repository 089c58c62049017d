"""Copy-rich training documents (``mlx_mtp.train.copydata``) and ``--copy-fraction``."""

import re

import numpy as np
import pytest

from mlx_mtp.train import copydata as C
from mlx_mtp.train import trainer as T
from mlx_mtp.train.data import ENDOFTEXT_ID, TOKENIZER_DIR, _load_tokenizer

CODE = '''\
def total(items, start=0):
    # add them up
    value = start
    for item in items:
        value += item
    return value


class Box:
    def __init__(self, items):
        self.items = list(items)

    def size(self):
        # how many
        return len(self.items)
'''

ANSWER = re.compile(r"<\|im_start\|>assistant\n<think>\n\n</think>\n\n```python\n(.*)```"
                    r"<\|im_end\|>\n$", re.S)


def _answer(doc):
    m = ANSWER.search(doc)
    assert m, doc
    return m.group(1)


def _user(doc):
    return doc.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]


def test_repeat_answer_is_the_code_given():
    rng = np.random.default_rng(0)
    for _ in range(8):
        doc = C.make_document(CODE, "repeat", rng)
        assert _answer(doc) == CODE
        assert CODE in _user(doc)


def test_block_repeats_the_snippet():
    doc = C.make_document(CODE, "block", np.random.default_rng(0))
    first, second = doc.split("# --- the same code again ---\n")
    assert first == CODE + "\n" and second == CODE


def test_rename_replaces_whole_words_only():
    out = C.rename(CODE, "item", "item_new")
    assert "for item_new in items:" in out and "value += item_new" in out
    assert "items" in out and "self.items" in out  # `items` is another name
    rng = np.random.default_rng(1)
    for _ in range(10):
        doc = C.make_document(CODE, "rename", rng)
        m = re.search(r"Rename `(\w+)` to `(\w+)`", _user(doc))
        if m is None:  # fell back to a repeat
            assert _answer(doc) == CODE
            continue
        old, new = m.groups()
        assert _answer(doc) == C.rename(CODE, old, new) != CODE
        assert not re.search(rf"\b{old}\b", _answer(doc))


def test_reindent_asks_with_two_spaces_answers_with_four():
    doc = C.make_document(CODE, "reindent", np.random.default_rng(0))
    assert _answer(doc) == CODE
    assert "        value += item" not in _user(doc)
    assert "\n    value += item\n" in _user(doc)  # depth 2 at two spaces


def test_uncomment_drops_only_comment_lines():
    ans = _answer(C.make_document(CODE, "uncomment", np.random.default_rng(0)))
    assert "#" not in ans
    assert ans.splitlines() == [line for line in CODE.splitlines() if "#" not in line]


def test_continue_sends_bare_code_and_answers_with_the_rest():
    rng = np.random.default_rng(2)
    for _ in range(8):
        doc = C.make_document(CODE, "continue", rng)
        given, rest = _user(doc), _answer(doc)
        assert given + rest == CODE and given and rest  # no request, and no echo
        assert doc[C.answer_start(doc):].startswith("<think>")


def test_snippets_are_whole_lines_of_the_source_and_bounded():
    rng = np.random.default_rng(3)
    text = "\n".join(f"x{i} = {i}" for i in range(200)) + "\n"
    for _ in range(20):
        s = C.snippet(text, rng)
        assert s.endswith("\n") and s in text and text.startswith(s) or ("\n" + s) in text
        n = s.count("\n")
        assert 3 <= n <= C.MAX_LINES and len(s) <= C.MAX_CHARS
    assert C.snippet("a = 1\nb = 2\n", rng) == ""  # too short


def test_build_documents_seeded_and_covers_kinds():
    a = C.build_documents([CODE * 3], 40, seed=5)
    assert a == C.build_documents([CODE * 3], 40, seed=5)
    assert a != C.build_documents([CODE * 3], 40, seed=6)
    assert sum("the same code again" in d for d in a) > 0
    assert sum("<|im_start|>user" in d for d in a) > 20
    with pytest.raises(ValueError, match="too short"):
        C.build_documents(["x = 1\n"], 3)


def test_tokenized_starts_point_at_documents():
    tok = _load_tokenizer(TOKENIZER_DIR)
    docs = C.build_documents([CODE * 3], 6, seed=0)
    ids, starts, answer = C.tokenize_documents(docs, tok, ENDOFTEXT_ID)
    assert len(starts) == 6 and starts[0] == 0 and answer.shape == ids.shape
    for i, s in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else len(ids)
        assert ids[end - 1] == ENDOFTEXT_ID
        assert tok.decode(list(ids[s:end - 1]), skip_special_tokens=False) == docs[i]
        # The flagged tokens are exactly the answer: one run at the end of the document.
        first = s + int(np.argmax(answer[s:end]))
        assert answer[first:end].all() and not answer[s:first].any()
        text = tok.decode(list(ids[first:end - 1]), skip_special_tokens=False)
        assert text == docs[i][C.answer_start(docs[i]):]
        assert text.endswith(("```<|im_end|>\n", "\n")) and len(text) > 20


def test_mixed_batch_fraction_and_alignment():
    base = np.arange(10_000, 20_000, dtype=np.int32)
    copy = np.arange(0, 5_000, dtype=np.int32)
    starts = np.arange(0, 5_000, 100)
    answer = (copy % 100 >= 60).astype(np.uint8)  # the last 40 tokens of each document
    b, w, _ = C.mixed_batch(base, copy, starts, 0.5, 400, 65, seed=0, step=3, answer=answer,
                            context_weight=0.25)
    assert b.shape == w.shape == (400, 65)
    from_copy = b[:, 0] < 10_000
    assert 150 < from_copy.sum() < 250
    assert np.all(b[from_copy, 0] % 100 == 0)  # copy rows start at a document start
    assert np.all(np.diff(b, axis=1) == 1)  # contiguous windows
    # Answers and fresh text weigh 1, a copy document's context 0.25.
    assert np.array_equal(w, np.where(from_copy[:, None] & (b % 100 < 60), 0.25, 1.0))
    b2, w2, _ = C.mixed_batch(base, copy, starts, 0.5, 400, 65, seed=0, step=3, answer=answer,
                              context_weight=0.25)
    assert np.array_equal(b, b2) and np.array_equal(w, w2)
    b0, w0, _ = C.mixed_batch(base, copy, starts, 0.0, 50, 65, 0, 1)
    assert np.all(b0[:, 0] >= 10_000) and np.all(w0 == 1)


def test_trainer_copy_fraction_feeds_copy_rows(tmp_path):
    src = tmp_path / "code.py"
    src.write_text(CODE * 20)
    cfg = T.TrainConfig(mode="scratch", corpus=str(src), out=str(tmp_path / "run"), size="tiny",
                        steps=1, batch_size=8, seq_len=64, save_every=0, eval_every=0,
                        progress=False, compile=False, copy_fraction=1.0, copy_docs=30)
    tr = T.Trainer(cfg)
    rows, weights = tr._batch()
    starts = set(int(tr.copy_tokens[s]) for s in tr.copy_starts)
    assert rows.shape == (8, 65) and all(int(r[0]) in starts for r in rows)
    assert np.all(weights == 1)  # --copy-context-weight defaults to 1: every token counts
    assert list((tmp_path / "run").glob("tokens-copy-30-0.npz"))
    with pytest.raises(Exception, match="--copy-fraction"):
        T.Trainer(T.TrainConfig(**{**cfg.__dict__, "copy_fraction": 1.5}))
    with pytest.raises(Exception, match="--copy-context-weight"):
        T.Trainer(T.TrainConfig(**{**cfg.__dict__, "copy_context_weight": -1.0}))


def test_copy_token_cache_is_rebuilt_for_other_kinds(tmp_path, monkeypatch):
    """The cache is reused as long as the document kinds are the same, and rebuilt when
    they change (a cache from an older set of kinds would silently train the old mix)."""
    from mlx_mtp.train import data as D

    src = tmp_path / "code.py"
    src.write_text(CODE * 20)
    first = D.load_or_build_copy(tmp_path, [src], TOKENIZER_DIR, 12)
    cache = tmp_path / "tokens-copy-12-0.npz"
    stamp = cache.stat().st_mtime_ns
    again = D.load_or_build_copy(tmp_path, [src], TOKENIZER_DIR, 12)
    assert cache.stat().st_mtime_ns == stamp
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    monkeypatch.setattr(C, "KINDS", ("repeat",))
    ids, starts, answer = D.load_or_build_copy(tmp_path, [src], TOKENIZER_DIR, 12)
    with np.load(cache) as z:
        assert list(z["kinds"]) == ["repeat"] and np.array_equal(z["ids"], ids)
    tok = _load_tokenizer(TOKENIZER_DIR)
    bounds = list(starts) + [len(ids)]
    for a, b in zip(bounds[:-1], bounds[1:]):  # every document is now a "repeat" one
        assert any(ask in tok.decode(ids[a:b].tolist()) for ask in C._ASK_REPEAT)


def test_answer_only_loss_ignores_the_context(tmp_path):
    """With --copy-context-weight 0 the loss is the answers' mean CE: changing a token
    before an answer changes no target's weight, and the weighted loss equals the mean over
    the flagged targets computed by hand."""
    import mlx.core as mx
    import mlx.nn as nn

    src = tmp_path / "code.py"
    src.write_text(CODE * 20)
    cfg = T.TrainConfig(mode="scratch", corpus=str(src), out=str(tmp_path / "run"), size="tiny",
                        steps=1, batch_size=4, seq_len=320, save_every=0, eval_every=0,
                        progress=False, compile=False, copy_fraction=1.0, copy_docs=30,
                        copy_context_weight=0.0)
    tr = T.Trainer(cfg)
    rows, weights = tr._batch()
    assert 0 < weights.mean() < 1 and set(np.unique(weights)) <= {0.0, 1.0}
    ce, mtp = T.scratch_losses(tr.model, mx.array(rows), mx.array(weights))
    text = tr.model.text
    hidden, _ = text.trunk(mx.array(rows[:, :-1]))
    per = np.array(nn.losses.cross_entropy(text.logits(hidden).astype(mx.float32),
                                           mx.array(rows[:, 1:])))
    m = weights[:, 1:]
    assert ce.item() == pytest.approx(float((per * m).sum() / m.sum()), rel=1e-4)
    plain, _ = T.scratch_losses(tr.model, mx.array(rows))
    assert plain.item() == pytest.approx(float(per.mean()), rel=1e-4)
