"""A resting block drafter costs a step nothing (issue 36, "No harm"): a decode step keeps
its taps by reference (``models/cache/taps.DeferredTaps``) and the drafter's next pass
projects them in one chunk (``block_context.settle``).

Counted, never timed, on the tiny Qwen3.5 hybrid whose head is partly right ("noisy": its
verifies keep some drafts and reject others) with a random DFlash and a random EAGLE-3
drafter: a plain step and a head-only step build exactly the graph of the same model without
a drafter (bar the context's state slices the counting adds); the deferred taps follow
their rows through a verify's ``accept``, the cap on deferred positions, a batch's merge and
filter and a saved state, and the context they settle into equals a fresh prefill's over
every emitted token (the reference the context tests use); greedy output stays plain
decoding's."""

import mlx.core as mx
import pytest

from mlx_mtp.bench.graph import count_nodes
from mlx_mtp.bench.inprocess import measure_graphs
from mlx_mtp.decode import block_context
from mlx_mtp.decode.batch import BatchDecoder
from mlx_mtp.decode.speculative import MTPDecoder
from mlx_mtp.drafters.block.load import attach_block_drafter
from mlx_mtp.models.cache.kv import cache_state_arrays
from mlx_mtp.models.cache.taps import DeferredTaps
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.testing.tiny import make_tiny
from mlx_mtp.testing.tiny_block import make_tiny_block, make_tiny_dflash

PROMPT = [5, 60, 11, 7, 9, 3, 41, 17]
PROMPTS = [[3, 9, 27], [100, 4, 8, 15, 16, 23, 42], [7], [50, 51, 52, 53, 54]]


@pytest.fixture(scope="module")
def trunk(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("rest") / "trunk", "qwen3_5", "noisy")


@pytest.fixture(scope="module")
def models(trunk, tmp_path_factory):
    out = {"none": load_model(trunk)[0]}
    for kind in ("dflash", "eagle3"):
        model = load_model(trunk)[0]
        args = model.text.args
        H, V, L = args.hidden_size, args.vocab_size, args.num_hidden_layers
        tmp = tmp_path_factory.mktemp(kind)
        path = (make_tiny_dflash(tmp, H, V, [0, 2], L, block_size=5) if kind == "dflash" else
                make_tiny_block(tmp, "eagle3", H, V, [0, 2, 3], L, block_size=5,
                                draft_vocab_size=V // 2))
        attach_block_drafter(model, str(path))
        out[kind] = model
    return out


def _decode(model, prompt, n: int, k: int = 3):
    """At least ``n`` tokens drafted by the head alone at K = ``k`` (no drafter pass: every
    step defers its taps): every token emitted and the decoder."""
    dec = MTPDecoder(model, k, adaptive=False)
    dec.prefill(prompt)
    tokens = []
    while len(tokens) < n:
        tokens += dec.step().tokens
    return tokens, dec


def _fresh_context(model, seq):
    fresh = block_context.make_cache(model)
    block_context.trunk(model, mx.array([seq]), fresh)
    mx.eval(cache_state_arrays(fresh))
    return block_context.context(model, fresh)


def _assert_context_of(model, cache, row: int, seq):
    """Row ``row``'s context in ``cache`` (settled) equals a fresh prefill's over ``seq``:
    entries and, for EAGLE-3, the pending tap."""
    ours, want = block_context.context(model, cache), _fresh_context(model, seq)
    for a, b in zip(ours, want):
        assert a.lengths()[row] == b.lengths()[0]
        for x, y in zip(a.row_state(row), b.row_state(0)):
            assert mx.allclose(x, y, atol=1e-4).item()
    if model.block_drafter.spec.autoregressive:
        H = model.text.args.hidden_size
        pending = ours[0].pending_rows(ours[0].size(), H, mx.float32)[row:row + 1]
        assert mx.allclose(pending, want[0].pending_rows(1, H, mx.float32), atol=1e-4).item()


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_a_step_without_a_drafter_pass_builds_the_graph_of_a_model_without_one(models, kind):
    """Graph nodes of a plain step and of head-only steps (K = 1, 3): with the drafter
    resting, the nodes of the same step on the model without a drafter, plus only the
    slices the counting takes of the context's state (the step itself builds none: before
    deferral, each step projected its taps into every drafter layer's K/V)."""
    model = models[kind]
    want = measure_graphs(models["none"], PROMPT, [1, 3])
    got = measure_graphs(model, PROMPT, [1, 3])
    slices = count_nodes(cache_state_arrays(_fresh_context(model, PROMPT[:-1])))
    assert slices <= 4 * model.block_drafter.num_caches
    assert got["plain"]["nodes"] == want["plain"]["nodes"] + slices
    for k in (1, 3):
        assert got[k]["draft"]["nodes"] == want[k]["draft"]["nodes"]
        assert got[k]["verify"]["nodes"] == want[k]["verify"]["nodes"] + slices


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
@pytest.mark.parametrize("cap", [256, 6])
def test_taps_deferred_through_verifies_settle_into_a_fresh_prefills_context(
        models, kind, cap, monkeypatch):
    """Head-only steps at K = 3 (some drafts kept, some rejected): each verify's taps wait
    with the accepted rows kept (at most ``cap`` positions: past it the next pass projects
    them); settled, the context equals a fresh prefill's. Greedy output is plain decoding's."""
    monkeypatch.setattr(block_context, "MAX_DEFERRED", cap)
    model = models[kind]
    plain, _ = _decode(model, PROMPT, 24, k=0)
    got, dec = _decode(model, PROMPT, 24)
    assert got[:24] == plain[:24]
    assert 0 < dec.stats.num_accepted_tokens < dec.stats.num_draft_tokens  # verifies were cut
    deferred = dec.cache[-1]
    assert 0 < deferred.columns() <= cap
    if cap == 256:  # every verify's taps wait: rejected rows are held, not kept
        assert sum(deferred.lengths()) < deferred.columns()
    projected = block_context.context(model, dec.cache)[-1].lengths()[0]
    prompt_only = _fresh_context(model, PROMPT[:-1])[-1].lengths()[0]
    assert (projected > prompt_only) == (cap < 256)  # a small cap projected on the way
    block_context.settle(model, dec.cache)
    assert deferred.lengths() == [0]
    _assert_context_of(model, dec.cache, 0, PROMPT + got[:-1])


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_deferred_taps_follow_their_rows_through_a_batch_and_a_saved_state(models, kind):
    """Rows decode alone (taps deferred), join one batch (merged: each row's own count),
    decode together, one leaves (filtered); each remaining row, extracted and saved and
    loaded, settles into the context of a fresh prefill over its tokens."""
    model = models[kind]
    decs, tokens = [], []
    for i, p in enumerate(PROMPTS):
        got, dec = _decode(model, p, 1 + i)
        decs.append(dec)
        tokens.append(got)
    bd = BatchDecoder(model, True, adaptive=False)
    for i, d in enumerate(decs):
        bd.add(i, d)
    assert bd.cache[-1].lengths() == [len(t) for t in tokens]  # every row run since prefill
    for step in range(6):
        if step == 3:
            bd.remove(1)
        for key, out in bd.step(ks=[3] * len(bd)).items():
            tokens[key] += out.tokens
    for row, key in enumerate([0, 2, 3]):
        cache = [c.extract(row) for c in bd.cache]
        saved = cache[-1]
        assert saved.lengths()[0] > 0
        cache[-1] = DeferredTaps.from_state(saved.state, saved.meta_state)
        block_context.settle(model, cache)
        _assert_context_of(model, cache, 0, PROMPTS[key] + tokens[key][:-1])


def test_a_state_whose_deferred_tokens_leave_the_vocabulary_is_refused(models):
    """A saved state whose deferred taps name a token past the vocabulary (EAGLE-3 would
    embed it, reading out of bounds) is refused in one line; the state as saved restores."""
    model = models["eagle3"]
    _, dec = _decode(model, PROMPT, 4)
    state = dec.snapshot()
    saved = state.cache[-1]
    taps, tokens = saved.state
    forged = mx.full(tokens.shape, model.text.args.vocab_size, tokens.dtype)
    state.cache[-1] = DeferredTaps.from_state((taps, forged), saved.meta_state)
    with pytest.raises(ValueError, match="deferred drafter taps"):
        MTPDecoder(model, 3, adaptive=False).restore(state)
    state.cache[-1] = saved
    MTPDecoder(model, 3, adaptive=False).restore(state)
