"""``--kv-bits`` for Qwen4-Exp (``qwen4_exp``): the gated attention's K/V quantized (mlx-lm's
quantized attention under the QSA selection mask); DeltaNet states, the QSA indexer's keys
(and their pooled blocks) and the short windows kept in their precision. Exact against plain
decoding with the same quantized caches: greedy MTP at K = 1..3 (bit-equal log-probabilities),
batches with rows joining and leaving, a verify's rollback.

The fixture's config (``fixtures/qwen4_exp``) with 32-wide attention heads (``mx.quantize``'s
smallest group) and random weights, so that attention (and its quantization) moves the
logits; the random head's drafts are rejected, so every step rolls back.
"""

import json
from pathlib import Path

import mlx.core as mx
import pytest

from cache_checks import same
from mlx_mtp.models.cache.kv import cache_state_arrays
from mlx_mtp.models.cache.quantized import QuantizedKVCache
from mlx_mtp.testing import tiny_attention
from test_quantized_kv import PROMPTS, Q4, RNG, run_batch, solo, solo_logprobs

CONFIG = Path(__file__).parent / "fixtures" / "qwen4_exp" / "checkpoint" / "config.json"


@pytest.fixture(scope="module")
def model():
    config = json.loads(CONFIG.read_text())
    config["text_config"]["head_dim"] = 32
    m = tiny_attention.build_model(config, seed=0)
    m.use_kv_quantization(Q4)
    return m


def test_the_attention_caches_are_quantized_and_change_the_logits(model):
    kinds = {c.kind for c in model.make_cache() + model.make_mtp_cache()}
    assert {"quantized_kv", "pooled_index_kv", "rec"} <= kinds and "kv" not in kinds
    x = mx.array([PROMPTS[3]], mx.uint32)
    quantized = model.logits(model.trunk(x, model.make_cache())[0])
    model.use_kv_quantization(None)
    try:
        full = model.logits(model.trunk(x, model.make_cache())[0])
    finally:
        model.use_kv_quantization(Q4)
    assert not mx.allclose(quantized, full, atol=1e-3).item()


def test_greedy_mtp_equals_plain_decoding_with_the_same_caches(model):
    for prompt in PROMPTS[:4]:
        ref, ref_lps, _ = solo_logprobs(model, 0, prompt)
        for k in (1, 3):
            out, lps, _ = solo_logprobs(model, k, prompt)
            assert out == ref, (prompt, k)
            assert mx.array_equal(lps, ref_lps).item(), (prompt, k)


def test_batched_greedy_equals_solo_plain_decoding(model):
    # A one-token prompt gives the head no pass, and its short windows join a batch only
    # after one (``cache/short.py``): longer prompts only.
    prompts = [p for p in PROMPTS if len(p) > 1]
    refs = [solo(model, 0, p)[0] for p in prompts]
    for k in (0, 2):
        assert run_batch(model, k, prompts) == refs, f"K={k}"


def test_a_verify_then_rollback_leaves_the_caches_a_plain_decode_writes(model):
    prompt = [int(x) for x in RNG.integers(0, 128, 40)]
    drafts = [5, 9, 17, 33]
    spec, plain = model.make_cache(), model.make_cache()
    model.trunk(mx.array([prompt], mx.uint32), spec)
    model.trunk(mx.array([prompt], mx.uint32), plain)
    model.trunk(mx.array([drafts], mx.uint32), spec, capture=True)
    for c in spec:
        c.accept([2])
    for t in drafts[:2]:
        model.trunk(mx.array([[t]], mx.uint32), plain)
    attention = [i for i, c in enumerate(spec) if isinstance(c, QuantizedKVCache)]
    assert attention and all(spec[i].state[0].dtype == mx.uint32 for i in attention)
    same(cache_state_arrays([spec[i] for i in attention]),
         cache_state_arrays([plain[i] for i in attention]))

