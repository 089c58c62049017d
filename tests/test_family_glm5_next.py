"""GLM-5.3-Flash (``glm5_next``: KDA + NoPE MLA with a k-pool indexer, mHC streams): the
trunk's logits and greedy decoding equal transformers 5.24's ``Glm5NextForConditionalGeneration``
on a tiny checkpoint it wrote itself, recorded with its outputs by
``fixtures/glm5_next/make_reference.py`` (CI has no torch); a verify pass computes each row
as one-token decoding does, selections at exact indexer ties included; a partial acceptance
rolls KDA back by replay and trims the latent and indexer caches; the head (mlx-vlm's layout)
equals mlx-vlm's drafter and greedy output at K = 0..3 is transformers' greedy."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import cache_checks as cc
import family_checks as fc
from mlx_mtp import cli
from mlx_mtp.models.cache.kv import cache_state_arrays, restore_caches, snapshot_caches
from mlx_mtp.models.cache.quantized import KVQuantization
from mlx_mtp.models.io.layout import CheckpointError
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.testing.tiny import TOKENIZER_DIR
from mlx_mtp.testing.tiny_streams import glm5_next_oracle as oracle

FIXTURE = Path(__file__).parent / "fixtures" / "glm5_next"
CHECKPOINT = FIXTURE / "checkpoint"


@pytest.fixture(scope="module")
def reference():
    return np.load(FIXTURE / "reference.npz")


@pytest.fixture(scope="module")
def model():
    return load_model(CHECKPOINT)[0]


def test_trunk_equals_transformers(model, reference):
    """One forward over prompt + continuation (the indexer selecting: 16 complete pools, 2
    kept) matches transformers' forward; cached one-token decoding through the engine gives
    transformers' greedy continuation, with its per-step logits."""
    prompt, tokens = reference["prompt"].tolist(), reference["tokens"].tolist()
    logits = model.logits(model.trunk(mx.array([prompt + tokens]))[0])[0]
    np.testing.assert_allclose(np.array(logits), reference["forward_logits"], atol=2e-4)
    steps = fc.one_by_one_logits(model, prompt, tokens[:-1])[0]
    np.testing.assert_allclose(np.array(steps), reference["step_logits"][1:], atol=2e-4)
    for k in range(4):
        assert fc.mtp_tokens(model, prompt, k, n=len(tokens))[0] == tokens, f"K={k}"


def test_head_equals_mlx_vlm(model):
    """mlx-vlm 0.7.10's ``Glm5NextMTPDraftModel`` on the same layer 5 (recorded by
    ``fixtures/glm5_next/make_mlx_vlm_reference.py``): one pass over 20 rows from position 0
    (the first row's embedding zeroed, the head's indexer selecting) and one chained pass on
    the last (normed) output."""
    ref = np.load(FIXTURE / "mlx_vlm_head.npz")
    cache = model.make_mtp_cache()
    out = model.mtp_forward(mx.array(ref["hidden"]), mx.array(ref["tokens"]), cache)
    np.testing.assert_allclose(np.array(out), ref["out"], atol=1e-5)
    np.testing.assert_allclose(np.array(model.draft_logits(out)), ref["logits"], atol=1e-5)
    out = model.mtp_forward(out[:, -1:], mx.array(ref["next"]), cache, depth=1)
    np.testing.assert_allclose(np.array(out), ref["out2"], atol=1e-5)
    np.testing.assert_allclose(np.array(model.draft_logits(out)), ref["logits2"], atol=1e-5)


def test_loads_without_its_head(tmp_path, reference):
    """``mtp=False`` decodes the trunk alone; a checkpoint whose head is missing says so."""
    model = load_model(CHECKPOINT, mtp=False)[0]
    assert model.num_mtp_layers == 0
    prompt, tokens = reference["prompt"].tolist(), reference["tokens"].tolist()
    assert fc.mtp_tokens(model, prompt, 0, n=8)[0] == tokens[:8]
    path = tmp_path / "headless"
    shutil.copytree(CHECKPOINT, path)
    weights = load_file(path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if ".layers.5." not in k},
              path / "model.safetensors", metadata={"format": "pt"})
    fc.assert_missing_head_explained(path)


def test_layers_are_the_released_kinds(model):
    kinds = [(layer.is_linear, layer.shared, "indexer" in layer.self_attn)
             for layer in model.model.layers]
    assert kinds == [(True, False, False), (False, False, True), (False, True, False),
                     (True, False, False), (False, False, True)]
    assert model.model.layers[0].self_attn.A_log.dtype == mx.float32


@pytest.mark.parametrize("offset", [0, 3, 4])
def test_verify_rows_equal_one_token_decoding(model, reference, offset):
    """Five rows in one pass (some completing a pool, so later rows see pools earlier rows
    must not) equal five one-token steps."""
    prompt = reference["prompt"].tolist()[: 30 + offset]
    rows = [5, 77, 140, 9, 201]
    got, _ = fc.verify_logits(model, prompt, rows)
    want = fc.one_by_one_logits(model, prompt, rows)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4)


def test_partial_acceptance_rolls_back_exactly(model, reference):
    """Verify four tokens, keep two: every cache (KDA by replay; latents and indexer keys
    trimmed) is that of decoding the two one by one, and so are the logits that follow."""
    prompt = reference["prompt"].tolist()
    plain = fc.prefilled_cache(model, prompt)
    for t in (4, 77):
        model.trunk(mx.array([[t]]), plain)
    want = model.logits(model.trunk(mx.array([[5]]), plain)[0])
    _, spec = fc.verify_logits(model, prompt, [4, 77, 2, 9])
    for c in spec:
        c.accept([2])
    before = fc.prefilled_cache(model, prompt)
    for t in (4, 77):
        model.trunk(mx.array([[t]]), before)
    for a, b in zip(cache_state_arrays(spec), cache_state_arrays(before)):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5)
    got = model.logits(model.trunk(mx.array([[5]]), spec)[0])
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5)


def test_exact_ties_select_as_one_token_decoding(tmp_path, reference):
    """With the indexer's head weights zero every pool scores exactly 0: the selection then
    rests on tie-breaking alone (the earlier pools win), and a verify pass (which sees pools a
    one-token step does not) must still choose what one-token decoding chooses."""
    path = tmp_path / "ties"
    shutil.copytree(CHECKPOINT, path)
    weights = load_file(path / "model.safetensors")
    for k in weights:
        if k.endswith("indexer.weights_proj.weight"):
            weights[k] = np.zeros_like(weights[k])
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    tied = load_model(path, mtp=False)[0]
    indexer = tied.model.layers[1].self_attn.indexer
    x = mx.array(np.random.default_rng(1).standard_normal((1, 31, 32)), mx.float32)
    q_resid = mx.array(np.random.default_rng(2).standard_normal((1, 31, 24)), mx.float32)
    rows = np.array(indexer(x, q_resid))[0, 0]
    # Ties go to the earlier pools: the first two (of 7 complete) plus the tail 28..30.
    assert np.flatnonzero(rows[30]).tolist() == list(range(8)) + [28, 29, 30]
    assert np.flatnonzero(rows[11]).tolist() == list(range(8))  # 3 pools: 2 kept, no tail
    prompt = reference["prompt"].tolist()[:31]
    rows = [5, 77, 140, 9, 201, 3]
    got, _ = fc.verify_logits(tied, prompt, rows)
    want = fc.one_by_one_logits(tied, prompt, rows)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4)


def test_shared_layer_after_a_kda_layer_is_refused(tmp_path):
    """transformers passes a selection only from an indexed layer to the next layer."""
    path = tmp_path / "bad"
    shutil.copytree(CHECKPOINT, path)
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["layer_types"][1] = "linear_attention"  # layer 2 is "shared"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="layer 2 reuses the indexer selection"):
        load_model(path, mtp=False)


@pytest.mark.parametrize("k", [0, 2])
def test_batched_rows_equal_single_rows(model, reference, k):
    """Rows join one per step at different lengths (some past a pool boundary, the indexer
    selecting); at K = 2 rejected drafts leave holes in the batch's latent and indexer caches,
    which each row's pools skip (its own token order)."""
    prompt = reference["prompt"].tolist()
    prompts = [prompt[:9], prompt[:30], prompt[3:7], prompt]
    want = [fc.mtp_tokens(model, p, 0, n=12)[0] for p in prompts]
    assert fc.run_batch(model, k, prompts, n=12)[0] == want


def test_complete_pools_pooled_once(model, reference, monkeypatch):
    """The indexer's cache keeps the pools each row completed (``PooledKeyCache``, as
    Qwen4-Exp's): one-token decoding pools at most the pool it completes, where it re-pooled
    every complete pool (10 or 11 here) on every pass; a verify pass whose rejected rows
    completed a pool un-completes it, and the next pass pools it again from the kept keys.
    Every pass's pools equal all pools pooled again, bit for bit."""
    passes = cc.watch_pooling(monkeypatch)
    n_indexed = sum("indexer" in layer.self_attn for layer in model.model.layers)
    prompt = reference["prompt"].tolist()  # 40 tokens: 10 pools of 4, pooled once
    cache = fc.prefilled_cache(model, prompt)
    assert passes == [(10, 10)] * n_indexed
    del passes[:]
    for t in reference["tokens"].tolist()[:6]:
        model.trunk(mx.array([[t]]), cache)
    assert [n for n, _ in passes[::n_indexed]] == [10, 10, 10, 11, 11, 11]  # re-pooled before
    assert sum(p for _, p in passes) == n_indexed  # pool 10, once
    # keep 1 of 4 verified at 38..41: pool 9 (36..39) was completed by a rejected row
    spec = fc.prefilled_cache(model, prompt[:38])
    model.trunk(mx.array([[prompt[38], 7, 8, 9]]), spec, capture=True)
    for c in spec:
        c.accept([1])
    plain = fc.prefilled_cache(model, prompt[:39])
    del passes[:]
    want = model.logits(model.trunk(mx.array([prompt[39:40]]), plain)[0])
    got = model.logits(model.trunk(mx.array([prompt[39:40]]), spec)[0])
    assert passes == [(10, 1)] * 2 * n_indexed  # pool 9 pooled in both, from the same keys
    np.testing.assert_array_equal(np.array(got), np.array(want))


def test_batched_rows_reuse_their_complete_pools(model, reference, monkeypatch):
    """Batched rows (joining one per step, holes from rejected drafts, then two leaving)
    keep each row's complete pools: every pass's pools equal all pools pooled again, the
    tokens are each row's alone, and far fewer pools are pooled than scored."""
    prompt = reference["prompt"].tolist()
    prompts = [prompt[:9], prompt[:30], prompt[3:7], prompt]
    want = [fc.mtp_tokens(model, p, 0, n=12)[0] for p in prompts]
    passes = cc.watch_pooling(monkeypatch)
    rows, bd = fc.run_batch(model, 2, prompts, n=12)
    assert rows == want
    bd.remove(1)
    bd.remove(2)
    for _ in range(3):
        bd.step()
    pooled, scored = sum(p for _, p in passes), sum(n for n, _ in passes)
    assert pooled < scored / 4, (pooled, scored)


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory):
    """The fixture checkpoint plus the package's tiny tokenizer (the CLI verbs want one)."""
    path = tmp_path_factory.mktemp("glm5_next") / "ckpt"
    shutil.copytree(CHECKPOINT, path)
    for f in TOKENIZER_DIR.iterdir():
        shutil.copy(f, path / f.name)
    return path


def test_inspect_reports_it(with_tokenizer, capsys):
    """The head at ``model.language_model.layers.5`` is found."""
    assert cli.main(["inspect", str(with_tokenizer)]) == 0
    out = capsys.readouterr().out
    assert "glm5_next (model_type 'glm5_next')" in out
    assert "1 layer(s) declared, 1 present" in out
    assert "under model.language_model.layers.5." in out


def test_convert_round_trip(with_tokenizer, tmp_path, reference):
    """``convert`` writes our layout (conv axes moved, experts stacked, mHC names, the head
    under ``mtp.layers.0``); it loads back and decodes transformers' greedy at K = 2."""
    out = tmp_path / "mlx"
    assert cli.main(["convert", "--hf-path", str(with_tokenizer), "--mlx-path", str(out)]) == 0
    model = load_model(out)[0]
    prompt, tokens = reference["prompt"].tolist(), reference["tokens"].tolist()
    assert fc.mtp_tokens(model, prompt, 2, n=len(tokens))[0] == tokens


def test_kv_bits_refuse_a_group_wider_than_the_latents_in_one_line(model):
    """Quantized latents: ``tests/test_quantized_kv_streams.py``."""
    with pytest.raises(ValueError, match="^--kv-group-size 64 does not divide the attention "
                                         "head size 16$"):
        model.use_kv_quantization(KVQuantization(bits=8))
    assert model.kv_quantization is None


def test_cache_protocol(model, reference):
    """Saved and loaded caches continue exactly; merged rows extract and filter back to the
    solo caches (KDA states, latents, indexer keys); a snapshot undoes a verify pass."""
    prompt = reference["prompt"].tolist()
    prompts = [prompt[:12], prompt[20:23], prompt[5:30]]
    cache = cc.solo(model, prompts[0])
    loaded = [type(c).from_state(c.state if c.arrays() else None, c.meta_state) for c in cache]
    cc.same(cache_state_arrays(loaded), cache_state_arrays(cache))
    cc.same([cc.next_logits(model, loaded, [[42]])], [cc.next_logits(model, cache, [[42]])])
    solos, merged = cc.merged_solos(model, prompts)
    cc.assert_rows_are(merged, solos)
    cc.assert_filter_keeps_rows(merged, solos)
    before = cache_state_arrays(cache)
    snap = snapshot_caches(cache)
    model.trunk(mx.array([[7, 8, 9, 10]], mx.uint32), cache, capture=True)
    mx.eval(cache_state_arrays(cache))
    restore_caches(snap)
    cc.same(cache_state_arrays(cache), before)


def test_engine_rows_and_a_restored_turn_equal_plain_decoding(model, with_tokenizer, reference,
                                                              tmp_path):
    """The server engine with the head (K = 2): concurrent rows prefilled in chunks of 16
    (pools and KDA states carried across chunks), and a prompt prefix saved to disk and
    restored, decode as one sequence does alone."""
    from engine_events import make_engine, run
    from mlx_mtp.models.io.loader import load_config, load_tokenizer
    from mlx_mtp.server.prefix_cache import PrefixCache
    from mlx_mtp.server.session_store import SessionStore, model_fingerprint

    prompt, tokens = reference["prompt"].tolist(), reference["tokens"].tolist()
    model_tok = (model, load_tokenizer(with_tokenizer, load_config(with_tokenizer)))
    longer = prompt + tokens[:9]
    prompts = [prompt, longer[5:], prompt[:3], longer]
    sinks = run(make_engine(model_tok, num_draft_tokens=2, prefill_step_size=16), prompts)
    assert [s.tokens for s in sinks] == [fc.mtp_tokens(model, p, 0, n=12)[0] for p in prompts]
    fp = model_fingerprint(model)
    pc = PrefixCache(8, 1 << 30, disk=SessionStore(tmp_path, fp, min_tokens=16))
    run(make_engine(model_tok, num_draft_tokens=2, prefix_cache=pc, prefill_step_size=16),
        [prompt], boundaries=[24, 39])
    pc.disk.flush()
    pc2 = PrefixCache(8, 1 << 30, disk=SessionStore(tmp_path, fp, min_tokens=16))
    warm = run(make_engine(model_tok, num_draft_tokens=2, prefix_cache=pc2,
                           prefill_step_size=16), [longer])[0]
    assert pc2.disk.hits == 1
    assert warm.tokens == fc.mtp_tokens(model, longer, 0, n=12)[0]


def test_bfloat16_keeps_float32_where_transformers_does(reference):
    """Router, its bias, KDA's decay and mHC's biases/scales stay float32, the KDA state too;
    greedy output with the head equals the bfloat16 model's own plain decoding."""
    model = load_model(CHECKPOINT, dtype="bfloat16")[0]
    layer = model.model.layers[1]
    assert layer.mlp.gate.weight.dtype == mx.float32
    assert layer.attn_hc.base.dtype == mx.float32 and layer.attn_hc.fn.dtype == mx.bfloat16
    assert model.model.layers[0].self_attn.A_log.dtype == mx.float32
    prompt = reference["prompt"].tolist()
    cache = fc.prefilled_cache(model, prompt)
    assert cache[0].state[1].dtype == mx.float32
    plain = fc.mtp_tokens(model, prompt, 0, n=16)[0]
    assert fc.mtp_tokens(model, prompt, 2, n=16)[0] == plain


def test_oracle_head_accepts_everything(reference):
    """Every draft of an oracle head is accepted at K = 1..3 (each verify keeps all its rows:
    the caches' all-accepted path), and the output is plain decoding's."""
    fc.assert_oracle_accepts_everything(oracle(load_model(CHECKPOINT)[0]),
                                        reference["prompt"].tolist())


def test_sampling_follows_the_target(reference):
    """K = 2 at temperature 1 (the oracle head, so drafts are accepted often): the next two
    tokens follow the trunk's exact joint distribution (chi-square). The output layer is
    scaled up so that the joint puts enough mass on few enough pairs to count."""
    model = oracle(load_model(CHECKPOINT)[0])
    model.lm_head.weight = model.lm_head.weight * 4
    fc.assert_sampling_follows_target(model, model, reference["prompt"].tolist()[:12])
