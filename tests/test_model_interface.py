"""The declared model interface (``models/interface.py``): every family implements it,
hidden-state taps read the trunk without changing it, state is set through declared methods."""

from functools import partial
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from mlx_mtp.models.cache.kv import cache_state_arrays
from mlx_mtp.models.distributed import DistributedModel
from mlx_mtp.models.interface import ModelInterface, MTPModel
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.options import UserError, apply_model_options
from mlx_mtp.testing import tiny, tiny_attention, tiny_bailing, tiny_special

PROMPT = [3, 17, 5, 90, 41, 8, 66]
DRAFTS = [12, 7, 30]

MAKERS = {
    "qwen3_5": partial(tiny.make_tiny, family="qwen3_5"),
    "qwen3_next": partial(tiny.make_tiny, family="qwen3_next"),
    "glm4_moe": partial(tiny_attention.make_tiny, family="glm4_moe"),
    "deepseek_v3": partial(tiny_attention.make_tiny, family="deepseek_v3"),  # MLA
    "step3p5": tiny_special.make_tiny_step3p5,  # windowed layers
    "nemotron_h": tiny_special.make_tiny_nemotron_h,
    "longcat_flash": tiny_special.make_tiny_longcat_flash,
    "deepseek_v32": tiny_special.make_tiny_dsa,
    "bailing_hybrid": tiny_bailing.make_tiny_bailing_hybrid,  # KDA + MLA
}


@pytest.fixture(scope="module", params=list(MAKERS))
def model(request, tmp_path_factory):
    path = MAKERS[request.param](tmp_path_factory.mktemp(request.param))
    return load_model(path)[0]


def _prefill_then_verify(model, run):
    """``run(tokens, cache, capture)`` over a prompt, then a verify pass: outputs and cache."""
    cache = model.make_cache()
    first = run(mx.array([PROMPT]), cache, False)
    second = run(mx.array([DRAFTS]), cache, True)
    return first, second, [np.array(a) for a in cache_state_arrays(cache)]


def test_every_family_declares_the_interface(model):
    assert isinstance(model, ModelInterface) and isinstance(model.text, MTPModel)
    assert model.capabilities.taps and not model.capabilities.distributed
    assert model.share(mx.array([1]))[0].item() == 1  # one process: its own values
    assert len(model.make_mtp_cache()) == model.num_mtp_caches > 0
    if model.num_mtp_layers == 1:  # each cache got k - 1 draft entries
        assert model.drafted_entries(3) == [2] * model.num_mtp_caches


def test_taps_change_neither_outputs_nor_caches(model):
    n = len(model.text.model.layers)
    taps = (n - 1, 0, n // 2)

    plain = _prefill_then_verify(model, lambda x, c, v: model.trunk(x, c, capture=v))
    tapped = _prefill_then_verify(
        model, lambda x, c, v: model.trunk_with_taps(x, taps, c, capture=v))
    for want, got in zip(plain[:2], tapped[:2]):
        for a, b in zip(want, got[:2]):
            np.testing.assert_array_equal(np.array(a), np.array(b))
    for a, b in zip(plain[2], tapped[2]):
        np.testing.assert_array_equal(a, b)

    normed, _, residuals = tapped[1]
    assert [r.shape for r in residuals] == [normed.shape] * len(taps)
    # The tap after the last layer is the pre-norm hidden.
    np.testing.assert_array_equal(np.array(model.text.model.norm(residuals[0])),
                                  np.array(normed))


def test_a_tap_past_the_trunk_is_refused(model):
    with pytest.raises(ValueError, match="no trunk layer"):
        model.trunk_with_taps(mx.array([PROMPT]), [len(model.text.model.layers)])


def test_state_is_set_through_declared_methods(model):
    assert model.load_dtype is None and model.dtype_choice == "as stored"
    if model is not model.text:  # a wrapper's slots are its text model's, read-only
        with pytest.raises(AttributeError):
            model.draft_vocab_tuner = object()
    tuner = object()
    model.use_draft_vocab_tuner(tuner)
    try:
        assert model.draft_vocab_tuner is tuner and model.text.draft_vocab_tuner is tuner
    finally:
        model.use_draft_vocab_tuner(None)


class _TwoRanks:
    def rank(self):
        return 0

    def size(self):
        return 2


def test_a_split_model_declares_what_it_cannot_do(tiny_ckpt):
    inner = load_model(tiny_ckpt("qwen3_5"))[0]
    model = DistributedModel(inner, "tensor", _TwoRanks())
    caps = model.capabilities
    assert caps.shares and caps.distributed
    assert not (caps.compilable or caps.draft_vocab or caps.splits)
    # Taps in every split: tensor and expert ranks hold the whole residual stream; a
    # pipeline's stages send theirs to rank 0 with the hidden.
    assert caps.taps and DistributedModel(inner, "pipeline", _TwoRanks()).capabilities.taps
    # What the split does not change is the loaded model's.
    assert model.text is inner.text and model.dtype_choice == inner.dtype_choice == "as stored"
    assert model.drafted_entries(3) == [2] * inner.num_mtp_layers
    with pytest.raises(UserError, match="distributed"):
        apply_model_options(model, SimpleNamespace(compile_steps=True))
    assert not model.compiled and not inner.compiled
