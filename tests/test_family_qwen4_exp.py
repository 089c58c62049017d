"""Qwen4-Exp (``qwen4_exp``): our MLX trunk against transformers 5.24's
``Qwen4ExpForCausalLM`` on a tiny checkpoint it wrote (``fixtures/qwen4_exp/``, recorded by
``fixtures/qwen4_exp/make_reference.py``, which also asserts that no QSA top-k selection of
the recorded run is a near-tie); the MTP head in mlx-vlm 0.7.10's layout; greedy output at
K = 1..3 equal to plain decoding; the rollback of every cache kind it uses; the hashed
n-gram ids exact in int64 at the released sizes."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import cache_checks as cc
import family_checks as fc
from family_checks import raw_tensors
from mlx_mtp import cli
from mlx_mtp.models.blocks.hyper import NGramIds
from mlx_mtp.models.cache.kv import cache_state_arrays, restore_caches, snapshot_caches
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.testing.tiny import TOKENIZER_DIR
from mlx_mtp.testing.tiny_streams import qwen4_exp_oracle as oracle

FIXTURE = Path(__file__).parent / "fixtures" / "qwen4_exp"
REF = json.loads((FIXTURE / "reference.json").read_text())
PROMPT, GREEDY = REF["prompt"], REF["greedy"]


@pytest.fixture(scope="module")
def model():
    return load_model(FIXTURE / "checkpoint")[0]


def test_trunk_equals_transformers(model):
    """One forward over prompt + continuation (the chunked DeltaNet kernel, QSA on every
    row, PLE with an EOS mid-prompt) gives transformers' logits; decoding gives its greedy
    continuation at K = 0..3 (a random head: every step rolls back all but one row)."""
    logits = model.logits(model.trunk(mx.array([PROMPT + GREEDY]))[0])[0]
    np.testing.assert_allclose(np.array(logits), np.array(REF["forward_logits"]), atol=1e-4)
    for k in range(4):
        assert fc.mtp_tokens(model, PROMPT, k, n=len(GREEDY))[0] == GREEDY, f"K={k}"


def test_verify_rows_equal_one_token_decoding(model):
    """A verify pass's rows select their QSA keys and read their PLE windows as one-token
    decoding does."""
    rows = GREEDY[:6]
    want = fc.one_by_one_logits(model, PROMPT, rows)
    got, _ = fc.verify_logits(model, PROMPT, rows)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5)


def test_partial_acceptance_restores_every_cache(model):
    """Verify four tokens, keep two: DeltaNet states, PLE windows (convolution rows and the
    last token ids), KV and indexer keys are those of decoding the two one by one."""
    plain = fc.prefilled_cache(model, PROMPT)
    for t in GREEDY[:2]:
        model.trunk(mx.array([[t]]), plain)
    spec = fc.prefilled_cache(model, PROMPT)
    model.trunk(mx.array([GREEDY[:4]]), spec, capture=True)
    for c in spec:
        c.accept([2])
    assert {type(c).__name__ for c in spec} == {"RecurrentCache", "ShortWindowCache",
                                                "KVCache", "PooledKeyCache"}
    for a, b in zip(cache_state_arrays(spec), cache_state_arrays(plain)):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5)
    nxt = mx.array([[GREEDY[2]]])
    np.testing.assert_allclose(np.array(model.logits(model.trunk(nxt, spec)[0])),
                               np.array(model.logits(model.trunk(nxt, plain)[0])), atol=1e-5)


def test_hash_constants_equal_transformers(model):
    """The multipliers, prime table sizes and offsets we derive are the buffers
    transformers saved with the checkpoint."""
    raw = raw_tensors(FIXTURE / "checkpoint")
    ple = [(i, layer.ple.ple_embedding.ids) for i, layer in enumerate(model.model.layers)
           if "ple" in layer]
    assert [i for i, _ in ple] == [0, 2, 5]
    for i, ids in ple:
        p = f"model.language_model.layers.{i}.ple.ple_embedding."
        assert np.array(ids.multipliers).tolist() == raw[p + "layer_multipliers"].tolist()
        assert np.array(ids.sizes).tolist() == raw[p + "ngram_heads_vocab_sizes"].tolist()
        assert np.array(ids.offsets).tolist() == raw[p + "ngram_heads_offsets"].tolist()


def python_ngram_ids(history, n, per, multipliers, sizes, offsets, eos):
    """transformers' hash in Python integers (no overflow possible), one row."""
    out = []
    for t in range(n - 1, len(history)):
        seg = max([u for u in range(t) if history[u] == eos], default=-1) + 1
        shifted = [history[t - s] if t - s >= seg else eos for s in range(n)]
        row = []
        for g in range(2, n + 1):
            mixed = 0
            for s in range(g):
                mixed ^= shifted[s] * multipliers[s]
            heads = range((g - 2) * per, (g - 1) * per)
            row += [mixed % sizes[h] + offsets[h] for h in heads]
        out.append(row)
    return out


def test_ngram_ids_exact_at_released_sizes():
    """At Qwen4-Exp's sizes (vocab 248320, tables of ~20M rows, the third PLE layer) the
    int64 ids equal exact integer arithmetic: products near 2^63, XOR, EOS resets."""
    eos = 248044
    ids = NGramIds(248320, 3, 8, 20_000_000, 2, 1234, eos)
    assert max(np.array(ids.multipliers).tolist()) * 248319 > 2**62
    rng = np.random.default_rng(0)
    history = [eos, eos] + [int(x) for x in rng.integers(240000, 248320, 30)]
    history[9] = history[20] = history[21] = eos
    got = np.array(ids(mx.array([history]), len(history) - 2))[0].tolist()
    want = python_ngram_ids(history, 3, 8, np.array(ids.multipliers).tolist(),
                            np.array(ids.sizes).tolist(), np.array(ids.offsets).tolist(), eos)
    assert got == want


def test_head_equals_mlx_vlm(model):
    """mlx-vlm 0.7.10's ``Qwen4ExpMTPDraftModel`` on the same head (recorded by
    ``fixtures/qwen4_exp/make_mlx_vlm_reference.py``): the head takes hc·H streams and
    returns streams, one pass over 10 rows (its QSA selecting) and one chained pass on the
    last output; drafts are read through the head's own mixer."""
    ref = np.load(FIXTURE / "mlx_vlm_head.npz")
    streams = model.trunk(mx.array([PROMPT]))[1]
    assert streams.shape[-1] == ref["streams"].shape[-1] == model.args.hc_count * 32
    cache = model.make_mtp_cache()
    out = model.mtp_forward(mx.array(ref["streams"]), mx.array(ref["tokens"]), cache)
    np.testing.assert_allclose(np.array(out), ref["out"], atol=1e-5)
    np.testing.assert_allclose(np.array(model.draft_logits(out)), ref["logits"], atol=1e-5)
    out = model.mtp_forward(out[:, -1:], mx.array(ref["next"]), cache, depth=1)
    np.testing.assert_allclose(np.array(out), ref["out2"], atol=1e-5)
    np.testing.assert_allclose(np.array(model.draft_logits(out)), ref["logits2"], atol=1e-5)


def test_loads_without_its_head():
    model = load_model(FIXTURE / "checkpoint", mtp=False)[0]
    assert model.num_mtp_layers == 0
    assert fc.mtp_tokens(model, PROMPT, 0, n=8)[0] == GREEDY[:8]


@pytest.mark.parametrize("k", [0, 2])
def test_batched_rows_equal_single_rows(model, k):
    """Rows join one per step at different lengths; at K = 2 rejected drafts leave holes in
    the batch's KV and indexer keys, which each row's QSA blocks skip (its own token order)."""
    prompts = [PROMPT[:9], PROMPT[:20], PROMPT[3:7], PROMPT]
    want = [fc.mtp_tokens(model, p, 0, n=12)[0] for p in prompts]
    assert fc.run_batch(model, k, prompts, n=12)[0] == want


def test_complete_blocks_pooled_once(model, monkeypatch):
    """The indexer's cache keeps the pooled blocks each row completed: one-token decoding
    pools at most the block it completes (instead of all of them), and a verify pass whose
    rejected row completed a block un-completes it (the next pass pools it again from the
    kept keys, not the rejected one). Every pass's blocks equal all blocks pooled again."""
    passes = cc.watch_pooling(monkeypatch)
    n_qsa = sum(not layer.is_linear for layer in model.model.layers)
    cache = fc.prefilled_cache(model, PROMPT)  # 40 tokens: 20 blocks of 2, pooled once
    assert passes == [(20, 20)] * n_qsa
    del passes[:]
    for t in GREEDY[:6]:
        model.trunk(mx.array([[t]]), cache)
    # without the cache each pass would pool every block it scores (20, 21, 21, 22, 22, 23)
    assert [n for n, _ in passes[::n_qsa]] == [(41 + i) // 2 for i in range(6)]
    assert sum(p for _, p in passes) == 3 * n_qsa  # blocks 20, 21, 22, once each
    # keep 1 of 4 verified: block 20 (positions 40, 41) was completed by a rejected row
    spec = fc.prefilled_cache(model, PROMPT)
    model.trunk(mx.array([[GREEDY[0], 7, 8, 9]]), spec, capture=True)
    for c in spec:
        c.accept([1])
    plain = fc.prefilled_cache(model, PROMPT + GREEDY[:1])
    del passes[:]
    want = model.logits(model.trunk(mx.array([GREEDY[1:2]]), plain)[0])
    got = model.logits(model.trunk(mx.array([GREEDY[1:2]]), spec)[0])
    assert passes == [(21, 1)] * 2 * n_qsa  # block 20 pooled in both, from the same keys
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5)


def test_batched_rows_reuse_their_complete_blocks(model, monkeypatch):
    """Batched rows (joining one per step, holes from rejected drafts, then two leaving)
    keep each row's complete blocks: every pass's blocks equal all blocks pooled again, the
    tokens are each row's alone, and far fewer blocks are pooled than scored."""
    prompts = [PROMPT[:9], PROMPT[:20], PROMPT[3:7], PROMPT]
    want = [fc.mtp_tokens(model, p, 0, n=12)[0] for p in prompts]
    passes = cc.watch_pooling(monkeypatch)
    rows, bd = fc.run_batch(model, 2, prompts, n=12)
    assert rows == want
    bd.remove(1)
    bd.remove(2)
    for _ in range(3):
        bd.step()
    pooled, scored = sum(p for _, p in passes), sum(n for n, _ in passes)
    assert pooled < scored / 5, (pooled, scored)


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory):
    """The fixture checkpoint plus the package's tiny tokenizer (the CLI verbs want one)."""
    path = tmp_path_factory.mktemp("qwen4_exp") / "ckpt"
    shutil.copytree(FIXTURE / "checkpoint", path)
    for f in TOKENIZER_DIR.iterdir():
        shutil.copy(f, path / f.name)
    return path


def test_inspect_reports_it(with_tokenizer, capsys):
    assert cli.main(["inspect", str(with_tokenizer)]) == 0
    out = capsys.readouterr().out
    assert "qwen4_exp (model_type 'qwen4_exp')" in out
    assert "1 layer(s) declared, 1 present" in out


def test_convert_round_trip(with_tokenizer, tmp_path):
    """``convert`` writes our layout (conv axes moved, norms shifted, experts stacked, the
    n-gram shards joined); it loads back without shifting twice and decodes the same."""
    out = tmp_path / "mlx"
    assert cli.main(["convert", "--hf-path", str(with_tokenizer), "--mlx-path", str(out)]) == 0
    model = load_model(out)[0]
    assert fc.mtp_tokens(model, PROMPT, 2, n=len(GREEDY))[0] == GREEDY


def test_cache_protocol(model):
    """Saved and loaded caches continue exactly; merged rows extract and filter back to the
    solo caches (PLE windows included); a snapshot undoes a verify pass."""
    prompts = [PROMPT[:12], PROMPT[20:23], PROMPT[5:30]]
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


def test_exact_ties_select_alike_in_verify_and_decoding(model):
    """With the indexers' projections zeroed every block scores 0: each top-k is all ties.
    A verify pass (whose rows also see later, masked blocks) and batched rows still select
    what one-token decoding selects."""
    from mlx.utils import tree_flatten, tree_unflatten

    tied = load_model(FIXTURE / "checkpoint")[0]
    zeros = [(k, mx.zeros_like(v)) for k, v in tree_flatten(tied.parameters())
             if k.endswith("indexer.index_qk_proj.weight")]
    tied.update(tree_unflatten(zeros))
    rows = GREEDY[:6]
    want = fc.one_by_one_logits(tied, PROMPT, rows)
    np.testing.assert_allclose(np.array(fc.verify_logits(tied, PROMPT, rows)[0]),
                               np.array(want), atol=1e-5)
    prompts = [PROMPT[:9], PROMPT[:20], PROMPT]
    solo = [fc.mtp_tokens(tied, p, 0, n=10)[0] for p in prompts]
    assert fc.run_batch(tied, 2, prompts, n=10)[0] == solo
    assert fc.mtp_tokens(tied, PROMPT, 3, n=10)[0] == solo[2]


def test_bfloat16_keeps_exactness_where_it_matters():
    """In bf16 the DeltaNet state and A_log stay float32, the PLE token window holds ids,
    and drafting still gives plain decoding's tokens."""
    model = load_model(FIXTURE / "checkpoint", dtype="bfloat16")[0]
    cache = fc.prefilled_cache(model, PROMPT)
    rec, windows = cache[0].arrays(), cache[1].arrays()
    assert rec[1].dtype == mx.float32 and model.model.layers[0].linear_attn.A_log.dtype == mx.float32
    assert windows[0].dtype == mx.bfloat16 and windows[1].tolist()[0] == PROMPT[-2:]
    plain = fc.mtp_tokens(model, PROMPT, 0, n=16)[0]
    assert fc.mtp_tokens(model, PROMPT, 2, n=16)[0] == plain


def test_engine_rows_and_a_restored_turn_equal_plain_decoding(model, with_tokenizer, tmp_path):
    """The server engine with the head (K = 2): concurrent rows prefilled in chunks of 16 (the
    PLE windows and n-gram context carried across chunks), and a prompt prefix saved to disk
    and restored, decode as one sequence does alone."""
    from engine_events import make_engine, run
    from mlx_mtp.models.io.loader import load_config, load_tokenizer
    from mlx_mtp.server.prefix_cache import PrefixCache
    from mlx_mtp.server.session_store import SessionStore, model_fingerprint

    model_tok = (model, load_tokenizer(with_tokenizer, load_config(with_tokenizer)))
    longer = PROMPT + GREEDY[:9]
    prompts = [PROMPT, longer[5:], PROMPT[:3], longer]
    sinks = run(make_engine(model_tok, num_draft_tokens=2, prefill_step_size=16), prompts)
    assert [s.tokens for s in sinks] == [fc.mtp_tokens(model, p, 0, n=12)[0] for p in prompts]
    fp = model_fingerprint(model)
    pc = PrefixCache(8, 1 << 30, disk=SessionStore(tmp_path, fp, min_tokens=16))
    run(make_engine(model_tok, num_draft_tokens=2, prefix_cache=pc, prefill_step_size=16),
        [PROMPT], boundaries=[24, 39])
    pc.disk.flush()
    pc2 = PrefixCache(8, 1 << 30, disk=SessionStore(tmp_path, fp, min_tokens=16))
    warm = run(make_engine(model_tok, num_draft_tokens=2, prefix_cache=pc2,
                           prefill_step_size=16), [longer])[0]
    assert pc2.disk.hits == 1
    assert warm.tokens == fc.mtp_tokens(model, longer, 0, n=12)[0]


def test_released_layer_type_names(tmp_path):
    """The release's config names the indexed layers ``full_attention`` (transformers
    renames them when it writes one): the same model."""
    shutil.copytree(FIXTURE / "checkpoint", tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    text = config["text_config"]
    text["layer_types"] = [t.replace("indexed_", "full_") for t in text["layer_types"]]
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    model = load_model(tmp_path / "ckpt")[0]
    assert fc.mtp_tokens(model, PROMPT, 2, n=12)[0] == GREEDY[:12]


def test_kv_bits_refuse_a_group_wider_than_the_heads_in_one_line(model):
    """Quantized KV under the QSA selection: ``tests/test_quantized_kv_streams.py``."""
    from mlx_mtp.models.cache.quantized import KVQuantization

    with pytest.raises(ValueError, match="^--kv-group-size 64 does not divide the attention "
                                         "head size 16$"):
        model.use_kv_quantization(KVQuantization(bits=8))
    assert model.kv_quantization is None


def test_oracle_head_accepts_everything():
    """Every draft of an oracle head is accepted at K = 1..3 (so each verify keeps all its
    rows: the caches' all-accepted path), and the output is plain decoding's."""
    model = oracle(load_model(FIXTURE / "checkpoint")[0])
    plain = fc.mtp_tokens(model, PROMPT, 0, n=20)[0]
    assert len(set(plain)) > 3  # not one token repeated
    for k in (1, 2, 3):
        got, dec = fc.mtp_tokens(model, PROMPT, k, n=20)
        assert got == plain, f"K={k}"
        assert dec.stats.acceptance_rate == 1.0, f"K={k}"


def test_sampling_follows_the_target():
    """K = 2 at temperature 1 (the oracle head, so drafts are accepted often): the next two
    tokens follow the trunk's exact joint distribution (chi-square). The output layer is
    scaled up so that the joint puts enough mass on few enough pairs to count."""
    model = oracle(load_model(FIXTURE / "checkpoint")[0])
    model.lm_head.weight = model.lm_head.weight * 4
    fc.assert_sampling_follows_target(model, model, PROMPT[:12])


def test_one_token_prompts_join_a_batch(model, with_tokenizer):
    """A one-token prompt runs no pass before it decodes, so its PLE windows hold their
    start values when it joins a batch (they once could not join): through the server
    engine (K = 2) beside two longer prompts, and through the batch decoder first and
    last, at K = 0 and 2, each row decodes as it does alone."""
    from engine_events import make_engine, run
    from mlx_mtp.models.io.loader import load_config, load_tokenizer

    model_tok = (model, load_tokenizer(with_tokenizer, load_config(with_tokenizer)))
    prompts = [PROMPT, PROMPT[:1], PROMPT[7:20]]
    want = [fc.mtp_tokens(model, p, 0, n=12)[0] for p in prompts]
    sinks = run(make_engine(model_tok, num_draft_tokens=2), prompts)
    assert [s.tokens for s in sinks] == want
    for k in (0, 2):
        assert fc.run_batch(model, k, [[GREEDY[3]]] + prompts, n=12)[0] == \
            [fc.mtp_tokens(model, [GREEDY[3]], 0, n=12)[0]] + want
