"""``--kv-bits`` for the two stream trunks that take it: Qwen4-Exp (``qwen4_exp``: the gated
attention's K/V quantized, mlx-lm's quantized attention under the QSA selection mask; DeltaNet
states, the QSA indexer's keys and pooled blocks and the short windows kept in their precision)
and GLM-5.3-Flash (``glm5_next``: its NoPE MLA latents quantized, the absorbed attention through
``mx.quantized_matmul`` under the indexer's selection; KDA states and the k-pool indexer's keys
kept). Exact against plain decoding with the same quantized caches: greedy MTP at K = 1..3
(bit-equal log-probabilities), batches with rows joining and leaving, a verify's rollback.

Each family's fixture config (``fixtures/<type>``) widened to 32 (``mx.quantize``'s smallest
group: Qwen4-Exp's head_dim, GLM-5.3's latent rank) with random weights, so that attention (and
its quantization) moves the logits; the random head's drafts are rejected, so every step rolls
back.
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

FIXTURES = Path(__file__).parent / "fixtures"
# family: (the config entry widened to 32, the indexer's cache kind, kept in its precision)
FAMILIES = {"qwen4_exp": ("head_dim", "pooled_index_kv"),
            "glm5_next": ("kv_lora_rank", "pooled_index_kv")}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(request):
    config = json.loads((FIXTURES / request.param / "checkpoint" / "config.json").read_text())
    config["text_config"][FAMILIES[request.param][0]] = 32
    m = tiny_attention.build_model(config, seed=0)
    m.use_kv_quantization(Q4)
    return request.param, m


def test_the_attention_caches_are_quantized_and_change_the_logits(family_model):
    family, model = family_model
    kinds = {c.kind for c in model.make_cache() + model.make_mtp_cache()}
    assert {"quantized_kv", FAMILIES[family][1], "rec"} <= kinds and "kv" not in kinds
    x = mx.array([PROMPTS[3]], mx.uint32)  # 20 tokens: the indexers select
    quantized = model.logits(model.trunk(x, model.make_cache())[0])
    model.use_kv_quantization(None)
    try:
        full = model.logits(model.trunk(x, model.make_cache())[0])
    finally:
        model.use_kv_quantization(Q4)
    assert not mx.allclose(quantized, full, atol=1e-3).item()


def test_greedy_mtp_equals_plain_decoding_with_the_same_caches(family_model):
    _, model = family_model
    for prompt in PROMPTS[:4]:
        ref, ref_lps, _ = solo_logprobs(model, 0, prompt)
        for k in (1, 3):
            out, lps, _ = solo_logprobs(model, k, prompt)
            assert out == ref, (prompt, k)
            assert mx.array_equal(lps, ref_lps).item(), (prompt, k)


def test_batched_greedy_equals_solo_plain_decoding(family_model):
    family, model = family_model
    # Qwen4-Exp: a one-token prompt gives the head no pass, and its short windows join a
    # batch only after one (``cache/short.py``): longer prompts only.
    prompts = [p for p in PROMPTS if family != "qwen4_exp" or len(p) > 1]
    refs = [solo(model, 0, p)[0] for p in prompts]
    for k in (0, 2):
        assert run_batch(model, k, prompts) == refs, f"K={k}"


def test_a_verify_then_rollback_leaves_the_caches_a_plain_decode_writes(family_model):
    _, model = family_model
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
    quantized = [i for i, c in enumerate(spec) if isinstance(c, QuantizedKVCache)]
    assert quantized and all(spec[i].state[0].dtype == mx.uint32 for i in quantized)
    same(cache_state_arrays([spec[i] for i in quantized]),
         cache_state_arrays([plain[i] for i in quantized]))
