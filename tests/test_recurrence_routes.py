"""Which route a Gated DeltaNet input takes by its length on the CPU: longer than a compiled
decode step, the chunked (matmul-form) rule, whose graph does not grow a few primitives a
position as the per-position loop's does; its output and state equal the loop's within float
tolerance, and greedy decoding after prompts run in such chunks equals mlx-lm's own."""

from pathlib import Path

import os
import re
import tempfile

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step as mlx_lm_generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model

from mlx_mtp.decode.speculative import generate_step
from mlx_mtp.models.blocks import hybrid
from mlx_mtp.models.cache.recurrent import RecurrentCache
from mlx_mtp.models.io.loader import load_model

RNG = np.random.default_rng(4)


@pytest.fixture(scope="module")
def path(tiny_ckpt):
    return tiny_ckpt("qwen3_5", "noisy", trunk_scale=0.1)


@pytest.fixture(scope="module")
def model(path):
    return load_model(Path(path))[0]


def _per_position_loop(monkeypatch):
    """The route before: every input under 64 positions through ``recurrence``."""
    monkeypatch.setattr(hybrid, "CPU_CHUNKED_MIN_TOKENS", hybrid.CHUNKED_MIN_TOKENS)


def _layer_pass(model, L, B=1, mask=None):
    """The first DeltaNet layer over L positions after a 5-token prefix: (output, state)."""
    layer = next(layer for layer in model.layers if layer.is_linear).linear_attn
    hidden = layer.out_proj.weight.shape[0]
    cache = RecurrentCache(B)
    layer(mx.random.normal((B, 5, hidden), key=mx.random.key(1)), cache=cache)
    out = layer(mx.random.normal((B, L, hidden), key=mx.random.key(2)), mask, cache)
    return out, cache.state[1]


@pytest.mark.parametrize("L", [10, 16, 24, 63])
def test_mid_sized_input_equals_the_per_position_loop(model, monkeypatch, L):
    out, state = _layer_pass(model, L)
    mx.eval(out, state)
    _per_position_loop(monkeypatch)
    ref_out, ref_state = _layer_pass(model, L)
    assert mx.allclose(out, ref_out, rtol=1e-4, atol=1e-5).item()
    assert mx.allclose(state, ref_state, rtol=1e-4, atol=1e-5).item()


def test_mid_sized_masked_rows_equal_the_per_position_loop(model, monkeypatch):
    """Left-padded rows of a batched prompt chunk (the padding leaves the state alone)."""
    mask = mx.array([[True] * 20, [False] * 7 + [True] * 13])
    out, state = _layer_pass(model, 20, B=2, mask=mask)
    mx.eval(out, state)
    _per_position_loop(monkeypatch)
    ref_out, ref_state = _layer_pass(model, 20, B=2, mask=mask)
    keep = mask[..., None]
    assert mx.allclose(mx.where(keep, out, 0), mx.where(keep, ref_out, 0),
                       rtol=1e-4, atol=1e-5).item()
    assert mx.allclose(state, ref_state, rtol=1e-4, atol=1e-5).item()


def _primitives(arrays) -> int:
    """Primitive nodes in the lazy graph of ``arrays`` (``mx.export_to_dot``)."""
    fd, dot = tempfile.mkstemp(suffix=".dot")
    os.close(fd)
    try:
        mx.export_to_dot(dot, *arrays)
        return len(re.findall(r'label ="?[A-Za-z]+', Path(dot).read_text()))
    finally:
        os.unlink(dot)


def _growth(model, short=16, long=48):
    """Primitives a DeltaNet layer's pass gains from ``short`` to ``long`` positions."""
    counts = [_primitives(_layer_pass(model, L)) for L in (short, long)]
    return counts[1] - counts[0]


def test_mid_sized_graph_does_not_grow_per_position(model, monkeypatch):
    """32 more positions add about one primitive each (the chunked rule: ~18 a 16-position
    chunk); the per-position loop adds over 20 each."""
    assert _growth(model) < 2 * 32
    _per_position_loop(monkeypatch)
    assert _growth(model) > 10 * 32


def _mlx_lm_greedy(path, prompt, n):
    model, _ = mlx_lm_load_model(Path(path))
    return [int(t) for t, _ in mlx_lm_generate_step(mx.array(prompt), model, max_tokens=n)]


@pytest.mark.parametrize("chunk", [13, 40])
def test_greedy_after_mid_sized_prompt_chunks_equals_mlx_lm(path, model, chunk):
    """A 60-token prompt prefilled in 13- or 40-token calls: plain and MTP greedy tokens
    equal mlx-lm's (which runs the prompt through its per-position loop)."""
    prompt = [int(x) for x in RNG.integers(0, 512, 60)]
    expected = _mlx_lm_greedy(path, prompt, 12)
    for k in (0, 2):
        ours = [t for t, _, _ in generate_step(prompt, model, num_draft_tokens=k, max_tokens=12,
                                               adaptive=False, prefill_step_size=chunk)]
        assert ours == expected, f"K={k}"
