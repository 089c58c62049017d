"""Families with sliding-window layers (Step-3.5/3.7-Flash, MiMo-V2-Flash): window caches
that roll back after wrapping, each family's MTP layer (Step: zero-centred norms; MiMo-V2:
sink bias, released at model.mtp.layers.*); greedy output equals mlx-lm's plain decoding."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step as mlx_lm_generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model as mlx_lm_load_model

from distribution_check import assert_follows, sample_outcomes, two_token_joint
from mlx_mtp.decode.batch import BatchDecoder
from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.models import window_cache
from mlx_mtp.models.layout import MissingMTPWeightsError
from mlx_mtp.models.loader import load_model
from mlx_mtp.models.window_cache import BatchWindowKVCache, WindowKVCache
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


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    made = {}

    def make(family, head="random", **kw):
        key = (family, head, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = BUILDERS[family](tmp_path_factory.mktemp(f"{family}_{head}"), head, **kw)
        return made[key]

    return make


def mlx_lm_model(path):
    return mlx_lm_load_model(Path(path))[0]  # strict: its sanitize drops the MTP layer


def mlx_lm_greedy(model, prompt, n=N_TOKENS):
    return [int(t) for t, _ in mlx_lm_generate_step(mx.array(prompt), model, max_tokens=n)]


def mtp_tokens(model, prompt, k, sampling=SamplingParams(), n=N_TOKENS):
    dec = MTPDecoder(model, k, sampling, adaptive=False)
    return [t for t, _, _ in generate_step(prompt, model, decoder=dec, max_tokens=n)], dec


@pytest.mark.parametrize("family", FAMILIES)
def test_trunk_logits_follow_mlx_lm_past_the_window(ckpt, family):
    path = ckpt(family)
    model, ref = load_model(path)[0], mlx_lm_model(path)
    ours, theirs = model.make_cache(), make_prompt_cache(ref)
    assert any(isinstance(c, WindowKVCache) for c in ours)
    for chunk in [PROMPT] + [[t] for t in PROMPT[:2 * WINDOW]]:
        a = model.logits(model.trunk(mx.array([chunk]), ours)[0])
        b = ref(mx.array([chunk]), cache=theirs)
        np.testing.assert_allclose(np.array(a), np.array(b), atol=2e-5)
    assert all(c.start > 0 for c in ours if isinstance(c, WindowKVCache))  # entries dropped


@pytest.mark.parametrize("family", FAMILIES)
def test_rollback_after_wrap_equals_plain_decoding(ckpt, family):
    """A verify pass of four tokens, three kept, then plain steps: every logit equals
    decoding the kept tokens one by one, although the window wrapped in between."""
    model = load_model(ckpt(family, "noisy"))[0]
    rows, kept = [4, 77, 2, 9], 3
    plain = model.make_cache()
    model.trunk(mx.array([PROMPT]), plain)
    want = [model.logits(model.trunk(mx.array([[t]]), plain)[0]) for t in rows[:kept] + [5, 6]]
    spec = model.make_cache()
    model.trunk(mx.array([PROMPT]), spec)
    verify = model.logits(model.trunk(mx.array([rows]), spec, capture=True)[0])
    for c in spec:
        c.accept([kept])
    assert mx.array_equal(verify[:, :kept], mx.concatenate(want[:kept], axis=1))
    for t, w in zip([5, 6], want[kept:]):
        assert mx.array_equal(model.logits(model.trunk(mx.array([[t]]), spec)[0]), w)


def test_window_cache_refuses_a_rollback_beyond_its_margin():
    c = WindowKVCache(window=4, margin=2)
    c.update_and_fetch(mx.zeros((1, 1, 9, 2)), mx.zeros((1, 1, 9, 2)))
    with pytest.raises(ValueError, match="margin"):
        c.trim(3)
    assert c.trim(2) == 2 and c.offset == 7


HEADS = {"always": "oracle", "sometimes": "noisy", "never": "random"}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("agree", list(HEADS))
def test_greedy_identical_to_mlx_lm(ckpt, family, agree):
    path = ckpt(family, HEADS[agree])
    model = load_model(path)[0]
    ref = mlx_lm_greedy(mlx_lm_model(path), PROMPT)
    assert mtp_tokens(model, PROMPT, 0)[0] == ref
    for k in (1, 2, 3):
        got, dec = mtp_tokens(model, PROMPT, k)
        assert got == ref, f"K={k}"
        rate = dec.stats.acceptance_rate
        if agree == "always":  # proves the 1+w norms, concat order and chaining
            assert rate == 1.0
        elif agree == "never":
            assert rate < 0.2
        else:
            assert 0.0 < rate < 1.0
        assert all(c.start > 0 for c in dec.mtp_cache)  # the MTP layer's window wrapped


def _rms(x, w, eps):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * w


def raw_tensors(path):
    from safetensors.numpy import load_file

    raw = {}
    for f in Path(path).glob("*.safetensors"):
        raw.update(load_file(f))
    return raw


def test_step3p5_mtp_layer_equals_reference(ckpt):
    """The MTP layer against one written from the checkpoint's own tensors: zero-centred
    norms applied as 1 + w, [enorm(e) || hnorm(h)], the block, shared_head.norm."""
    path = ckpt("step3p5", "noisy")
    raw, p = raw_tensors(path), MTP_PREFIX["step3p5"]
    model = load_model(path)[0]
    H, eps = model.args.hidden_size, model.args.rms_norm_eps
    hidden = np.random.default_rng(3).standard_normal((1, 3, H)).astype(np.float32)
    tokens = np.array([[5, 60, 11]])
    e = _rms(raw["model.embed_tokens.weight"][tokens], 1 + raw[p + "enorm.weight"], eps)
    h = _rms(hidden, 1 + raw[p + "hnorm.weight"], eps)
    x = np.concatenate([e, h], axis=-1) @ raw[p + "eh_proj.weight"].T
    block = model.mtp.layers[0].block
    np.testing.assert_allclose(np.array(block.input_layernorm.weight),
                               1 + raw[p + "transformer.input_layernorm.weight"])
    x = np.array(block(mx.array(x), "causal", None))
    want = _rms(x, 1 + raw[p + "shared_head.norm.weight"], eps)
    got = model.mtp_forward(mx.array(hidden), mx.array(tokens), None)
    np.testing.assert_allclose(np.array(got), want, atol=2e-5)


def test_mimo_v2_flash_mtp_layer_equals_reference(ckpt):
    """MiMo-V2-Flash's layer 0: plain norms, [enorm(e) || hnorm(h)], a windowed block with
    the checkpoint's sink bias and pre_mlp_layernorm, final_layernorm."""
    path = ckpt("mimo_v2_flash", "noisy")
    raw, p = raw_tensors(path), MTP_PREFIX["mimo_v2_flash"]
    model = load_model(path)[0]
    H, eps = model.args.hidden_size, model.args.layernorm_epsilon
    hidden = np.random.default_rng(3).standard_normal((1, 3, H)).astype(np.float32)
    tokens = np.array([[5, 60, 11]])
    e = _rms(raw["model.embed_tokens.weight"][tokens], raw[p + "enorm.weight"], eps)
    h = _rms(hidden, raw[p + "hnorm.weight"], eps)
    x = np.concatenate([e, h], axis=-1) @ raw[p + "eh_proj.weight"].T
    block = model.mtp.layers[0].block
    assert block.is_sliding_window
    np.testing.assert_array_equal(np.array(block.self_attn.attention_sink_bias),
                                  raw[p + "self_attn.attention_sink_bias"])
    np.testing.assert_array_equal(np.array(block.post_attention_layernorm.weight),
                                  raw[p + "pre_mlp_layernorm.weight"])
    x = np.array(block(mx.array(x), "causal", None))
    want = _rms(x, raw[p + "final_layernorm.weight"], eps)
    got = model.mtp_forward(mx.array(hidden), mx.array(tokens), None)
    np.testing.assert_allclose(np.array(got), want, atol=2e-5)


def run_batch(model, k, prompts, n=20):
    bd = BatchDecoder(model, k, adaptive=False)
    outs = {}
    for i, p in enumerate(prompts):  # staggered joins: rows at different positions
        dec = MTPDecoder(model, k, adaptive=False)
        dec.prefill(p)
        bd.add(i, dec)
        outs[i] = []
        for key, o in bd.step().items():
            outs[key] += o.tokens
    while min(len(t) for t in outs.values()) < n:
        for key, o in bd.step().items():
            outs[key] += o.tokens
    windows = [c for c in bd.core.cache if isinstance(c, BatchWindowKVCache)]
    # Old entries dropped as the buffers grew: bounded by window + margin + step + a chunk.
    assert windows and all(c.keys.shape[2] <= WINDOW + 4 + 8 + 8 for c in windows)
    return [outs[i][:n] for i in range(len(prompts))]


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_rows_equal_mlx_lm(ckpt, family):
    """Rows of different lengths (padding and rejected drafts leave holes) each keep
    their own window."""
    path = ckpt(family, "noisy")
    model, ref = load_model(path)[0], mlx_lm_model(path)
    want = [mlx_lm_greedy(ref, p, 20) for p in PROMPTS]
    for k in (0, 2):
        assert run_batch(model, k, PROMPTS) == want, f"K={k}"


@pytest.mark.parametrize("family", ["step3p5"])
def test_sampling_follows_the_target_distribution(ckpt, family):
    path = ckpt(family, "random", vocab_size=8)
    model, ref = load_model(path)[0], mlx_lm_model(path)
    prompt = [int(x) for x in RNG.integers(0, 8, WINDOW + 3)]

    def target(prefix):
        logits = ref(mx.array([prompt + prefix]))[0, -1].astype(mx.float32)
        return np.exp(np.array(logits - mx.logsumexp(logits), np.float64))

    def draw(seed):
        return mtp_tokens(model, prompt, 2, SamplingParams(temperature=1.0, seed=seed), n=2)

    n_samples = 400
    seen, accepted = sample_outcomes(draw, n_samples)
    assert accepted > n_samples // 10
    assert_follows(seen, two_token_joint(target), n_samples)


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_without_its_mtp_layer(ckpt, family):
    path = ckpt(family, drop_mtp=True)
    with pytest.raises(MissingMTPWeightsError) as e:
        load_model(path)
    assert MTP_PREFIX[family] + "eh_proj.weight" in str(e.value) and "add-mtp" in str(e.value)
    model = load_model(path, mtp=False)[0]
    assert mtp_tokens(model, PROMPT, 0)[0] == mlx_lm_greedy(mlx_lm_model(path), PROMPT)


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
    dec.prefill(PROMPT, snapshot_at=len(PROMPT) - 2)
    state = dec.snapshot_state
    want = decode(dec)
    windows = [c for c in state.cache + state.mtp_cache[:1] if isinstance(c, WindowKVCache)]
    assert len(windows) == 3 and all(c.start > 0 for c in windows)  # wrapped and dropped
    tensors, layout = _state_tensors(state)
    loaded = _state_from_tensors({k: mx.array(np.array(v)) for k, v in tensors.items()}, layout)
    fresh = MTPDecoder(model, 2, adaptive=False)
    fresh.restore(loaded)
    fresh.prefill(PROMPT)
    assert decode(fresh) == want
