"""``--kv-bits`` for the stream trunks: Qwen4-Exp (``qwen4_exp``: the gated attention's K/V
quantized, mlx-lm's quantized attention under the QSA selection mask, and the QSA indexer's
keys, pooled from their dequantized rows; DeltaNet states and the short windows kept in their
precision), GLM-5.3-Flash (``glm5_next``: its NoPE MLA latents quantized, the absorbed
attention through ``mx.quantized_matmul`` under the indexer's selection, and the k-pool
indexer's keys and gates; KDA states kept) and DeepSeek-V4 (``deepseek_v4``: every layer's window keys and compressed entries, the
indexers' included, quantized; the compressors' pending raw rows kept). Exact against plain
decoding with the same quantized caches: greedy MTP at K = 1..3 (bit-equal log-probabilities),
batches with rows joining and leaving, a verify's rollback (DeepSeek-V4: at every phase of its
windows, across their completion), and a disk session (the server's store).

Each family's fixture config (``fixtures/<type>``) widened to 32 (``mx.quantize``'s smallest
group: Qwen4-Exp's head_dim and QSA indexer keys, GLM-5.3's latent rank and k-pool indexer
keys, DeepSeek-V4's indexer keys) with random
weights (DeepSeek-V4: its fixture's, the widened indexers' random), so that attention (and its
quantization) moves the logits; the random heads' drafts are rejected, so every step rolls back.
"""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

import cache_checks as cc
import family_checks as fc
from cache_checks import assert_filter_keeps_rows, assert_rows_are, merged_solos, same
from cache_checks import solo as cache_solo
from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.decode.speculative import MTPDecoder
from mlx_mtp.models.cache.kv import cache_state_arrays
from mlx_mtp.models.cache.quantized import KVQuantization
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.testing import tiny_attention
from test_quantized_kv import PROMPTS, Q4, RNG, run_batch, solo, solo_logprobs

FIXTURES = Path(__file__).parent / "fixtures"
# family: (the config entries widened to 32, the cache kinds made: quantized ones first, then
# those kept in their precision)
FAMILIES = {"qwen4_exp": (("head_dim", "indexer_head_dim"),
                          {"quantized_kv", "quantized_pooled_index_kv"}, {"rec", "short"}),
            "glm5_next": (("kv_lora_rank", "index_head_dim"),
                          {"quantized_kv", "quantized_pooled_index_kv"}, {"rec"}),
            "deepseek_v4": (("index_head_dim",), {"quantized_dsv4"}, set())}


def dsv4_model(config: dict):
    """The DeepSeek-V4 fixture's weights; the indexers, widened, keep their random ones."""
    fixture, _ = load_model(FIXTURES / "deepseek_v4")
    model = tiny_attention.build_model(config, seed=0)
    shapes = {k: v.shape for k, v in tree_flatten(model.parameters())}
    model.load_weights([(k, v) for k, v in tree_flatten(fixture.parameters())
                        if shapes[k] == v.shape], strict=False)
    return model


def fixture_checkpoint(family: str) -> Path:
    return FIXTURES / family / ("" if family == "deepseek_v4" else "checkpoint")


def widened(family: str, **more) -> tuple:
    """(The fixture's config with its entries widened to 32 and ``more``, a model of it)."""
    config = json.loads((fixture_checkpoint(family) / "config.json").read_text())
    text = config if family == "deepseek_v4" else config["text_config"]
    text.update({**dict.fromkeys(FAMILIES[family][0], 32), **more})
    if family == "deepseek_v4":
        return config, dsv4_model(config)
    return config, tiny_attention.build_model(config, seed=0)


def quantized_model(family: str):
    m = widened(family)[1]
    m.use_kv_quantization(Q4)
    return m


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(request):
    return request.param, quantized_model(request.param)


def test_the_attention_caches_are_quantized_and_change_the_logits(family_model):
    family, model = family_model
    caches = model.make_cache() + model.make_mtp_cache()
    _, quantized, kept = FAMILIES[family]
    assert {c.kind for c in caches if c.quantization == Q4} == quantized
    assert {c.kind for c in caches if c.quantization is None} == kept
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
        for k in (1, 2, 3):
            out, lps, _ = solo_logprobs(model, k, prompt)
            assert out == ref, (prompt, k)
            assert mx.array_equal(lps, ref_lps).item(), (prompt, k)


def test_batched_greedy_equals_solo_plain_decoding(family_model):
    family, model = family_model
    # Qwen4-Exp: a one-token prompt gives the head no pass, and its short windows join a
    # batch only after one (``cache/short.py``): longer prompts only.
    prompts = [p for p in PROMPTS if family != "qwen4_exp" or len(p) > 1]
    refs = [solo(model, 0, p)[0] for p in prompts]
    for k in (0, 1, 2):  # K = 1: a one-token prompt's row has no head window to trim yet
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
    quantized = [i for i, c in enumerate(spec) if c.quantization is not None]
    assert quantized and all(spec[i].state[0].dtype == mx.uint32 for i in quantized)
    same(cache_state_arrays([spec[i] for i in quantized]),
         cache_state_arrays([plain[i] for i in quantized]))


@pytest.fixture(scope="module")
def dsv4():
    return quantized_model("deepseek_v4")


@pytest.mark.parametrize("start", range(17, 25))
def test_deepseek_v4_rollback_across_window_completions_is_exact(dsv4, start):
    """A verify of 4 positions after ``start`` tokens (every phase of the 4- and 8-position
    windows), keeping 1..4: every layer's quantized window, entries and pending rows are bit
    for bit those of feeding the kept tokens one at a time, and so are the next logits."""
    seq = [int(x) for x in RNG.integers(0, 256, start + 5)]
    prefix, rows, after = seq[:start], seq[start:start + 4], seq[start + 4]
    for keep in range(1, 5):
        spec, plain = fc.verified_and_plain(dsv4, prefix, rows, keep)
        same(cache_state_arrays(spec), cache_state_arrays(plain))
        nxt = mx.array([[rows[keep] if keep < 4 else after]])
        same([dsv4.logits(dsv4.trunk(nxt, spec)[0])], [dsv4.logits(dsv4.trunk(nxt, plain)[0])])


def test_deepseek_v4_batch_rows_merge_filter_extract_and_roll_back_per_row(dsv4):
    """Three prompts' quantized caches merged into one batch (rows at different window
    phases): a verify of 3 positions keeping 1, 3, 2 leaves each row as its own plain decode
    of those tokens; extract and filter give back each row's caches bit for bit."""
    prompts, drafts = PROMPTS[:3], [[7, 8, 9], [40, 41, 42], [90, 91, 92]]
    merged = merged_solos(dsv4, prompts)[1]
    assert {c.kind for c in merged} == {"dsv4_rows"}
    dsv4.trunk(mx.array(drafts, mx.uint32), merged, capture=True)
    for c in merged:
        c.accept([1, 3, 2])
    plain = [cache_solo(dsv4, p + d[:n]) for p, d, n in zip(prompts, drafts, (1, 3, 2))]
    assert_rows_are(merged, plain)
    assert all(c.extract(1).quantization == Q4 for c in merged)
    assert_filter_keeps_rows(merged, plain, rows=(2, 0))


def test_deepseek_v4_a_disk_session_keeps_the_quantized_form_and_decodes_on(dsv4, tmp_path):
    """The server's ``SessionStore`` (safetensors on disk, checked against the model's
    reference state): the restored trunk and head caches are quantized, equal to the stored
    ones, and decode on as the sequence that never left memory; a store of the same weights
    without ``--kv-bits`` does not take the entry."""
    from mlx_mtp.decode.sequence import reference_state
    from mlx_mtp.server.session_store import SessionStore, model_fingerprint

    prompt = [int(x) for x in RNG.integers(0, 256, 40)]

    def store():
        return SessionStore(tmp_path, model_fingerprint(dsv4), min_tokens=16,
                            reference=reference_state(dsv4))

    dec = MTPDecoder(dsv4, 2, SamplingParams(), adaptive=False)
    dec.prefill(prompt)
    fresh = dec.snapshot()
    saving = store()
    assert saving.put(prompt, fresh, has_mtp=True)
    saving.flush()
    key, restored = store().lookup(prompt, need_mtp=True)
    caches = restored.cache + restored.mtp_cache
    assert key == tuple(prompt) and {c.kind for c in caches} == {"quantized_dsv4"}
    assert all(c.quantization == Q4 and c.state[0].dtype == mx.uint32 for c in caches)
    same(cache_state_arrays(caches), cache_state_arrays(fresh.cache + fresh.mtp_cache))
    warm = MTPDecoder(dsv4, 2, SamplingParams(), adaptive=False)
    warm.restore(restored)
    warm.prefill(prompt)
    out = []
    while len(out) < 14:
        out += warm.step().tokens
    assert out[:14] == solo(dsv4, 0, prompt)[0]
    dsv4.use_kv_quantization(None)
    try:
        assert SessionStore(tmp_path, model_fingerprint(dsv4), min_tokens=16).lookup(
            prompt, need_mtp=True) is None
    finally:
        dsv4.use_kv_quantization(Q4)


def test_deepseek_v4_head_window_drops_a_steps_drafts_exactly(dsv4):
    """The head's quantized window keeps spare keys past the window: trimming two drafts'
    keys leaves the keys it held before them (those still in its window) bit for bit."""
    prompt = PROMPTS[3]
    head = dsv4.make_mtp_cache()[0]
    hidden = dsv4.trunk(mx.array([prompt]), dsv4.make_cache())[1]
    dsv4.mtp_forward(hidden[:, :-1], mx.array([prompt[1:]]), [head])
    kept = head.copy()
    for t in (5, 6):  # two drafts' entries, past the window's spare keys
        dsv4.mtp_forward(hidden[:, -1:], mx.array([[t]]), [head])
    assert head.trim(2) == 2 and head.lengths() == kept.lengths()
    n = head.state[0].shape[2]  # the window kept its last keys
    assert n >= dsv4.args.sliding_window - 1 and head.state[0].dtype == mx.uint32
    same([a[:, :, -n:] for a in head.state[:3]], [a[:, :, -n:] for a in kept.state[:3]])


def test_deepseek_v4_inspect_lists_the_kinds_and_sizes_the_quantized_entries(dsv4, tmp_path):
    """``inspect --kv-bits 4``: windows and compressed entries quantized, the compressors'
    pending rows kept; its 4-bit bytes per token are what the quantized entries grow by over
    64 tokens (a float32 model's scales and biases counted at 16 bits, as inspect counts
    them); group 64, which its 32-wide indexer keys refuse, gets no figure (the 0.3x at
    group 64 is checked on 64-wide caches in ``test_inspect_cache_bytes.py``)."""
    from mlx_mtp.tools.inspect_model import inspect_model, render

    path = shutil.copytree(FIXTURES / "deepseek_v4", tmp_path / "v4")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, index_head_dim=32)))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(dsv4.parameters())))
    report = inspect_model(str(path), 4, 32)
    kvq = report["kv_quantization"]
    assert kvq["refused"] is None
    assert kvq["quantized"] == ["DeepSeek-V4 windows and compressed entries"]
    assert kvq["kept"] == ["DeepSeek-V4 compressors' pending rows"]
    assert "kept in their precision: DeepSeek-V4 compressors' pending rows" in render(report)
    assert "recurrent states" not in render(report).split("kv cache")[1]
    cache = fc.prefilled_cache(dsv4, [int(x) for x in RNG.integers(0, 256, 64)])
    entries = 0
    for c in cache:
        for name, a in zip(c.state_names, c.state):
            if ".entries" in name:
                entries += a.nbytes if a.dtype == mx.uint32 else a.nbytes // 2
    assert report["memory"]["kv_bytes_per_1k_tokens_quantized"] == 1024 * entries // 64
    refused = inspect_model(str(path), 4, 64)
    assert "--kv-group-size" in refused["kv_quantization"]["refused"]
    assert refused["memory"]["kv_bytes_per_1k_tokens_quantized"] is None


@pytest.fixture(scope="module", params=["qwen4_exp", "glm5_next"])
def pooling(request):
    """A stream trunk whose indexer pools its keys (QSA blocks of 2, k-pool pools of 4), with
    every cache quantized but the recurrent states and short windows."""
    return quantized_model(request.param)


def pooled_key_caches(caches) -> list:
    return [c for c in caches if c.kind.endswith("pooled_index_kv")]


@pytest.mark.parametrize("start", range(37, 41))
def test_rollback_that_uncompletes_a_pool_is_exact(pooling, start, monkeypatch):
    """A verify of 4 positions after ``start`` tokens (every phase of the pools), keeping
    1..4: a rejected row may have completed a pool from its quantized keys; the kept caches
    (the indexer's quantized keys included) are bit for bit those of feeding the kept tokens
    one at a time, every later pass's kept pools equal those pooled again from the keys, and
    the next logits are plain decoding's."""
    passes = cc.watch_pooling(monkeypatch)
    seq = [int(x) for x in RNG.integers(0, 128, start + 5)]
    prefix, rows, after = seq[:start], seq[start:start + 4], seq[start + 4]
    for keep in range(1, 5):
        spec, plain = fc.verified_and_plain(pooling, prefix, rows, keep)
        keys = pooled_key_caches(spec)
        assert keys and all(c.quantization == Q4 and c.state[0].dtype == mx.uint32
                            for c in keys)
        quantized = [i for i, c in enumerate(spec) if c.quantization is not None]
        same(cache_state_arrays([spec[i] for i in quantized]),
             cache_state_arrays([plain[i] for i in quantized]))
        nxt = mx.array([[rows[keep] if keep < 4 else after]])
        same([pooling.logits(pooling.trunk(nxt, spec)[0])],
             [pooling.logits(pooling.trunk(nxt, plain)[0])])
    assert passes


def test_pooled_keys_merge_filter_extract_and_roll_back_per_row(pooling, monkeypatch):
    """Three prompts' caches merged into one batch (rows at different pool phases): a
    verify of 3 positions keeping 1, 3, 2 leaves each row's quantized indexer keys as the
    same verify of that row alone does, the next batched step's kept pools equal those pooled
    again from each row's keys, and extract and filter give back each row bit for bit."""
    passes = cc.watch_pooling(monkeypatch)
    prompts, drafts = [PROMPTS[1], PROMPTS[3], PROMPTS[5]], [[7, 8, 9], [40, 41, 42],
                                                              [90, 91, 92]]
    merged = merged_solos(pooling, prompts)[1]
    assert {c.kind for c in pooled_key_caches(merged)} == {"batch_quantized_pooled_index_kv"}
    for c in merged:
        c.prepare(3)
    pooling.trunk(mx.array(drafts, mx.uint32), merged, capture=True)
    for c in merged:
        c.accept([1, 3, 2])
    plain = [cache_solo(pooling, p) for p in prompts]
    for cs, d, n in zip(plain, drafts, (1, 3, 2)):  # a solo verify is plain decoding's (above)
        pooling.trunk(mx.array([d], mx.uint32), cs, capture=True)
        for c in cs:
            c.accept([n])
    keys = [pooled_key_caches(cs) for cs in plain]
    assert all(c.extract(1).quantization == Q4 for c in pooled_key_caches(merged))
    assert_rows_are(pooled_key_caches(merged), keys)
    del passes[:]
    for c in merged:
        c.prepare(1)
    pooling.trunk(mx.array([[3], [4], [5]], mx.uint32), merged)
    assert passes
    for c, t in zip(plain, (3, 4, 5)):
        pooling.trunk(mx.array([[t]], mx.uint32), c)
    assert_filter_keeps_rows(pooled_key_caches(merged), [pooled_key_caches(cs) for cs in plain],
                             rows=(2, 0))


def test_a_loaded_state_pools_again_to_the_same_values(pooling):
    """``state`` holds the quantized keys, not the derived pools: caches rebuilt from
    ``state``/``meta_state`` (a disk session's) are the quantized kinds and decode on with
    bit-equal logits."""
    prompt = [int(x) for x in RNG.integers(0, 128, 30)]
    cache = fc.prefilled_cache(pooling, prompt)
    for t in (5, 6, 7):
        pooling.trunk(mx.array([[t]]), cache)
    loaded = [type(c).from_state(c.state, c.meta_state) for c in cache]
    assert [c.kind for c in pooled_key_caches(loaded)] == [c.kind for c in
                                                           pooled_key_caches(cache)]
    assert all(c.quantization == Q4 for c in pooled_key_caches(loaded))
    for t in (8, 9):
        same([pooling.logits(pooling.trunk(mx.array([[t]]), loaded)[0])],
             [pooling.logits(pooling.trunk(mx.array([[t]]), cache)[0])])


@pytest.mark.parametrize("family", ["qwen4_exp", "glm5_next"])
def test_a_group_that_does_not_divide_the_indexer_keys_is_refused(family):
    """The attention's cached width 64, the indexer's keys 32: group 64 is refused in one
    line, and the model keeps its caches as they were."""
    attention = FAMILIES[family][0][0]
    model = widened(family, **{attention: 64})[1]
    with pytest.raises(ValueError, match="^--kv-group-size 64 does not divide .* 32$"):
        model.use_kv_quantization(KVQuantization(4, 64))
    assert all(c.quantization is None for c in model.make_cache())


def test_mtp_across_the_quantized_kv_start_equals_plain_decoding(pooling):
    """``--quantized-kv-start 24``: the indexer's keys switch with the attention's (the
    pools made before the switch dropped at it); greedy MTP at K = 2 across the switch gives
    plain decoding's tokens and bit-equal log-probabilities."""
    pooling.use_kv_quantization(KVQuantization(4, 32, start=24))
    try:
        assert all(c.quantization.start == 24 for c in pooled_key_caches(pooling.make_cache()))
        ref, ref_lps, _ = solo_logprobs(pooling, 0, PROMPTS[3])
        out, lps, _ = solo_logprobs(pooling, 2, PROMPTS[3])
    finally:
        pooling.use_kv_quantization(Q4)
    assert out == ref and mx.array_equal(lps, ref_lps).item()
