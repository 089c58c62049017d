"""Families with sliding-window layers (Step-3.5/3.7-Flash, MiMo-V2-Flash): window caches
that roll back after wrapping, each family's MTP layer (Step: zero-centred norms; MiMo-V2:
sink bias, released at model.mtp.layers.*); greedy output equals mlx-lm's plain decoding.
MiMo-V2-Flash's mlx-lm reference runs at the released window (W + 1 keys, not mlx-lm's W:
``family_checks.reference_config``; tests/test_trunk_fidelity.py checks it against
transformers)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import family_checks as fc
from family_checks import HEADS, mlx_lm_model, raw_tensors, rms
from mlx_mtp.decode.speculative import MTPDecoder
from mlx_mtp.models.cache import window as window_cache
from mlx_mtp.models.cache.chain import ChainCache
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.models.cache.window import BatchWindowKVCache, WindowKVCache
from mlx_mtp.testing.tiny_special import WINDOW, make_tiny_mimo_v2_flash, make_tiny_step3p5

RNG = np.random.default_rng(0)
PROMPT = [int(x) for x in RNG.integers(0, 128, 3 * WINDOW)]  # wraps the window
N_TOKENS = 28
PROMPTS = [[int(x) for x in RNG.integers(0, 128, n)] for n in (5, 19, 1, 11)]
BUILDERS = {"step3p5": make_tiny_step3p5, "mimo_v2_flash": make_tiny_mimo_v2_flash}
FAMILIES = list(BUILDERS)
# Where each family's first MTP layer sits in its release (trunk: 3 layers).
MTP_PREFIX = {"step3p5": "model.layers.3.", "mimo_v2_flash": "model.mtp.layers.0."}


@pytest.fixture(autouse=True)
def small_window_buffers(monkeypatch):
    """Buffers grow in steps of 8 and keep 4 positions beyond the window, so the
    tests' short sequences drop old entries many times."""
    monkeypatch.setattr(WindowKVCache, "step", 8)
    monkeypatch.setattr(BatchWindowKVCache, "step", 8)
    monkeypatch.setattr(window_cache, "ROLLBACK_MARGIN", 4)


def attention(cache):
    """A cache's attention part (chained MTP layers wrap theirs in a ChainCache)."""
    return cache.inner if isinstance(cache, ChainCache) else cache


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # mlx_lm_model loads them strictly: its sanitize drops the MTP layer.
    return fc.checkpoints(tmp_path_factory, fc.by_family(BUILDERS))


@pytest.mark.parametrize("family", FAMILIES)
def test_trunk_logits_follow_mlx_lm_past_the_window(ckpt, family):
    path = ckpt(family)
    ours, _ = fc.assert_trunk_follows_mlx_lm(load_model(path)[0], mlx_lm_model(path),
                                             [PROMPT] + [[t] for t in PROMPT[:2 * WINDOW]],
                                             atol=2e-5)
    windows = [c for c in ours if isinstance(c, WindowKVCache)]
    assert windows and all(c.start > 0 for c in windows)  # entries dropped


@pytest.mark.parametrize("family", FAMILIES)
def test_rollback_after_wrap_equals_plain_decoding(ckpt, family):
    """A verify pass of four tokens, three kept, then plain steps: every logit equals
    decoding the kept tokens one by one, although the window wrapped in between."""
    model = load_model(ckpt(family, "noisy"))[0]
    rows, kept = [4, 77, 2, 9], 3
    want = fc.one_by_one_logits(model, PROMPT, rows[:kept] + [5, 6])
    verify, spec = fc.verify_logits(model, PROMPT, rows)
    for c in spec:
        c.accept([kept])
    assert mx.array_equal(verify[:, :kept], want[:, :kept])
    for i, t in enumerate([5, 6]):
        got = model.logits(model.trunk(mx.array([[t]]), spec)[0])
        assert mx.array_equal(got, want[:, kept + i : kept + i + 1])


def test_window_cache_refuses_a_rollback_beyond_its_margin():
    c = WindowKVCache(window=4, margin=2)
    c.update_and_fetch(mx.zeros((1, 1, 9, 2)), mx.zeros((1, 1, 9, 2)))
    with pytest.raises(ValueError, match="margin"):
        c.trim(3)
    assert c.trim(2) == 2 and c.offset == 7


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("agree", list(HEADS))
def test_greedy_identical_to_mlx_lm(ckpt, family, agree):
    path = ckpt(family, HEADS[agree])  # "always" proves the 1+w norms, concat order, chaining
    for dec in fc.assert_greedy_identical(path, PROMPT, agree, n=N_TOKENS):
        assert all(attention(c).start > 0 for c in dec.mtp_cache)  # the MTP layer's window wrapped


def test_step3p5_mtp_layer_equals_reference(ckpt):
    """The MTP layer against one written from the checkpoint's own tensors: zero-centred
    norms applied as 1 + w, [enorm(e) || hnorm(h)], the block, shared_head.norm."""
    path = ckpt("step3p5", "noisy")
    raw, p = raw_tensors(path), MTP_PREFIX["step3p5"]
    model = load_model(path)[0]
    eps = model.args.rms_norm_eps
    hidden, tokens = fc.reference_inputs(model.args.hidden_size)
    x = fc.fused_input(raw["model.embed_tokens.weight"][tokens], hidden,
                       1 + raw[p + "enorm.weight"], 1 + raw[p + "hnorm.weight"],
                       raw[p + "eh_proj.weight"], eps)
    block = model.mtp.layers[0].block
    np.testing.assert_allclose(np.array(block.input_layernorm.weight),
                               1 + raw[p + "transformer.input_layernorm.weight"])
    x = np.array(block(mx.array(x), "causal", None))
    fc.assert_mtp_forward_equals(model, hidden, tokens,
                                 rms(x, 1 + raw[p + "shared_head.norm.weight"], eps))


def test_mimo_v2_flash_mtp_layer_equals_reference(ckpt):
    """MiMo-V2-Flash's layer 0: plain norms, [enorm(e) || hnorm(h)], a windowed block with
    the checkpoint's sink bias and pre_mlp_layernorm, final_layernorm."""
    path = ckpt("mimo_v2_flash", "noisy")
    raw, p = raw_tensors(path), MTP_PREFIX["mimo_v2_flash"]
    model = load_model(path)[0]
    eps = model.args.layernorm_epsilon
    hidden, tokens = fc.reference_inputs(model.args.hidden_size)
    x = fc.fused_input(raw["model.embed_tokens.weight"][tokens], hidden, raw[p + "enorm.weight"],
                       raw[p + "hnorm.weight"], raw[p + "eh_proj.weight"], eps)
    block = model.mtp.layers[0].block
    assert block.is_sliding_window
    np.testing.assert_array_equal(np.array(block.self_attn.attention_sink_bias),
                                  raw[p + "self_attn.attention_sink_bias"])
    np.testing.assert_array_equal(np.array(block.post_attention_layernorm.weight),
                                  raw[p + "pre_mlp_layernorm.weight"])
    x = np.array(block(mx.array(x), "causal", None))
    fc.assert_mtp_forward_equals(model, hidden, tokens,
                                 rms(x, raw[p + "final_layernorm.weight"], eps))


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_rows_equal_mlx_lm(ckpt, family):
    """Rows of different lengths (padding and rejected drafts leave holes) each keep
    their own window."""
    path = ckpt(family, "noisy")
    model = load_model(path)[0]
    for bd in fc.assert_batched_rows_equal_mlx_lm(model, mlx_lm_model(path), PROMPTS, 20):
        windows = [c for c in bd.core.cache if isinstance(c, BatchWindowKVCache)]
        # Old entries dropped as the buffers grew: bounded by window + margin + step + a chunk.
        assert windows and all(c.keys.shape[2] <= WINDOW + 4 + 8 + 8 for c in windows)


@pytest.mark.parametrize("family", ["step3p5"])
def test_sampling_follows_the_target_distribution(ckpt, family):
    path = ckpt(family, "random", vocab_size=8)
    prompt = [int(x) for x in RNG.integers(0, 8, WINDOW + 3)]
    fc.assert_sampling_follows_target(load_model(path)[0], mlx_lm_model(path), prompt)


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_without_its_mtp_layer(ckpt, family):
    path = ckpt(family, drop_mtp=True)
    fc.assert_missing_head_explained(path, MTP_PREFIX[family] + "eh_proj.weight")
    fc.assert_decodes_without_head(path, PROMPT, n=N_TOKENS)


@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_layer_written_back_in_released_form(ckpt, family):
    """Our MTP tensors -> checkpoint names and zero-centred norms: the released tensors."""
    path = ckpt(family, "noisy")
    raw = raw_tensors(path)
    model = load_model(path)[0]
    ours = {k: v for k, v in tree_flatten(model.parameters()) if k.startswith("mtp.")}
    written = model.checkpoint_mtp_names(ours)
    released_block_key = {"step3p5": "transformer.self_attn.q_proj.weight",
                          "mimo_v2_flash": "pre_mlp_layernorm.weight"}[family]
    assert MTP_PREFIX[family] + released_block_key in written
    for k, v in written.items():
        np.testing.assert_allclose(np.array(v), raw[k], atol=1e-6, err_msg=k)


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_state_survives_the_disk_store(ckpt, family):
    """A prefilled state written as the session store writes it and read back keeps its
    windows (only their newest entries are stored): decoding continues exactly."""
    from mlx_mtp.server.session_store import _state_from_tensors, _state_tensors

    model = load_model(ckpt(family, "noisy"))[0]

    def decode(dec, n=12):
        out = []
        while len(out) < n:
            out += dec.step().tokens
        return out[:n]

    dec = MTPDecoder(model, 2, adaptive=False)
    prompt = PROMPT + PROMPT[:WINDOW]  # long enough to drop entries of MiMo's W + 1 window too
    dec.prefill(prompt, snapshot_at=len(prompt) - 2)
    state = dec.snapshot_state
    want = decode(dec)
    windows = [c for c in state.cache + [attention(state.mtp_cache[0])]
               if isinstance(c, WindowKVCache)]
    assert len(windows) == 3 and all(c.start > 0 for c in windows)  # wrapped and dropped
    tensors, layout = _state_tensors(state)
    loaded = _state_from_tensors({k: mx.array(np.array(v)) for k, v in tensors.items()}, layout)
    fresh = MTPDecoder(model, 2, adaptive=False)
    fresh.restore(loaded)
    fresh.prefill(prompt)
    assert decode(fresh) == want
