"""Draft-only quantized output head: drafts get cheaper, output does not change."""

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.models.io.loader import load_model

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]


def _load(tiny_ckpt, **kw):
    return load_model(Path(tiny_ckpt("qwen3_5", "oracle", trunk_scale=0.1, **kw)))[0]


@pytest.mark.parametrize("tie", [False, True])
def test_draft_head_approximates_the_output_layer_and_is_not_a_parameter(tiny_ckpt, tie):
    model = _load(tiny_ckpt, tie=tie)
    names = [k for k, _ in tree_flatten(model.parameters())]
    h = mx.random.normal((2, 3, model.text.args.hidden_size), key=mx.random.key(0))
    full = model.logits(h)
    errors = {}
    for bits in (8, 4):
        model.set_draft_head(bits)
        draft = model.draft_logits(h)
        assert draft.shape == full.shape
        errors[bits] = (mx.abs(draft - full).max() / mx.abs(full).max()).item()
        assert [k for k, _ in tree_flatten(model.parameters())] == names  # never saved
        assert mx.array_equal(model.logits(h), full).item()  # the target is untouched
    assert errors[8] < 0.02 and errors[4] < 0.2 and errors[8] < errors[4]
    model.set_draft_head(None)
    assert mx.array_equal(model.draft_logits(h), full).item()


def test_draft_head_from_a_quantized_output_layer(tiny_ckpt):
    model = _load(tiny_ckpt)
    h = mx.random.normal((1, 2, model.text.args.hidden_size), key=mx.random.key(1))
    nn.quantize(model.text, group_size=64, bits=8, class_predicate=lambda p, m: p == "lm_head")
    model.set_draft_head(4)
    full = model.logits(h)
    err = (mx.abs(model.draft_logits(h) - full).max() / mx.abs(full).max()).item()
    assert err < 0.2


@pytest.mark.parametrize("bits", [0, 3, 16, "4"])
def test_draft_head_bits_are_checked(tiny_ckpt, bits):
    with pytest.raises(ValueError, match="4 or 8"):
        _load(tiny_ckpt).set_draft_head(bits)


@pytest.mark.parametrize("bits", [4, 8])
def test_output_is_unchanged_with_a_draft_head(tiny_ckpt, bits):
    """Greedy: the same tokens as plain decoding; the drafts are still accepted."""
    model = _load(tiny_ckpt)
    plain = [t for t, _, _ in generate_step(PROMPT, model, num_draft_tokens=0, max_tokens=16)]
    model.set_draft_head(bits)
    head, calls = model.text.draft_head, []
    model.text.draft_head = lambda h: calls.append(h.shape) or head(h)
    dec = MTPDecoder(model, 3, SamplingParams(), adaptive=False)
    got = [t for t, _, _ in generate_step(PROMPT, model, decoder=dec, max_tokens=16)]
    assert got == plain
    assert calls  # the drafts came from the quantized head
    assert dec.stats.acceptance_rate > 0.5
