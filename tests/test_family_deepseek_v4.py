"""DeepSeek-V4 (``deepseek_v4``): our MLX trunk against transformers 5.24's
``DeepseekV4ForCausalLM`` on a tiny checkpoint in the released layout, written and recorded by
``fixtures/deepseek_v4_reference.py`` (CI has no torch: checkpoint and reference are
committed). Four layers: sliding-only, CSA (compress 4, indexer top-2), HCA (compress 8) and a
hash-MoE layer; an 8-token window, so the 68 tokens cross many compression boundaries.
Greedy output with the MTP head (K = 1..3) is plain decoding's, across rollbacks over
compression boundaries."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import family_checks as fc
from mlx_mtp.models.io.loader import load_model

FIXTURE = Path(__file__).parent / "fixtures" / "deepseek_v4"


@pytest.fixture(scope="module")
def model():
    return load_model(FIXTURE)[0]


@pytest.fixture(scope="module")
def ref():
    return np.load(FIXTURE / "reference.npz")


def test_trunk_logits_equal_transformers(model, ref):
    """One forward over prompt and continuation, and cached one-token decoding after the
    prompt, both give transformers' logits."""
    prompt, tokens = ref["prompt"].tolist(), ref["tokens"].tolist()
    logits = model(mx.array([prompt + tokens]))[0]
    np.testing.assert_allclose(np.array(logits), ref["forward_logits"], atol=2e-4)
    stepped = fc.one_by_one_logits(model, prompt, tokens[:-1])[0]
    np.testing.assert_allclose(np.array(stepped), ref["step_logits"][1:], atol=2e-4)


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_greedy_equals_transformers_at_every_k(model, ref, k):
    """K = 0 is plain decoding; K = 1..3 verify drafts and roll the compressed caches back
    (the random head accepts some drafts, so rollbacks keep partial prefixes)."""
    prompt, tokens = ref["prompt"].tolist(), ref["tokens"].tolist()
    got, dec = fc.mtp_tokens(model, prompt, k, n=len(tokens))
    assert got == tokens
    if k:
        assert dec.stats.num_draft_tokens > 0
