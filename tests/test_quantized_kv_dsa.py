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
from mlx_mtp.models.cache.kv import cache_state_arrays
from mlx_mtp.models.cache.quantized import QuantizedKVCache
from mlx_mtp.testing import tiny_attention, tiny_special
from quantized_kv_checks import (PROMPTS, Q4, assert_mtp_equals_plain, decode_on,
                                 assert_engine_rows_and_a_warm_turn_equal_solo,
                                 quantized_and_full_logits, restore_through_safetensors,
                                 run_batch, solo, solo_logprobs, verify_then_plain,
                                 write_three_and_keep)

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
    quantized, full = quantized_and_full_logits(model, model.make_cache())  # past the top-k
    assert not mx.allclose(quantized, full, atol=1e-3).item()


def test_greedy_mtp_equals_plain_decoding_with_the_same_caches(model):
    assert sum(assert_mtp_equals_plain(model, prompt)[1] for prompt in PROMPTS[:4]) > 0


def test_batched_greedy_equals_solo_plain_decoding(model):
    refs = [solo(model, 0, p)[0] for p in PROMPTS]
    for k in (0, 1, 3):
        assert run_batch(model, k, PROMPTS) == refs, f"K={k}"


def test_a_verify_then_rollback_leaves_the_caches_a_plain_decode_writes(model):
    """Latents and indexer keys past the buffer's 256-position step: a pass of 4 rows keeping 2
    equals feeding those 2 one at a time, bit for bit."""
    spec, plain = verify_then_plain(model)
    assert [c.offset for c in spec] == [c.offset for c in plain] == [256] * len(spec)
    same(cache_state_arrays(spec), cache_state_arrays(plain))
    assert all(c.state[0].dtype == mx.uint32 for c in spec)


def test_batch_rows_merge_filter_extract_and_roll_back_per_row(model):
    solos = []
    for p in PROMPTS[:3]:
        cache = model.make_cache()
        model.trunk(mx.array([p], mx.uint32), cache)
        solos.append(cache)
    merged = [type(c).merge([s[j] for s in solos]) for j, c in enumerate(solos[0])]
    assert isinstance(merged[1], BatchQuantizedIndexKeyCache)
    assert_rows_are(merged, solos)
    for c in merged:
        write_three_and_keep(c, (1, 3, 1))
        c.trim(1)  # rows 0 and 2 back as they were, row 1 two positions longer
    for b in (0, 2):
        same(cache_state_arrays([c.extract(b) for c in merged]), cache_state_arrays(solos[b]))
    assert_filter_keeps_rows(merged, solos, rows=(2, 0))


def test_state_round_trip_keeps_the_quantized_form(model, tmp_path):
    """What disk sessions and the prefix cache store: ``state``/``meta_state`` through a
    safetensors file and ``CACHE_KINDS``; decoding on from the restored caches is equal."""
    from mlx_mtp.decode.sampling import SamplingParams
    from mlx_mtp.decode.speculative import MTPDecoder

    prompt = PROMPTS[3]
    ref, _ = solo(model, 2, prompt)
    dec = MTPDecoder(model, 2, SamplingParams(), adaptive=False)
    dec.prefill(prompt)
    restore_through_safetensors(dec.cache, range(len(dec.cache)), tmp_path / "s.safetensors")
    assert decode_on(dec) == ref


def test_a_group_that_does_not_divide_the_indexer_keys_is_refused():
    m = tiny_attention.build_model(dict(tiny_special.dsa_config(), qk_rope_head_dim=32), seed=0)
    with pytest.raises(ValueError, match="--kv-group-size 32 does not divide the attention "
                                         "head size 16"):  # the tiny indexer's keys
        m.use_kv_quantization(Q4)
    assert m.kv_quantization is None


def test_inspect_says_what_is_quantized(tmp_path):
    from mlx_mtp.tools.inspect_model import inspect_model, render

    config = lambda **c: dict(tiny_special.dsa_config("glm_moe_dsa", **c), qk_rope_head_dim=32,
                              index_head_dim=32)
    path = tiny_attention.write_tiny(tmp_path / "dsa", config, tiny_attention.to_hf)
    kvq = inspect_model(str(path), 4, 32)["kv_quantization"]
    assert kvq["refused"] is None and kvq["kept"] == []
    assert kvq["quantized"] == ["attention K/V or MLA latents", "DSA indexer keys"]
    assert "quantized attention K/V or MLA latents, DSA indexer keys" in render(
        inspect_model(str(path), 4, 32))
    assert "does not divide" in inspect_model(str(path), 4, 64)["kv_quantization"]["refused"]


@pytest.mark.parametrize("start", [9, 12])
def test_the_switch_after_quantized_kv_start_is_exact_under_mtp(start):
    """Both caches hold full precision until ``start`` tokens (prompt 8), then switch together;
    a verify pass never crosses the switch, so every row's log-probabilities are a plain
    step's."""
    from mlx_mtp.models.cache.quantized import KVQuantization

    model = dsa_model("deepseek_v32")
    model.use_kv_quantization(KVQuantization(4, 32, start))
    ref, ref_lps, _ = solo_logprobs(model, 0, PROMPTS[5], n=20)
    for k in (1, 3):
        out, lps, dec = solo_logprobs(model, k, PROMPTS[5], n=20)
        assert out == ref and mx.array_equal(lps, ref_lps).item(), k
        assert dec.stats.num_accepted_tokens > 0


def test_the_server_engine_batches_quantized_rows_and_reuses_their_prefixes(tmp_path):
    """Six concurrent requests (rows joining and leaving), drafting or not, then a turn that
    extends one of them from the prefix cache: every output is the request's plain
    single-sequence decode with the same quantized caches."""
    from mlx_mtp.models.io.loader import load

    config = lambda **c: dict(tiny_special.dsa_config("deepseek_v32", **c), qk_rope_head_dim=32,
                              index_head_dim=32)
    path = tiny_attention.write_tiny(tmp_path / "dsa", config, tiny_attention.to_hf, "noisy",
                                     vocab_size=4096)  # the test tokenizer's ids
    model, tok = load(str(path))
    model.use_kv_quantization(Q4)
    assert_engine_rows_and_a_warm_turn_equal_solo(model, tok)
