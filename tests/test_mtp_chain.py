"""Releases with one MTP layer per depth (MiMo-V2-Flash, Step-3.5-Flash: three), chained
by models/mtp_chain.py: each layer's cache is caught up on committed positions, depth j
drafts with layer j; checked against every layer run over the whole sequence at once, and
end to end against mlx-lm."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_causal_mask

import family_checks as fc
from mlx_mtp.decode.batch import BatchDecoder
from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.models.blocks.mtp_chain import drafted_entries
from mlx_mtp.testing.tiny_special import WINDOW, make_tiny_mimo_v2_flash, make_tiny_step3p5

RNG = np.random.default_rng(5)
PROMPT = [int(x) for x in RNG.integers(0, 128, 2 * WINDOW + 3)]


BUILDERS = {"mimo_v2_flash": make_tiny_mimo_v2_flash,
            "step3p5": lambda path, head, **kw: make_tiny_step3p5(path, head, mtp_layers=3, **kw)}
FAMILIES = list(BUILDERS)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return fc.checkpoints(tmp_path_factory, fc.by_family(BUILDERS))


def reference_chain(model, hidden, tokens, drafts):
    """Every MTP layer over all positions 0..q at once (windowed causal masks, no cache):
    layer j at p takes layer j-1's output at p and the token j+1 places ahead, where the
    tokens past the committed ones are the drafts. Returns each layer's output at q."""
    seq = mx.concatenate([tokens, drafts], axis=1)  # t_1 .. t_{q+1}, d_1 .. d_k
    L = hidden.shape[1]
    mask = create_causal_mask(L, window_size=model.window)
    x, last = hidden, []
    for j, layer in enumerate(model.mtp.layers[: drafts.shape[1] + 1]):
        e = layer.enorm(model.model.embed_tokens(seq[:, j : j + L]))
        x = layer.norm(layer.block(layer.eh_proj(mx.concatenate([e, layer.hnorm(x)], -1)),
                                   mask, None))
        last.append(x[:, -1:])
    return last


@pytest.mark.parametrize("family", FAMILIES)
def test_drafts_equal_the_layers_run_over_the_whole_sequence(ckpt, family):
    """Two head passes over committed pairs (the second after the first one's drafts were
    rolled back), then depths 1 and 2: each output equals the whole-sequence reference."""
    model = load_model(ckpt(family, "random"))[0]
    cache, mtp = model.make_cache(), model.make_mtp_cache()
    tokens = mx.array([PROMPT])
    hidden = model.trunk(tokens[:, :-1], cache)[0]  # h_0 .. h_{q}, pairs with t_1 .. t_{q+1}
    cut = 11
    d = mx.array([[7, 3]])
    model.mtp_forward(hidden[:, :cut], tokens[:, 1 : cut + 1], mtp)
    model.mtp_forward(hidden[:, cut - 1 : cut], d[:, :1], mtp, depth=1)  # drafts, rolled back
    for c, n in zip(mtp, drafted_entries(3, 2)):
        c.trim(n)
    out0 = model.mtp_forward(hidden[:, cut:], tokens[:, cut + 1 :], mtp)[:, -1:]
    out1 = model.mtp_forward(out0, d[:, :1], mtp, depth=1)
    out2 = model.mtp_forward(out1, d[:, 1:], mtp, depth=2)
    assert out1.shape[1] == 1 and out2.shape[1] == 2  # depth j: positions q-j+1 .. q
    want = reference_chain(model, hidden, tokens[:, 1:], d)
    for got, ref in zip((out0, out1[:, -1:], out2[:, -1:]), want):
        np.testing.assert_allclose(np.array(got), np.array(ref), atol=2e-5)
    assert [c.offset for c in mtp] == [len(PROMPT) - 1, len(PROMPT) - 1, len(PROMPT) - 1]


def mlx_lm_greedy(path, prompt, n):
    return fc.mlx_lm_greedy(fc.mlx_lm_model(path), prompt, n)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_depth_drafts_with_its_own_layer(ckpt, family):
    """Oracle layers: 100 % at every depth; with layer 2 broken only depth 3 fails, so
    depth 3 reads layer 2 (and depth 4 reuses it). Output equals mlx-lm's throughout."""
    for broken, want in (((), [1.0] * 4), ((2,), [1.0, 1.0, 0.0, 0.0])):
        path = ckpt(family, "oracle", broken=broken)
        model = load_model(path)[0]
        assert model.num_mtp_layers == 3
        got, dec = fc.mtp_tokens(model, PROMPT, 4, n=24)
        assert got == mlx_lm_greedy(path, PROMPT, 24)
        assert dec.stats.acceptance_per_pos == want, broken


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("head", ["noisy", "random"])
def test_greedy_identical_to_mlx_lm_at_every_k(ckpt, family, head):
    fc.assert_greedy_identical(ckpt(family, head), PROMPT, ks=(1, 2, 3, 4), n=24)


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_rows_equal_mlx_lm(ckpt, family):
    """Rows joining at different positions: each row's chain catches up on its own."""
    path = ckpt(family, "noisy")
    model = load_model(path)[0]
    prompts = [[int(x) for x in RNG.integers(0, 128, n)] for n in (6, 17, 1, 10)]
    [bd] = fc.assert_batched_rows_equal_mlx_lm(model, fc.mlx_lm_model(path), prompts, ks=(3,))
    assert bd.core.mtp_cache[2].pending is not None


@pytest.mark.parametrize("family", FAMILIES)
def test_context_drafts_beside_the_chained_layers_equal_mlx_lm(ckpt, family):
    """Drafts copied from the context (up to 32 a step, some rejected) before the chained
    layers' drafts: the window caches and every layer's cache roll back, output equals
    mlx-lm's."""
    from mlx_mtp.decode.draft_source import DraftSources
    from mlx_mtp.drafters.lookup import LookupSettings

    cycle = list(range(40, 90))
    prompt = cycle + [7, 8] + cycle[:6]  # the oracle trunk copies on past the cycle's end
    path = ckpt(family, "oracle", trunk_scale=0.1)
    ref = mlx_lm_greedy(path, prompt, 60)
    model = load_model(path)[0]
    for source, k in (("lookup", 0), ("both", 3)):
        sources = DraftSources(source, LookupSettings(max_draft=32), adaptive=False)
        dec = MTPDecoder(model, k, adaptive=False, drafter=sources.drafter())
        got = [t for t, _, _ in generate_step(prompt, model, decoder=dec, max_tokens=60)]
        assert got == ref, source
        assert 0 < dec.stats.lookup_accepted_tokens < dec.stats.lookup_draft_tokens


def head_pass(model, prompt):
    """A sequence's chained MTP caches after the head's pass over its prompt pairs."""
    tokens = mx.array([prompt])
    mtp = model.make_mtp_cache()
    model.mtp_forward(model.trunk(tokens[:, :-1], model.make_cache())[0], tokens[:, 1:], mtp)
    return mtp


def chained_drafts(model, mtp):
    """Depth-1 and depth-2 draft outputs from (copies of) one row's caches: they read
    layers 1 and 2's pending inputs."""
    caches = [c.copy() for c in mtp]
    hidden = mx.full((1, 1, model.args.hidden_size), 0.5)
    out1 = model.mtp_forward(hidden, mx.array([[7]]), caches, depth=1)
    out2 = model.mtp_forward(out1, mx.array([[3]]), caches, depth=2)
    return [out1, out2]


@pytest.mark.parametrize("family", FAMILIES)
def test_pending_inputs_travel_through_snapshot_batch_and_disk(ckpt, family):
    """A chained row's pending inputs come back from a snapshot, a batch join and a filter
    (its row extracted) and a save: its drafts are bit-equal to the untouched row's."""
    from mlx_mtp.models.cache.kv import CACHE_KINDS, restore_caches, snapshot_caches

    model = load_model(ckpt(family, "random"))[0]
    mtp = head_pass(model, PROMPT)
    want = chained_drafts(model, mtp)
    assert all(c.pending is not None for c in mtp[1:])
    zeroed = [c.copy() for c in mtp]
    for c in zeroed[1:]:
        c.pending = mx.zeros_like(c.pending)
    assert not mx.array_equal(chained_drafts(model, zeroed)[0], want[0])  # pending is read

    snap = snapshot_caches(mtp)
    model.mtp_forward(mx.ones((1, 3, model.args.hidden_size)), mx.array([[1, 2, 3]]), mtp)
    restore_caches(snap)
    checks = {"snapshot": mtp}
    others = [head_pass(model, PROMPT[:5]), head_pass(model, PROMPT[:2])]  # the last: no pending
    merged = [type(cs[0]).merge(list(cs)) for cs in zip(others[0], mtp, others[1])]
    checks["merge"] = [c.extract(1) for c in merged]
    for c in merged:
        c.filter([2, 1])
    checks["filter"] = [c.extract(1) for c in merged]
    checks["save"] = [CACHE_KINDS[c.kind].from_state(c.state, c.meta_state) for c in mtp]
    for name, caches in checks.items():
        for got, ref in zip(chained_drafts(model, caches), want):
            assert mx.array_equal(got, ref).item(), name


@pytest.mark.parametrize("family", FAMILIES)
def test_a_row_through_snapshot_and_batch_surgery_decodes_as_plain(ckpt, family):
    """A prefix state restored from its snapshot, a row joined by others that then leave:
    greedy tokens equal plain decoding's, and the restored row drafts as the untouched one."""
    model = load_model(ckpt(family, "noisy"))[0]
    plain = fc.mtp_tokens(model, PROMPT, 0, n=16)[0]

    def decode(dec, n=16):
        out = []
        while len(out) < n:
            out += dec.step().tokens
        return out[:n]

    untouched = MTPDecoder(model, 3, adaptive=False)
    untouched.prefill(PROMPT, snapshot_at=len(PROMPT) - 4)
    restored = MTPDecoder(model, 3, adaptive=False)
    restored.restore(untouched.snapshot_state)
    restored.prefill(PROMPT)
    for got, ref in zip(chained_drafts(model, restored.mtp_cache),
                        chained_drafts(model, untouched.mtp_cache)):
        assert mx.array_equal(got, ref).item()
    assert decode(untouched) == decode(restored) == plain
    assert restored.stats.acceptance_per_pos == untouched.stats.acceptance_per_pos

    bd = BatchDecoder(model, 3, adaptive=False)
    outs = {}
    for key, prompt in (("row", PROMPT), ("a", PROMPT[:9]), ("b", PROMPT[3:])):
        dec = MTPDecoder(model, 3, adaptive=False)
        dec.prefill(prompt)
        bd.add(key, dec)
        for k, o in bd.step().items():
            outs.setdefault(k, []).extend(o.tokens)
    for key in ("a", "b"):
        bd.remove(key)
        for k, o in bd.step().items():
            outs[k] += o.tokens
    while len(outs["row"]) < 16:
        outs["row"] += bd.step()["row"].tokens
    assert outs["row"][:16] == plain
