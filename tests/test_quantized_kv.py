"""Quantized KV caches (``--kv-bits``): exact under MTP, lookup drafts and batching, equal
to mlx-lm's own quantized generation, rolled back exactly, saved in quantized form.

Tiny models with 32-wide attention heads (``mx.quantize``'s smallest group is 32), 4-bit
caches in groups of 32, so quantization is coarse enough to change logits.
"""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step as mlx_lm_generate_step
from mlx_lm.models.cache import QuantizedKVCache as MlxLmQuantizedKVCache
from mlx_lm.utils import load_model as mlx_lm_load_model

from cache_checks import assert_filter_keeps_rows, assert_rows_are, same
from distribution_check import assert_follows, sample_outcomes, two_token_joint
from mlx_mtp.decode.draft_source import DraftSources
from mlx_mtp.decode.sampling import SamplingParams, filtered_logprobs
from mlx_mtp.decode.speculative import MTPDecoder
from mlx_mtp.drafters.lookup import LookupSettings
from mlx_mtp.models.cache.kv import cache_state_arrays
from mlx_mtp.models.cache.quantized import BatchQuantizedKVCache, KVQuantization, QuantizedKVCache
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.testing import tiny, tiny_attention, tiny_special
from mlx_mtp.testing.tiny_bailing import bailing_hybrid_config
from quantized_kv_checks import (N, PROMPTS, Q4, RNG, assert_mtp_equals_plain, decode_on,
                                 assert_engine_rows_and_a_warm_turn_equal_solo,
                                 quantized_and_full_logits, restore_through_safetensors,
                                 run_batch, solo, solo_logprobs, verify_then_plain,
                                 write_three_and_keep)


def hybrid_model(vocab_size: int = 512):
    text = dict(tiny.tiny_text_config("qwen3_5", vocab_size=vocab_size), head_dim=32)
    return tiny.make_oracle(tiny.build_model("qwen3_5", text, seed=0), trunk_scale=0.5,
                            fc_noise=1.5), text


def glm_model():
    config = dict(tiny_attention.tiny_config("glm4_moe"), head_dim=32)
    model = tiny_attention.build_model(config, seed=0)
    return tiny_attention.make_oracle(model, 0.5, 2.5, 0)


def mla_model(family: str):
    """MLA: the cache holds the latent (kv_lora_rank 32) and its RoPE part (made 32 wide)."""
    if family == "longcat_flash":  # two MLA sublayers per layer; a random head
        return tiny_attention.build_model(
            dict(tiny_special.longcat_flash_config(), qk_rope_head_dim=32), seed=0)
    config = dict(tiny_attention.tiny_config(family), qk_rope_head_dim=32)
    return tiny_attention.make_oracle(tiny_attention.build_model(config, seed=0), 0.5, 2.5, 0)


def nemotron_model():
    """Mamba-2 states (kept in their precision) beside quantized attention."""
    model = tiny_attention.build_model(dict(tiny_special.nemotron_h_config(), head_dim=32), 0)
    tiny_special.nemotron_oracle(model, 0.5, 2.5, 0)
    return model


def windowed_model(family: str):
    """Full-attention layers quantized beside window layers (kept in full precision)."""
    if family == "step3p5":
        config = dict(tiny_special.step3p5_config(), head_dim=32)
    else:
        config = dict(tiny_special.mimo_v2_flash_config(), head_dim=32, v_head_dim=32,
                      swa_head_dim=32, swa_v_head_dim=32)
    model = tiny_attention.build_model(config, seed=0)
    tiny_special.chain_oracle(model, 2.5, 0)
    return model


MODELS = {"qwen3_5": lambda: hybrid_model()[0], "glm4_moe": glm_model,
          "deepseek_v3": lambda: mla_model("deepseek_v3"),
          "longcat_flash": lambda: mla_model("longcat_flash"), "nemotron_h": nemotron_model,
          "step3p5": lambda: windowed_model("step3p5"),
          "mimo_v2_flash": lambda: windowed_model("mimo_v2_flash")}
RANDOM_HEADS = {"longcat_flash", "mimo_v2_flash"}  # drafts rejected: rollback still runs
# Nemotron-H's Mamba-2 verify rows differ from one-token steps by float rounding (~1e-5 in
# log-probabilities), with or without --kv-bits: its tokens are compared, not its logits.
BITWISE_VERIFY = set(MODELS) - {"nemotron_h"}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    m = MODELS[request.param]()
    m.use_kv_quantization(Q4)
    yield m
    m.use_kv_quantization(None)


def test_the_caches_are_quantized_and_change_the_logits(model):
    cache = model.make_cache()
    assert any(isinstance(c, QuantizedKVCache) for c in cache)
    windowed = model.model_type in ("step3p5", "mimo_v2_flash")  # window MTP layers
    assert windowed or all(isinstance(c, QuantizedKVCache) for c in model.make_mtp_cache())
    quantized, full = quantized_and_full_logits(model, cache)
    assert not mx.allclose(quantized, full, atol=1e-3).item()


def test_greedy_mtp_and_lookup_equal_plain_decoding_with_the_same_cache(model):
    accepted = 0
    for prompt in PROMPTS[:4]:
        ref, n = assert_mtp_equals_plain(model, prompt, model.model_type in BITWISE_VERIFY)
        accepted += n
        copy_prompt = prompt + ref[:6] + prompt
        ref_copy, _ = solo(model, 0, copy_prompt)
        for source in ("lookup", "both"):
            sources = DraftSources(source, LookupSettings(max_draft=4), adaptive=False)
            out, _ = solo(model, 3, copy_prompt, drafter=sources.drafter())
            assert out == ref_copy, (prompt, source)
    assert accepted > 0 or model.model_type in RANDOM_HEADS


@pytest.mark.parametrize("start", [9, 10, 12])
def test_the_switch_after_quantized_kv_start_is_exact_under_mtp(start):
    """Full precision until the cache holds ``start`` tokens (prompt 8): a verify pass never
    crosses the switch (K is capped before it), so every row's log-probabilities are a plain
    step's."""
    model, _ = hybrid_model()
    model.use_kv_quantization(KVQuantization(4, 32, start))
    prompt = PROMPTS[5]
    ref, ref_lps, _ = solo_logprobs(model, 0, prompt, n=20)
    model.use_kv_quantization(KVQuantization(4, 32, 0))
    assert not mx.array_equal(solo_logprobs(model, 0, prompt, n=20)[1], ref_lps).item()
    model.use_kv_quantization(KVQuantization(4, 32, start))
    for k in (1, 3):
        out, lps, dec = solo_logprobs(model, k, prompt, n=20)
        assert out == ref and mx.array_equal(lps, ref_lps).item(), k
        assert dec.stats.num_accepted_tokens > 0


def test_batched_greedy_equals_solo_plain_decoding(model):
    refs = [solo(model, 0, p)[0] for p in PROMPTS]
    for k in (0, 1, 3):
        assert run_batch(model, k, PROMPTS) == refs, f"K={k}"


def test_a_verify_then_rollback_leaves_the_cache_a_plain_decode_writes(model):
    """Rows past the buffer's 256-position step, and partial quantization groups: a pass of
    4 rows keeping 2 equals feeding those 2 one at a time."""
    spec, plain = verify_then_plain(model)
    attention = [i for i, c in enumerate(spec) if isinstance(c, QuantizedKVCache)]
    assert [spec[i].offset for i in attention] == [plain[i].offset for i in attention] != []
    if model.model_type not in BITWISE_VERIFY:  # the kept rows' inputs differ by rounding:
        spec, plain = ({i: cs[i].copy() for i in attention} for cs in (spec, plain))
        for c in [*spec.values(), *plain.values()]:
            c.trim(2)  # the prompt's rows
    same(cache_state_arrays([spec[i] for i in attention]),
         cache_state_arrays([plain[i] for i in attention]))
    assert all(spec[i].state[0].dtype == mx.uint32 for i in attention)


def test_batch_rows_merge_filter_extract_and_roll_back_per_row(model):
    attention = [i for i, c in enumerate(model.make_cache()) if isinstance(c, QuantizedKVCache)]
    solos = []
    for p in PROMPTS[:3]:
        cache = model.make_cache()
        model.trunk(mx.array([p], mx.uint32), cache)
        solos.append([cache[i] for i in attention])
    merged = [QuantizedKVCache.merge([s[j] for s in solos]) for j in range(len(attention))]
    assert all(isinstance(c, BatchQuantizedKVCache) for c in merged)
    assert_rows_are(merged, solos)
    for c in merged:
        write_three_and_keep(c, (1, 3, 1))
    assert [c.lengths() for c in merged][0] == [len(p) + n for p, n in zip(PROMPTS, (1, 3, 1))]
    for c in merged:
        c.trim(1)  # rows 0 and 2 back as they were, row 1 two positions longer
    for b, s in enumerate(solos):
        if b != 1:
            same(cache_state_arrays([c.extract(b) for c in merged]), cache_state_arrays(s))
    assert_filter_keeps_rows(merged, solos, rows=(2, 0))


def test_state_round_trip_keeps_the_quantized_form(model, tmp_path):
    """What disk sessions and the prefix cache store: ``state``/``meta_state`` through a
    safetensors file and ``CACHE_KINDS``; decoding on from the restored caches is equal."""
    prompt = PROMPTS[3]
    ref, _ = solo(model, 0, prompt)
    dec = MTPDecoder(model, 0, SamplingParams(), adaptive=False)
    dec.prefill(prompt)
    quantized = [i for i, c in enumerate(dec.cache) if isinstance(c, QuantizedKVCache)]
    restore_through_safetensors(dec.cache, quantized, tmp_path / "s.safetensors")
    assert decode_on(dec) == ref


def test_a_disk_session_keeps_the_quantized_form_and_decodes_as_a_cold_turn(tmp_path):
    """The server's ``SessionStore`` (safetensors on disk, checked on load against the
    model's reference state): the restored caches are quantized, equal to the stored ones,
    and decode on as the sequence that never left memory; a store of the same weights
    without ``--kv-bits`` does not take the entry."""
    from mlx_mtp.decode.sequence import reference_state
    from mlx_mtp.server.session_store import SessionStore, model_fingerprint

    model, _ = hybrid_model()
    model.use_kv_quantization(Q4)
    prompt = [int(x) for x in RNG.integers(0, 128, 40)]
    store = SessionStore(tmp_path, model_fingerprint(model), min_tokens=16,
                         reference=reference_state(model))
    dec = MTPDecoder(model, 2, SamplingParams(), adaptive=False)
    dec.prefill(prompt)
    fresh = dec.snapshot()
    assert store.put(prompt, fresh, has_mtp=True)
    store.flush()
    key, restored = SessionStore(tmp_path, model_fingerprint(model), min_tokens=16,
                                 reference=reference_state(model)).lookup(prompt, need_mtp=True)
    assert key == tuple(prompt)
    kinds = {type(c) for c in restored.cache + restored.mtp_cache}
    assert QuantizedKVCache in kinds and all(c.state[0].dtype == mx.uint32 for c in
                                             restored.cache + restored.mtp_cache
                                             if isinstance(c, QuantizedKVCache))
    same(cache_state_arrays(restored.cache + restored.mtp_cache),
         cache_state_arrays(fresh.cache + fresh.mtp_cache))
    warm = MTPDecoder(model, 2, SamplingParams(), adaptive=False)
    warm.restore(restored)
    warm.prefill(prompt)
    assert decode_on(warm) == solo(model, 0, prompt)[0]
    model.use_kv_quantization(None)
    assert SessionStore(tmp_path, model_fingerprint(model), min_tokens=16).lookup(
        prompt, need_mtp=True) is None


def test_sampling_still_follows_the_target():
    """Two tokens from 2-draft steps with the quantized cache against the exact two-token
    joint of the same model and cache (Pearson's chi-square)."""
    model, _ = hybrid_model()
    model.use_kv_quantization(Q4)
    params = SamplingParams(temperature=40.0, top_k=3)
    prompt = PROMPTS[1]

    def target(prefix):
        h, _ = model.trunk(mx.array([prompt + prefix], mx.uint32), model.make_cache())
        logits = model.logits(h)[0, -1:].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return np.exp(np.array(filtered_logprobs(lp, params)[0]))

    joint = two_token_joint(target)

    def draw(seed):
        mx.random.seed(seed)
        dec = MTPDecoder(model, 2, params, adaptive=False)
        dec.prefill(prompt)
        out = dec.step().tokens
        while len(out) < 2:
            out += dec.step().tokens
        return out[:2], dec

    n_samples = 300
    seen, accepted = sample_outcomes(draw, n_samples)
    assert accepted > 0 and len(seen) > 4  # drafts accepted, and outcomes spread
    assert_follows(seen, joint, n_samples)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    model, text = hybrid_model(vocab_size=4096)  # the test tokenizer's ids
    return tiny.save_hf_checkpoint(model, "qwen3_5", text, tmp_path_factory.mktemp("q") / "c")


def test_the_server_engine_batches_quantized_rows_and_reuses_their_prefixes(ckpt):
    """Six concurrent requests (a batch whose rows join and leave), drafting or not, then a
    turn that extends one of them from the prefix cache: every output is the request's
    plain single-sequence decode with the same quantized cache."""
    from mlx_mtp.models.io.loader import load

    model, tok = load(str(ckpt))
    model.use_kv_quantization(Q4)
    assert_engine_rows_and_a_warm_turn_equal_solo(model, tok)


@pytest.mark.parametrize("start", [0, 6])
def test_plain_decoding_equals_mlx_lm_generation_with_its_kv_bits(ckpt, start):
    """mlx-lm's own generation on the same checkpoint: ``kv_bits`` with
    ``quantized_kv_start`` (it switches after the forward that reaches it, as we do); at
    start 0 mlx-lm runs its first chunk in full precision, so its caches are made quantized
    from the start (its ``QuantizedKVCache``)."""
    ours, _ = load_model(Path(ckpt))
    ours.use_kv_quantization(KVQuantization(4, 32, start))
    ref_model, _ = mlx_lm_load_model(Path(ckpt))
    for prompt in PROMPTS[1:4]:
        kw = dict(kv_bits=4, kv_group_size=32, quantized_kv_start=start)
        if start == 0:
            cache = ref_model.make_cache()
            kw = {"prompt_cache": [MlxLmQuantizedKVCache(32, 4) if type(c).__name__ == "KVCache"
                                   else c for c in cache]}
        ref = [int(t) for t, _ in mlx_lm_generate_step(mx.array(prompt), ref_model,
                                                       max_tokens=N, **kw)]
        assert solo(ours, 0, prompt)[0] == ref, prompt
        if start == 0:
            assert solo(ours, 3, prompt)[0] == ref, prompt


def test_families_without_a_quantized_kind_refuse_clearly():
    m = tiny_attention.build_model(tiny_attention.tiny_config("deepseek_v3"), seed=0)
    with pytest.raises(ValueError, match="--kv-group-size 32 does not divide the attention "
                                         "head size 8"):  # the tiny RoPE part
        m.use_kv_quantization(Q4)
    sinks = dict(tiny_special.mimo_v2_flash_config(), head_dim=32, v_head_dim=32,
                 add_full_attention_sink_bias=True)
    for config, why in ((bailing_hybrid_config(), "caches have no quantized kind"),
                        (sinks, "attention sinks")):
        m = tiny_attention.build_model(config, seed=0)
        with pytest.raises(ValueError, match=f"--kv-bits is not available for .*{why}"):
            m.use_kv_quantization(Q4)
        assert m.kv_quantization is None
    m = glm_model()
    with pytest.raises(ValueError, match="--kv-group-size 64 does not divide"):
        m.use_kv_quantization(KVQuantization(4, 64))
    with pytest.raises(ValueError, match="--kv-bits must be 4 or 8"):
        KVQuantization(3)
    with pytest.raises(ValueError, match="one sequence"):
        Q4.__class__(4, 32, 8).check_batchable()


def test_deepseek_v4_refuses_what_its_caches_cannot_take_in_one_line():
    """Its indexers' keys (16 wide in the fixture) are quantized too, so the group must divide
    them; its caches are quantized from the first token (no ``--quantized-kv-start``). Taken:
    ``test_quantized_kv_streams.py``."""
    v4, _ = load_model(Path(__file__).parent / "fixtures" / "deepseek_v4")
    with pytest.raises(ValueError, match="^--kv-group-size 32 does not divide the attention "
                                         "head size 16$"):
        v4.use_kv_quantization(Q4)
    with pytest.raises(ValueError, match="^--quantized-kv-start is not available for "
                                         "deepseek_v4: its caches are quantized from the first "
                                         "token$"):
        v4.use_kv_quantization(KVQuantization(8, 32, 8))
    assert v4.kv_quantization is None


def test_the_flags_reach_the_model_and_bad_ones_are_one_line_user_errors():
    import argparse

    from mlx_mtp.options import UserError, add_kv_cache_arguments, apply_kv_cache_options
    from mlx_mtp.server import main as server_main

    p = argparse.ArgumentParser()
    add_kv_cache_arguments(p)
    model = glm_model()
    apply_kv_cache_options(model, p.parse_args(["--kv-bits", "8", "--kv-group-size", "32"]))
    assert model.kv_quantization == KVQuantization(8, 32, 0)
    with pytest.raises(UserError, match="^--kv-group-size 64 does not divide the attention "
                                        "head size 32$"):
        apply_kv_cache_options(model, p.parse_args(["--kv-bits", "4"]))
    kda = tiny_attention.build_model(bailing_hybrid_config(), seed=0)
    with pytest.raises(UserError, match="^--kv-bits is not available for bailing_hybrid: its "):
        apply_kv_cache_options(kda, p.parse_args(["--kv-bits", "4", "--kv-group-size", "32"]))
    with pytest.raises(UserError, match="--quantized-kv-start must be >= 0"):
        apply_kv_cache_options(model, p.parse_args(["--kv-bits", "4", "--kv-group-size", "32",
                                                    "--quantized-kv-start", "-1"]))
    serve = argparse.ArgumentParser()
    server_main.add_arguments(serve)
    with pytest.raises(UserError, match="--quantized-kv-start applies to one sequence"):
        server_main._check_args(serve.parse_args(["--kv-bits", "4", "--quantized-kv-start", "9"]))


def test_bytes_held_at_4_bits_are_under_0_3_of_bf16_and_inspect_reports_them():
    from mlx_mtp.models.cache.kv import KVCache
    from mlx_mtp.tools.inspect_model import inspect_model, render

    k = mx.random.normal((1, 2, 512, 64)).astype(mx.bfloat16)
    full, quantized = KVCache(), QuantizedKVCache(KVQuantization(4, 64))
    for c in (full, quantized):
        c.update_and_fetch(k, k)
    assert quantized.nbytes / full.nbytes <= 0.3
    report = inspect_model(None, 4, 64)  # the embedded demo model (Qwen3.5 hybrid)
    mem = report["memory"]
    assert report["kv_quantization"]["refused"] is None
    assert mem["kv_bytes_per_1k_tokens_quantized"] / mem["kv_bytes_per_1k_tokens"] <= 0.3
    assert "recurrent states kept in their own precision" in render(report)
    assert "refused" in render(inspect_model(None, 8, 128))


def test_generate_with_kv_bits_runs_and_a_bad_group_exits_2_with_one_line(cli):
    def run(*args):  # in this process: an exit code and the output are all it needs
        return cli("generate", "-p", "def f():", "-m", "8", *args)

    code, out, err = run("--kv-bits", "4")  # the embedded demo model (heads of 64)
    assert code == 0, err
    assert "KV cache: 4-bit, groups of 64" in out + err
    code, out, err = run("--kv-bits", "4", "--kv-group-size", "128")
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [
        "mlx-mtp: error: --kv-group-size 128 does not divide the attention head size 64"]
