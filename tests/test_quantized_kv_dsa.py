"""``--kv-bits`` for DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): the MLA latents and the
indexer's keys quantized (kinds ``quantized_kv`` and ``quantized_index_kv``), every pass ours
(``blocks/dsa.py``: mlx-lm's DSA layers read no quantized cache). Exact against plain decoding
with the same quantized caches: greedy MTP at K = 1..3 (bit-equal log-probabilities), batches
with rows joining and leaving, a verify's rollback, disk round trips.

Tiny models whose cached widths are 32 (latent, RoPE part, indexer keys), 4-bit caches in
groups of 32, an index top-k of 6 that the prompts and decodes cross; heads that follow an
oracle through a scaled trunk, so drafts land and are rejected.
"""

import mlx.core as mx
import pytest

from cache_checks import assert_filter_keeps_rows, assert_rows_are, same
from mlx_mtp.models.cache.index import BatchQuantizedIndexKeyCache, QuantizedIndexKeyCache
from mlx_mtp.models.cache.kv import CACHE_KINDS, cache_state_arrays
from mlx_mtp.models.cache.quantized import KVQuantization, QuantizedKVCache
from mlx_mtp.testing import tiny_attention, tiny_special
from test_quantized_kv import N, PROMPTS, Q4, RNG, run_batch, solo, solo_logprobs

FAMILIES = ["deepseek_v32", "glm_moe_dsa"]


def dsa_model(family: str):
    config = dict(tiny_special.dsa_config(family), qk_rope_head_dim=32, index_head_dim=32)
    return tiny_attention.make_oracle(tiny_attention.build_model(config, seed=0), 0.5, 2.5, 0)


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    m = dsa_model(request.param)
    m.use_kv_quantization(Q4)
    yield m
    m.use_kv_quantization(None)


def test_both_caches_are_quantized_and_change_the_logits(model):
    for caches in (model.make_cache(), model.make_mtp_cache()):
        assert [type(c) for c in caches[:2]] == [QuantizedKVCache, QuantizedIndexKeyCache]
    x = mx.array([PROMPTS[3]], mx.uint32)  # 20 tokens: past the top-k
    quantized = model.logits(model.trunk(x, model.make_cache())[0])
    model.use_kv_quantization(None)
    try:
        full = model.logits(model.trunk(x, model.make_cache())[0])
    finally:
        model.use_kv_quantization(Q4)
    assert not mx.allclose(quantized, full, atol=1e-3).item()


def test_greedy_mtp_equals_plain_decoding_with_the_same_caches(model):
    accepted = 0
    for prompt in PROMPTS[:4]:
        ref, ref_lps, _ = solo_logprobs(model, 0, prompt)
        for k in (1, 2, 3):
            out, lps, dec = solo_logprobs(model, k, prompt)
            assert out == ref, (prompt, k)
            assert mx.array_equal(lps, ref_lps).item(), (prompt, k)
            accepted += dec.stats.num_accepted_tokens
    assert accepted > 0
