"""Replay rollback of Gated DeltaNet state: one recurrence call per layer in verify,
one replay call per layer on rejection, states equal to sequential decoding."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from family_checks import prefilled_cache
from mlx_mtp.models.blocks import hybrid
from mlx_mtp.models.cache.recurrent import RecurrentCache
from mlx_mtp.models.io.loader import load_model

RNG = np.random.default_rng(1)
PROMPTS = [[int(x) for x in RNG.integers(0, 512, n)] for n in (5, 9, 2)]


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(Path(tiny_ckpt("qwen3_5", "noisy", trunk_scale=0.1)))[0]


@pytest.fixture
def recurrence_calls(monkeypatch):
    """Every call of the recurrence entry point, as the number of positions it ran (the
    layer's method: on the CPU it runs a compiled graph, traced once per shape)."""
    calls = []
    real = hybrid.GatedDeltaNetBase.recurrence

    def counting(self, q, *args, **kwargs):
        calls.append(q.shape[1])
        return real(self, q, *args, **kwargs)

    monkeypatch.setattr(hybrid.GatedDeltaNetBase, "recurrence", counting)
    return calls


def _num_deltanet_layers(model):
    return sum(layer.is_linear for layer in model.layers)


def _sequential(model, prompt, tokens):
    """Caches after the prompt then ``tokens`` one by one (plain decoding)."""
    cache = prefilled_cache(model, prompt)
    for t in tokens:
        model.trunk(mx.array([[t]]), cache)
    return cache


def _recurrent(caches):
    return [c for c in caches if isinstance(c, RecurrentCache)]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_verify_makes_one_recurrence_call_per_layer(model, recurrence_calls, k):
    cache = prefilled_cache(model, PROMPTS[0])
    recurrence_calls.clear()
    h, _ = model.trunk(mx.array([list(range(10, 11 + k))]), cache, capture=True)
    mx.eval(h, *[c.ssm for c in _recurrent(cache)])
    assert recurrence_calls == [k + 1] * _num_deltanet_layers(model)

    # Rejection: one replay call per layer over the kept prefix; full acceptance: none.
    recurrence_calls.clear()
    for c in cache:
        c.accept([2])
    assert recurrence_calls == ([2] * _num_deltanet_layers(model) if k + 1 > 2 else [])


def test_full_acceptance_keeps_the_verify_state_without_replay(model, recurrence_calls):
    tokens = [3, 4, 5, 6]
    cache = prefilled_cache(model, PROMPTS[1])
    model.trunk(mx.array([tokens]), cache, capture=True)
    after_verify = [(c.conv, c.ssm) for c in _recurrent(cache)]
    recurrence_calls.clear()
    for c in cache:
        c.accept([len(tokens)])
    assert recurrence_calls == []
    for c, (conv, ssm) in zip(_recurrent(cache), after_verify):
        assert c.conv is conv and c.ssm is ssm and c.verify_record is None


def _sequential_recurrence(layer, record, row, n):
    """State of ``row`` after ``n`` T=1 recurrence calls on the pass's own inputs
    from its pre-verify state (what plain decoding computes from those inputs)."""
    state = record.ssm[row : row + 1]
    for t in range(n):
        step = [x[row : row + 1, t : t + 1] for x in record.inputs]
        _, state = layer.recurrence(*step, state)
    return state


@pytest.mark.parametrize("n_keep", [1, 2, 3, 4])
def test_replay_is_bit_identical_to_sequential_decoding(model, n_keep):
    tokens = [7, 77, 177, 277]
    cache = prefilled_cache(model, PROMPTS[0])
    model.trunk(mx.array([tokens]), cache, capture=True)
    records = [c.verify_record for c in _recurrent(cache)]
    layers = [layer.linear_attn for layer in model.layers if layer.is_linear]
    for c in cache:
        c.accept([n_keep])
    for layer, c, rec in zip(layers, _recurrent(cache), records):
        assert mx.array_equal(c.ssm, _sequential_recurrence(layer, rec, 0, n_keep)).item()
        assert mx.array_equal(c.conv, rec.conv_input[:, n_keep : n_keep + c.conv.shape[1]]).item()
    # The whole model against a plain decode (matmuls over 4 rows vs 1 may round
    # differently under a tuned BLAS, hence the tolerance here only).
    ref = _sequential(model, PROMPTS[0], tokens[:n_keep])
    for mine, want in zip(_recurrent(cache), _recurrent(ref)):
        assert mx.allclose(mine.conv, want.conv, atol=1e-5).item()
        assert mx.allclose(mine.ssm, want.ssm, atol=1e-5).item()
        assert mine.offset == want.offset


@pytest.mark.parametrize("n_keep", [[1, 3, 4], [2, 2, 2], [4, 1, 1]])
def test_batch_replay_with_per_row_lengths_matches_sequential(model, recurrence_calls, n_keep):
    """One masked replay call per layer gives every row its own sequential state."""
    solo = [_recurrent(prefilled_cache(model, p)) for p in PROMPTS]
    caches = [RecurrentCache.concat(list(cs)) for cs in zip(*solo)]
    layers = [layer.linear_attn for layer in model.layers if layer.is_linear]
    x = mx.array(RNG.standard_normal((3, 4, model.text.args.hidden_size)).astype(np.float32))
    for layer, c in zip(layers, caches):
        layer(x, cache=c, capture=True)
    records = [c.verify_record for c in caches]
    recurrence_calls.clear()
    for c in caches:
        c.accept(n_keep)
    assert recurrence_calls == [max(n_keep)] * len(layers)
    for layer, c, rec in zip(layers, caches, records):
        window = c.conv.shape[1]
        for b, n in enumerate(n_keep):
            assert mx.array_equal(c.ssm[b : b + 1], _sequential_recurrence(layer, rec, b, n)).item()
            assert mx.array_equal(c.conv[b], rec.conv_input[b, n : n + window]).item()
    # Each row against its own plain decode of the same mixer inputs.
    for b, n in enumerate(n_keep):
        for layer, c, ref in zip(layers, caches, solo[b]):
            for t in range(n):
                layer(x[b : b + 1, t : t + 1], cache=ref)
            assert mx.allclose(c.conv[b], ref.conv[0], atol=1e-5).item()
            assert mx.allclose(c.ssm[b], ref.ssm[0], atol=1e-5).item()


def test_plain_pass_forgets_a_stale_verify_record(model):
    cache = prefilled_cache(model, PROMPTS[2])
    model.trunk(mx.array([[1, 2, 3]]), cache, capture=True)
    for c in cache:
        c.accept([3])
    model.trunk(mx.array([[4]]), cache)
    with pytest.raises(RuntimeError, match="capture=True"):
        _recurrent(cache)[0].accept([1])


def test_accept_rejects_lengths_outside_the_pass(model):
    cache = prefilled_cache(model, PROMPTS[2])
    model.trunk(mx.array([[1, 2, 3]]), cache, capture=True)
    with pytest.raises(ValueError, match="does not fit"):
        _recurrent(cache)[0].accept([4])
