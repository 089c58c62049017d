"""Nemotron-H (Mamba-2 + attention hybrid): Mamba-2 conv/SSM state rolled back by replaying
the kept prefix from the pre-verify state; greedy output equals mlx-lm's plain decoding."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step as mlx_lm_generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model as mlx_lm_load_model

from mlx_mtp.convert.main import convert
from mlx_mtp.decode.batch import BatchDecoder
from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.models.cache import RecurrentCache, cache_state_arrays
from mlx_mtp.models.layout import MissingMTPWeightsError
from mlx_mtp.models.loader import load_model
from mlx_mtp.testing.tiny_special import make_tiny_nemotron_h

RNG = np.random.default_rng(0)
PROMPT = [int(x) for x in RNG.integers(0, 128, 14)]
N_TOKENS = 24
PROMPTS = [[int(x) for x in RNG.integers(0, 128, n)] for n in (5, 12, 2, 9)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    made = {}

    def make(head="random", **kw):
        key = (head, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = make_tiny_nemotron_h(tmp_path_factory.mktemp(f"nemotron_{head}"), head,
                                             **kw)
        return made[key]

    return make


def mlx_lm_model(path):
    return mlx_lm_load_model(Path(path))[0]  # strict: its sanitize drops mtp.*


def mlx_lm_greedy(model, prompt, n=N_TOKENS):
    return [int(t) for t, _ in mlx_lm_generate_step(mx.array(prompt), model, max_tokens=n)]


def mtp_tokens(model, prompt, k, sampling=SamplingParams(), n=N_TOKENS):
    dec = MTPDecoder(model, k, sampling, adaptive=False)
    return [t for t, _, _ in generate_step(prompt, model, decoder=dec, max_tokens=n)], dec


def test_trunk_logits_follow_mlx_lm(ckpt):
    path = ckpt()
    model, ref = load_model(path)[0], mlx_lm_model(path)
    ours, theirs = model.make_cache(), make_prompt_cache(ref)
    for chunk in ([PROMPT], [[4]], [[77]], [[2, 9, 11]]):
        a = model.logits(model.trunk(mx.array(chunk), ours)[0])
        b = ref(mx.array(chunk), cache=theirs)
        np.testing.assert_allclose(np.array(a), np.array(b), atol=2e-5)


def test_replay_after_partial_acceptance_equals_plain_decoding(ckpt):
    """Verify four tokens, keep two: the Mamba-2 conv and SSM states (and the KV caches)
    are those of decoding the two one by one, and so are the logits that follow."""
    model = load_model(ckpt("noisy"))[0]
    plain = model.make_cache()
    model.trunk(mx.array([PROMPT]), plain)
    for t in (4, 77):
        model.trunk(mx.array([[t]]), plain)
    plain_state = [np.array(a) for a in cache_state_arrays(plain)]
    want = model.logits(model.trunk(mx.array([[5]]), plain)[0])
    spec = model.make_cache()
    model.trunk(mx.array([PROMPT]), spec)
    model.trunk(mx.array([[4, 77, 2, 9]]), spec, capture=True)
    for c in spec:
        c.accept([2])
    assert sum(isinstance(c, RecurrentCache) for c in spec) == 3
    replayed = [np.array(a) for a in cache_state_arrays(spec)]
    assert [a.shape for a in replayed] == [a.shape for a in plain_state]
    for a, b in zip(replayed, plain_state):  # one replayed call vs two steps: rounding only
        np.testing.assert_allclose(a, b, atol=1e-5)
    got = model.logits(model.trunk(mx.array([[5]]), spec)[0])
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5)
    assert int(got.argmax()) == int(want.argmax())


HEADS = {"always": "oracle", "sometimes": "noisy", "never": "random"}


@pytest.mark.parametrize("agree", list(HEADS))
def test_greedy_identical_to_mlx_lm(ckpt, agree):
    path = ckpt(HEADS[agree])
    model = load_model(path)[0]
    ref = mlx_lm_greedy(mlx_lm_model(path), PROMPT)
    assert mtp_tokens(model, PROMPT, 0)[0] == ref
    for k in (1, 2, 3):
        got, dec = mtp_tokens(model, PROMPT, k)
        assert got == ref, f"K={k}"
        rate = dec.stats.acceptance_rate
        if agree == "always":
            assert rate == 1.0
        elif agree == "never":
            assert rate < 0.2
        else:  # partial acceptance: the SSM replay runs on kept prefixes shorter than K+1
            assert 0.0 < rate < 1.0


def _rms(x, w, eps):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * w


def test_mtp_layer_equals_reference(ckpt):
    """[enorm(e) || hnorm(h)] @ eh_proj, the pattern's blocks (attention, then MoE) as mlx-lm
    runs them, final_layernorm; tensors read from the checkpoint's own names."""
    from safetensors.numpy import load_file

    path = ckpt("noisy")
    raw = {}
    for f in Path(path).glob("*.safetensors"):
        raw.update(load_file(f))
    model = load_model(path)[0]
    H, eps = model.args.hidden_size, model.args.layer_norm_epsilon
    hidden = np.random.default_rng(3).standard_normal((1, 3, H)).astype(np.float32)
    tokens = np.array([[5, 60, 11]])
    e = _rms(raw["backbone.embeddings.weight"][tokens], raw["mtp.layers.0.enorm.weight"], eps)
    h = _rms(hidden, raw["mtp.layers.0.hnorm.weight"], eps)
    x = mx.array(np.concatenate([e, h], axis=-1) @ raw["mtp.layers.0.eh_proj.weight"].T)
    attn, moe = model.mtp.layers[0].block.layers
    assert (attn.block_type, moe.block_type) == ("*", "E")
    np.testing.assert_array_equal(np.array(moe.norm.weight), raw["mtp.layers.1.norm.weight"])
    x = np.array(moe(attn(x, "causal", None)))
    want = _rms(x, raw["mtp.layers.1.final_layernorm.weight"], eps)
    got = model.mtp_forward(mx.array(hidden), mx.array(tokens), None)
    np.testing.assert_allclose(np.array(got), want, atol=2e-5)


def run_batch(model, k, prompts, n=16):
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
    return [outs[i][:n] for i in range(len(prompts))]


def test_batched_rows_equal_mlx_lm(ckpt):
    """Rows keep different numbers of drafts: one replay call with per-row lengths."""
    path = ckpt("noisy")
    model, ref = load_model(path)[0], mlx_lm_model(path)
    want = [mlx_lm_greedy(ref, p, 16) for p in PROMPTS]
    for k in (0, 2):
        assert run_batch(model, k, PROMPTS) == want, f"K={k}"


def test_checkpoint_without_its_mtp_layer(ckpt):
    path = ckpt(drop_mtp=True)
    with pytest.raises(MissingMTPWeightsError) as e:
        load_model(path)
    assert "mtp.layers.0.eh_proj.weight" in str(e.value) and "add-mtp" in str(e.value)
    model = load_model(path, mtp=False)[0]
    assert mtp_tokens(model, PROMPT, 0)[0] == mlx_lm_greedy(mlx_lm_model(path), PROMPT)


def test_convert_keeps_the_released_names_and_mlx_lm_still_loads(ckpt, tmp_path):
    src = ckpt("noisy")
    out = tmp_path / "out"
    convert(src, out, verbose=False)
    ours, original = load_model(out)[0], load_model(src)[0]
    assert mtp_tokens(ours, PROMPT, 2)[0] == mtp_tokens(original, PROMPT, 2)[0]
    assert (mtp_tokens(ours, PROMPT, 2)[1].stats.num_accepted_tokens
            == mtp_tokens(original, PROMPT, 2)[1].stats.num_accepted_tokens)
    names = {k for k, _ in tree_flatten(ours.parameters())}
    assert "mtp.layers.0.block.layers.1.mixer.switch_mlp.fc1.weight" in names
    plain = mlx_lm_model(out)
    x = mx.array([PROMPT])
    np.testing.assert_allclose(np.array(plain(x)), np.array(ours(x)), atol=1e-5)


def test_bfloat16_checkpoint_runs_on_the_cpu(ckpt):
    """mlx-lm's Nemotron experts (SwitchMLP) need float32 on MLX's CPU backend: the loader
    upcasts them as it does GLU experts."""
    model = load_model(ckpt("noisy", dtype=mx.bfloat16), dtype="bfloat16")[0]
    assert model.model.layers[1].mixer.q_proj.weight.dtype == mx.bfloat16
    assert mtp_tokens(model, PROMPT, 2)[0] == mtp_tokens(model, PROMPT, 0)[0]


@pytest.mark.parametrize("quantize", [False, True])
def test_add_mtp_onto_an_mlx_lm_conversion(ckpt, tmp_path, quantize):
    from mlx_lm import convert as mlx_lm_convert

    from mlx_mtp.convert.add_mtp import add_mtp

    src = ckpt("noisy")
    dst = tmp_path / "mlx-community"
    mlx_lm_convert(str(src), str(dst), quantize=quantize, q_group_size=32, q_bits=4)
    with pytest.raises(MissingMTPWeightsError, match="add-mtp"):
        load_model(dst)
    add_mtp(dst, src, verbose=False)
    model = load_model(dst)[0]
    ref = mlx_lm_greedy(mlx_lm_model(dst), PROMPT, 16)
    got, dec = mtp_tokens(model, PROMPT, 2, n=16)
    assert got == ref and dec.stats.num_accepted_tokens > 0


def test_distributed_split_is_refused_clearly(ckpt):
    from mlx_mtp.models.distributed import DistributedError, load_distributed

    with pytest.raises(DistributedError, match="cannot split nemotron_h models yet"):
        load_distributed(str(ckpt()))


def test_sampling_follows_the_target_distribution(ckpt):
    """Sampled drafts accepted in part: the replayed Mamba-2 state keeps the joint of the
    next two tokens exactly the target's."""
    from distribution_check import assert_follows, sample_outcomes, two_token_joint

    path = ckpt("random", vocab_size=8)
    model, ref = load_model(path)[0], mlx_lm_model(path)
    prompt = [1, 2, 3, 4, 5, 6, 7]

    def target(prefix):
        logits = ref(mx.array([prompt + prefix]))[0, -1].astype(mx.float32)
        return np.exp(np.array(logits - mx.logsumexp(logits), np.float64))

    def draw(seed):
        return mtp_tokens(model, prompt, 2, SamplingParams(temperature=1.0, seed=seed), n=2)

    n_samples = 400
    seen, accepted = sample_outcomes(draw, n_samples)
    assert accepted > n_samples // 10
    assert_follows(seen, two_token_joint(target), n_samples)
