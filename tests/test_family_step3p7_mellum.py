"""Step-3.7-Flash (``step3p7``: Step-3.5's text model in a vision-language wrapper, three
chained MTP layers) and Mellum2 (``mellum``: one MoE MTP layer on sliding attention).

Against transformers 5.24.0: ``fixtures/mtp_next/<family>/`` holds a tiny checkpoint built
with transformers' own classes and written in the released layout, with transformers' greedy
continuation (plain and ``generate(use_mtp=True)``) and its MTP path's chained drafts after the
prompt (``fixtures/mtp_next/make_reference.py`` records them; CI has no torch). Our plain
greedy equals transformers', our drafts and their logits equal its MTP drafts, and our greedy
output at K = 1..3 equals plain decoding; add-mtp onto mlx-vlm's conversion of the Step-3.7
fixture (mlx-community's layout, ``fixtures/mtp_next/step3p7_mlx_vlm``) restores those drafts.
On our own tiny builds (``testing/tiny_next``): an oracle head accepts 100 % at every depth,
batch rows equal single rows, sampling follows the target distribution (chi-square), context
drafts beside the head, disk sessions and the server engine decode as plain decoding does,
convert / add-mtp / inspect keep the head under its released names.
"""

import json
import logging
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import family_checks as fc
from family_checks import raw_tensors
from mlx_mtp.models.blocks.attention_trunk import mtp_key_predicate
from mlx_mtp.models.cache import window as window_cache
from mlx_mtp.models.cache.window import BatchWindowKVCache, WindowKVCache
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.testing.tiny_next import make_tiny_mellum, make_tiny_step3p7

FIXTURES = Path(__file__).parent / "fixtures" / "mtp_next"
FAMILIES = ("step3p7", "mellum")
BUILDERS = {"step3p7": make_tiny_step3p7, "mellum": make_tiny_mellum}
RNG = np.random.default_rng(11)
PROMPT = [int(x) for x in RNG.integers(0, 128, 20)]  # wraps the window of 8
PROMPTS = [[int(x) for x in RNG.integers(0, 128, n)] for n in (5, 17, 1, 11)]
MARGIN = window_cache.ROLLBACK_MARGIN  # what a full-length context draft needs
# Where the first MTP layer's fused projection sits in each release (trunk: 3 layers).
EH_PROJ = {"step3p7": "model.layers.3.eh_proj.weight", "mellum": "mtp.fc.weight"}


@pytest.fixture(autouse=True)
def small_window_buffers(monkeypatch):
    """Window buffers grow in steps of 8 and keep 4 positions beyond the window, so short
    sequences drop old entries many times."""
    monkeypatch.setattr(WindowKVCache, "step", 8)
    monkeypatch.setattr(BatchWindowKVCache, "step", 8)
    monkeypatch.setattr(window_cache, "ROLLBACK_MARGIN", 4)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return fc.checkpoints(tmp_path_factory, fc.by_family(BUILDERS))


def reference(family: str) -> dict:
    return json.loads((FIXTURES / family / "reference.json").read_text())


def chained_drafts(model, prompt):
    """The head's greedy drafts after ``prompt`` (and their logits), asked as transformers'
    MTP path asks: the trunk's hidden over the prompt paired with the prompt shifted by one
    plus the trunk's next token, then each depth on the previous depth's output."""
    hidden, head_hidden = model.trunk(mx.array([prompt]), model.make_cache())
    token = int(mx.argmax(model.logits(hidden[:, -1:]), axis=-1).item())
    mtp = model.make_mtp_cache()
    out = model.mtp_forward(head_hidden, mx.array([prompt[1:] + [token]]), mtp)[:, -1:]
    drafts, logits = [], []
    for depth in range(model.num_mtp_layers):
        if depth:
            out = model.mtp_forward(out, mx.array([drafts[-1:]]), mtp, depth=depth)[:, -1:]
        logits.append(np.array(model.logits(out)[0, 0]))
        drafts.append(int(np.argmax(logits[-1])))
    return drafts, np.stack(logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_at_every_k(family):
    ref = reference(family)
    assert ref["mtp_greedy"] == ref["greedy"]  # transformers' own MTP path is lossless
    model = load_model(FIXTURES / family)[0]
    for k in (0, 1, 2, 3):
        assert fc.mtp_tokens(model, ref["prompt"], k, n=len(ref["greedy"]))[0] == ref["greedy"], k


@pytest.mark.parametrize("family", FAMILIES)
def test_drafts_equal_transformers_mtp_path(family):
    """Step-3.7: three layers, one per depth; Mellum: one."""
    ref = reference(family)
    model = load_model(FIXTURES / family)[0]
    assert model.num_mtp_layers == len(ref["drafts"]) == {"step3p7": 3, "mellum": 1}[family]
    drafts, logits = chained_drafts(model, ref["prompt"])
    assert drafts == ref["drafts"]
    np.testing.assert_allclose(logits, np.array(ref["draft_logits"]), atol=1e-4)


def test_step3p7_sliding_heads_and_vision_dropped(caplog):
    """The MTP layers are sliding layers with attention_other_setting's head count (as the
    weights' shapes say); the vision tower and projector are dropped without a warning."""
    raw = raw_tensors(FIXTURES / "step3p7")
    assert any(k.startswith("vision_model.") for k in raw) and "vit_large_projector.weight" in raw
    with caplog.at_level(logging.WARNING):
        model = load_model(FIXTURES / "step3p7")[0]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [k for k, _ in tree_flatten(model.parameters()) if "vision" in k]
    heads = model.args.attention_other_setting["num_attention_heads"]
    for i, layer in enumerate(model.mtp.layers):
        assert layer.block.is_sliding and layer.block.self_attn.num_heads == heads
        q = raw[f"model.layers.{model.args.num_hidden_layers + i}.self_attn.q_proj.weight"]
        assert q.shape[0] == heads * model.args.head_dim
    assert heads != model.args.num_attention_heads


@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_layers_written_back_in_released_form(family):
    """Our MTP tensors -> every released MTP tensor but the output layer's copies, under its
    name and in its form (Step-3.7: flat, zero-centred norms; Mellum: ``mtp.*``, experts
    compared stacked)."""
    raw = raw_tensors(FIXTURES / family)
    is_head = mtp_key_predicate(json.loads((FIXTURES / family / "config.json").read_text()))
    model = load_model(FIXTURES / family)[0]
    written = model.checkpoint_mtp_names(
        {k: v for k, v in tree_flatten(model.parameters()) if k.startswith("mtp.")})
    names = set()
    for k, v in written.items():
        if ".switch_mlp." in k:
            prefix, proj = k.split(".switch_mlp.")
            experts = [f"{prefix}.experts.{e}.{proj}" for e in range(v.shape[0])]
            want, names = np.stack([raw[e] for e in experts]), names | set(experts)
        else:
            want, names = raw[k], names | {k}
        np.testing.assert_allclose(np.array(v), want, atol=1e-6, err_msg=k)
    assert names == {k for k in raw if is_head(k) and "shared_head.output" not in k}


@pytest.mark.parametrize("family", FAMILIES)
def test_oracle_head_accepts_every_depth(ckpt, family):
    """Step-3.7 with its layer 2 broken fails at depth 3 alone: depth j drafts with layer j."""
    cases = [((), [1.0, 1.0, 1.0])] + ([((2,), [1.0, 1.0, 0.0])] if family == "step3p7" else [])
    for broken, want in cases:
        model = load_model(ckpt(family, "oracle", **({"broken": broken} if broken else {})))[0]
        plain = fc.mtp_tokens(model, PROMPT, 0)[0]
        got, dec = fc.mtp_tokens(model, PROMPT, 3)
        assert got == plain and dec.stats.acceptance_per_pos == want, broken


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_rows_equal_single_rows(ckpt, family):
    """Rows joining at different positions (holes from padding and rejected drafts) each
    keep their own windows and chain; every row equals its own single-row greedy."""
    model = load_model(ckpt(family, "noisy"))[0]
    want = [fc.mtp_tokens(model, p, 0, n=16)[0] for p in PROMPTS]
    for k in (0, 3):
        rows, _ = fc.run_batch(model, k, PROMPTS, 16)
        assert rows == want, f"K={k}"


def test_mellum_greedy_and_batch_equal_mlx_lm(ckpt):
    path = ckpt("mellum", "noisy")
    fc.assert_greedy_identical(path, PROMPT, "sometimes", strict=False)
    fc.assert_batched_rows_equal_mlx_lm(load_model(path)[0], fc.mlx_lm_model(path, False), PROMPTS)


@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_follows_the_target_distribution(ckpt, family):
    """Mellum's target is mlx-lm's; Step-3.7's (no mlx-lm module) our plain forward."""
    path = ckpt(family, "random", vocab_size=8)
    model = load_model(path)[0]
    target = fc.mlx_lm_model(path, False) if family == "mellum" else model
    fc.assert_sampling_follows_target(model, target, [int(x) for x in RNG.integers(0, 8, 11)])


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_without_its_mtp_layers(ckpt, family):
    path = ckpt(family, drop_mtp=True)
    fc.assert_missing_head_explained(path, EH_PROJ[family])
    plain = fc.mtp_tokens(load_model(ckpt(family))[0], PROMPT, 0)[0]
    assert fc.mtp_tokens(load_model(path, mtp=False)[0], PROMPT, 0)[0] == plain


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_keeps_the_released_names(ckpt, tmp_path, family):
    """Same drafts and acceptance after convert, the head under its released names in
    mtp.safetensors (Mellum's result also loads in plain mlx-lm with the same logits)."""
    from mlx_mtp.convert.main import convert

    src, out = ckpt(family, "noisy"), tmp_path / "out"
    if family == "mellum":
        fc.assert_convert_round_trip(src, out, PROMPT, n=16, atol=1e-5)
    else:
        convert(src, out, verbose=False)
        assert (fc.decode_and_accepted(load_model(out)[0], PROMPT, 2, 16)
                == fc.decode_and_accepted(load_model(src)[0], PROMPT, 2, 16))
    mtp, raw = raw_tensors(out, "mtp.safetensors"), raw_tensors(src)
    assert EH_PROJ[family] in mtp
    if family == "step3p7":
        assert {k.split(".")[2] for k in mtp} == {"3", "4", "5"}
        assert not [k for k in mtp if ".transformer." in k]
    else:
        assert all(k.startswith("mtp.") for k in mtp)
    for k in [k for k in mtp if k.endswith("norm.weight")]:  # Step-3.7: zero-centred, as released
        np.testing.assert_allclose(mtp[k], raw[k], atol=1e-6)


def test_mellum_add_mtp_onto_an_mlx_lm_conversion(ckpt, tmp_path):
    """mlx-lm converts a release without the head (its strict load refuses mtp.*); add-mtp
    grafts the original's head: greedy equals mlx-lm's, drafts as the original's."""
    from mlx_mtp.convert.add_mtp import add_mtp

    src, dst = ckpt("mellum", "noisy"), tmp_path / "mlx-community"
    fc.mlx_lm_convert(ckpt("mellum", "noisy", drop_mtp=True), dst, quantize=False)
    with pytest.raises(fc.MissingMTPWeightsError, match="add-mtp"):
        load_model(dst)
    add_mtp(dst, src, verbose=False)
    toks, accepted = fc.decode_and_accepted(load_model(dst)[0], PROMPT, 2, 16)
    assert toks == fc.mlx_lm_greedy(fc.mlx_lm_model(dst), PROMPT, 16) and accepted > 0
    assert (toks, accepted) == fc.decode_and_accepted(load_model(src)[0], PROMPT, 2, 16)


@pytest.mark.parametrize("family", FAMILIES)
def test_inspect_finds_the_head_under_its_released_prefix(ckpt, family):
    from mlx_mtp.tools.inspect_model import inspect_model

    path = ckpt(family, "noisy")
    r = inspect_model(str(path))
    n = {"step3p7": 3, "mellum": 1}[family]
    assert (r["family"], r["supported"], r["head_stripped"]) == (family, True, False)
    assert r["mtp"]["declared_layers"] == r["mtp"]["present_layers"] == n
    assert r["mtp"]["key_prefix"] == {"step3p7": "model.layers.", "mellum": "mtp."}[family]
    assert r["vision_tensors"] == (3 if family == "step3p7" else 0)
    stripped = inspect_model(str(ckpt(family, drop_mtp=True)))
    assert stripped["head_stripped"] and stripped["mtp"]["present_layers"] == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_state_survives_the_disk_store(ckpt, family):
    """A prefilled state (windows wrapped; Step-3.7: a chain of three layer caches) written as
    the session store writes it and read back: decoding continues exactly."""
    from mlx_mtp.decode.speculative import MTPDecoder
    from mlx_mtp.server.session_store import _state_from_tensors, _state_tensors

    model = load_model(ckpt(family, "noisy"))[0]

    def decode(dec, n=12):
        out = []
        while len(out) < n:
            out += dec.step().tokens
        return out[:n]

    dec = MTPDecoder(model, 3, adaptive=False)
    dec.prefill(PROMPT, snapshot_at=len(PROMPT) - 2)
    state, want = dec.snapshot_state, decode(dec)
    tensors, saved = _state_tensors(state)
    loaded = _state_from_tensors({k: mx.array(np.array(v)) for k, v in tensors.items()}, saved)
    fresh = MTPDecoder(model, 3, adaptive=False)
    fresh.restore(loaded)
    fresh.prefill(PROMPT)
    assert decode(fresh) == want == fc.mtp_tokens(model, PROMPT, 0, n=12)[0]


def test_step3p7_add_mtp_onto_an_mlx_vlm_conversion(tmp_path):
    """mlx-community's Step-3.7 repos are mlx-vlm conversions (``language_model.model.*``, the
    vision tower kept, the MTP layers dropped; ``fixtures/mtp_next/step3p7_mlx_vlm``, recorded
    by ``make_mlx_vlm_conversion.py``). It decodes plainly as transformers does; loading it
    with its head names the missing layers and add-mtp; grafted from the original, every K
    gives transformers' greedy output and transformers' drafts."""
    import shutil

    from mlx_mtp.convert.add_mtp import add_mtp

    ref, dst = reference("step3p7"), tmp_path / "mlx-community"
    shutil.copytree(FIXTURES / "step3p7_mlx_vlm", dst)
    plain = load_model(dst, mtp=False)[0]
    assert fc.mtp_tokens(plain, ref["prompt"], 0, n=len(ref["greedy"]))[0] == ref["greedy"]
    with pytest.raises(fc.MissingMTPWeightsError, match="add-mtp"):
        load_model(dst)
    add_mtp(dst, FIXTURES / "step3p7", verbose=False)
    model = load_model(dst)[0]
    assert chained_drafts(model, ref["prompt"])[0] == ref["drafts"]
    for k in (1, 3):
        assert fc.mtp_tokens(model, ref["prompt"], k, n=len(ref["greedy"]))[0] == ref["greedy"]


@pytest.mark.parametrize("family", FAMILIES)
def test_server_engine_batches_and_restores_a_turn_from_disk(family, tmp_path):
    """Concurrent requests in the server's engine equal each prompt's plain decoding; a
    prompt's state saved to disk (windows wrapped) and restored decodes a longer turn as a
    cold start and as plain decoding do."""
    from engine_events import make_engine, run
    from mlx_mtp.models.io.loader import load
    from mlx_mtp.server.prefix_cache import PrefixCache
    from mlx_mtp.server.session_store import SessionStore, model_fingerprint

    # The test tokenizer has 4096 ids: the embedding table must cover them.
    model_tok = load(str(BUILDERS[family](tmp_path / "ckpt", "noisy", vocab_size=4096)))
    prompt = [int(x) for x in RNG.integers(0, 128, 40)]  # five windows of 8
    longer = prompt + [int(x) for x in RNG.integers(0, 128, 9)]

    def engine(k=3, prefix_cache=None):
        return make_engine(model_tok, num_draft_tokens=k, adaptive=False,
                           prefix_cache=prefix_cache, prefill_step_size=16)

    prompts = [prompt, longer[5:], prompt[:3], longer[20:]]
    plain = [fc.mtp_tokens(model_tok[0], p, 0, n=12)[0] for p in prompts]
    assert [s.tokens for s in run(engine(), prompts)] == plain
    fp = model_fingerprint(model_tok[0])
    pc = PrefixCache(8, 1 << 30, disk=SessionStore(tmp_path / "s", fp, min_tokens=16))
    run(engine(prefix_cache=pc), [prompt], boundaries=[24, 39])
    pc.disk.flush()
    windows = [c for c in pc.entries[tuple(prompt)].state.cache if isinstance(c, WindowKVCache)]
    assert windows and all(c.start > 0 for c in windows)
    pc2 = PrefixCache(8, 1 << 30, disk=SessionStore(tmp_path / "s", fp, min_tokens=16))
    warm = run(engine(prefix_cache=pc2), [longer])[0]
    assert warm.done.usage["prompt_tokens_details"]["cached_tokens"] == 39 and pc2.disk.hits == 1
    cold, plain = run(engine(), [longer])[0], run(engine(k=0), [longer])[0]
    assert warm.tokens == cold.tokens == plain.tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_context_drafts_beside_the_head(ckpt, family, monkeypatch):
    """Drafts copied from the context (up to 32 a step, some rejected) before the head's:
    the window caches and every MTP layer's cache roll back, output equals plain decoding."""
    monkeypatch.setattr(window_cache, "ROLLBACK_MARGIN", MARGIN)
    from mlx_mtp.decode.draft_source import DraftSources
    from mlx_mtp.decode.speculative import MTPDecoder, generate_step
    from mlx_mtp.drafters.lookup import LookupSettings

    cycle = list(range(40, 90))
    prompt = cycle + [7, 8] + cycle[:6]  # the oracle trunk copies on past the cycle's end
    model = load_model(ckpt(family, "oracle"))[0]
    want = fc.mtp_tokens(model, prompt, 0, n=60)[0]
    for source, k in (("lookup", 0), ("both", 3)):
        sources = DraftSources(source, LookupSettings(max_draft=32), adaptive=False)
        dec = MTPDecoder(model, k, adaptive=False, drafter=sources.drafter())
        got = [t for t, _, _ in generate_step(prompt, model, decoder=dec, max_tokens=60)]
        assert got == want, source
        assert 0 < dec.stats.lookup_accepted_tokens < dec.stats.lookup_draft_tokens
