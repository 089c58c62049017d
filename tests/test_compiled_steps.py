"""Compiled Gated DeltaNet decode steps (``set_compiled``): same tokens, same caches."""

import mlx.core as mx
import pytest

from mlx_mtp.cli import main
from mlx_mtp.decode.batch import BatchDecoder
from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.models.cache.kv import cache_state_arrays
from mlx_mtp.models.io.loader import load

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]


@pytest.fixture(scope="module")
def noisy(tiny_ckpt):
    # The tokenizer's whole vocabulary: the CLI test below feeds text.
    path = str(tiny_ckpt("qwen3_5", "noisy", trunk_scale=0.1, vocab_size=4096, num_layers=4))
    model, _ = load(path)
    yield path, model
    model.set_compiled(False)


def _tokens(model, k, n=20, sampling=SamplingParams()):
    return [t for t, _, _ in generate_step(PROMPT, model, num_draft_tokens=k, max_tokens=n,
                                           adaptive=False, sampling=sampling)]


def test_compiled_steps_give_plain_greedy_output_and_caches(noisy):
    _, model = noisy
    model.set_compiled(False)
    plain = _tokens(model, 0)
    ref = MTPDecoder(model, 0, adaptive=False, overlap=False)
    ref.prefill(PROMPT)
    model.set_compiled(True)
    assert model.compiled
    for k in (0, 1, 3):
        assert _tokens(model, k) == plain, k
    # Rejections replay the recurrence: caches still equal a plain (lazy) decode.
    dec = MTPDecoder(model, 3, adaptive=False)
    dec.prefill(PROMPT)
    n = 0
    while n < 12:
        n += len(dec.step().tokens)
    assert 0 < dec.stats.acceptance_rate < 1  # some drafts rejected
    model.set_compiled(False)
    for _ in range(n):
        ref.step()
    got, want = cache_state_arrays(dec.cache), cache_state_arrays(ref.cache)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.shape == b.shape and mx.array_equal(a, b).item()


def test_compiled_steps_in_a_batch_and_with_sampling(noisy):
    _, model = noisy
    params = SamplingParams(temperature=0.8, seed=3)
    model.set_compiled(False)
    want = _tokens(model, 2, sampling=params)
    model.set_compiled(True)
    try:
        assert _tokens(model, 2, sampling=params) == want
        bd = BatchDecoder(model, adaptive=False)
        for i, prompt in enumerate((PROMPT, PROMPT[:7])):
            dec = MTPDecoder(model, 2, adaptive=False)
            dec.prefill(prompt)
            bd.add(i, dec)
        outs = {0: [], 1: []}
        while min(len(v) for v in outs.values()) < 12:
            for key, out in bd.step().items():
                outs[key].extend(out.tokens)
    finally:
        model.set_compiled(False)
    for i, prompt in enumerate((PROMPT, PROMPT[:7])):
        plain = [t for t, _, _ in generate_step(prompt, model, num_draft_tokens=0,
                                                max_tokens=12)]
        assert outs[i][:12] == plain, i


def test_generate_flag(noisy, capsys):
    path, _ = noisy
    args = ["generate", "--model", path, "--prompt", "hi", "-m", "8", "--verbose", "False"]
    assert main(args + ["--no-mtp"]) == 0
    plain = capsys.readouterr().out
    assert main(args + ["--num-draft-tokens", "2", "--fixed-k", "--compile-steps"]) == 0
    assert capsys.readouterr().out == plain


@pytest.fixture
def traced(monkeypatch):
    """The token counts each DeltaNet step is traced (or run uncompiled) with."""
    from mlx_mtp.models.blocks.hybrid import DecoderLayer

    calls, real = [], DecoderLayer._linear_step

    def spy(self, x, *args):
        calls.append(x.shape[1])
        return real(self, x, *args)

    monkeypatch.setattr(DecoderLayer, "_linear_step", spy)
    return calls


def test_every_k_is_traced_up_front_and_never_while_decoding(noisy, traced):
    """``set_compiled(True, max_k)`` traces a plain step and each verify length once; decodes
    whose K changes then never trace (a trace mid-decode is what made adaptive K lose)."""
    _, model = noisy
    model.set_compiled(True, 3)
    try:
        assert set(traced) == {1, 2, 3, 4}
        traced.clear()
        for k in (3, 1, 0, 2):
            _tokens(model, k, n=6)
        adaptive = [t for t, _, _ in generate_step(PROMPT, model, num_draft_tokens=3,
                                                   max_tokens=12)]
    finally:
        model.set_compiled(False)
    assert traced == []
    assert adaptive == _tokens(model, 0, n=12)


def test_switching_off_and_on_keeps_every_k_traced(noisy, traced):
    """A caller that switches compiled steps off and on again without a K (the bench's
    graph probe) must not leave verify passes to be traced mid-decode, and switching on
    twice does not trace again."""
    _, model = noisy
    try:
        model.set_compiled(True, 2)
        traced.clear()
        model.set_compiled(True, 2)
        assert traced == []  # already traced: kept
        model.set_compiled(True, 4)  # a larger K than any before (earlier tests: 3)
        assert set(traced) == {5}  # only the new verify length
        model.set_compiled(False)
        model.set_compiled(True)
        assert set(traced) == {1, 2, 3, 4, 5}
        traced.clear()
        for k in (4, 2):
            _tokens(model, k, n=6)
    finally:
        model.set_compiled(False)
    assert traced == []
