"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): a tiny index_topk so short contexts
cross it; verify rows select keys as plain one-token decoding does, both caches of every
attention layer roll back; greedy output equals mlx-lm's plain decoding."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step as mlx_lm_generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model as mlx_lm_load_model

from mlx_mtp.convert.main import convert
from mlx_mtp.decode.batch import BatchDecoder
from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.models.cache import KVCache
from mlx_mtp.models.layout import MissingMTPWeightsError
from mlx_mtp.models.loader import load_model
from mlx_mtp.testing.tiny_special import make_tiny_dsa

FAMILIES = ["deepseek_v32", "glm_moe_dsa"]
RNG = np.random.default_rng(11)
PROMPT = [int(x) for x in RNG.integers(0, 128, 14)]  # index_topk is 6
PROMPTS = [[int(x) for x in RNG.integers(0, 128, n)] for n in (5, 12, 1, 9)]
N_TOKENS = 24


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    made = {}

    def make(family, head="random", **kw):
        key = (family, head, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = make_tiny_dsa(tmp_path_factory.mktemp(f"{family}_{head}"), family,
                                      head, **kw)
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
def test_trunk_logits_equal_mlx_lm_past_index_topk(ckpt, family):
    path = ckpt(family)
    model, ref = load_model(path)[0], mlx_lm_model(path)
    ours, theirs = model.make_cache(), make_prompt_cache(ref)
    assert len(ours) == 2 * len(theirs)  # latents and indexer keys, per layer
    for chunk in ([PROMPT[:4]], [[4]], [PROMPT[4:]], [[77]], [[2]]):
        a = model.logits(model.trunk(mx.array(chunk), ours)[0])
        b = ref(mx.array(chunk), cache=theirs)
        assert mx.array_equal(a, b)


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_rows_follow_plain_decoding_and_both_caches_roll_back(ckpt, family):
    """Rows past index_topk: each selects its own top-k as one-token decoding does."""
    model = load_model(ckpt(family, "noisy"))[0]
    rows = [4, 77, 2, 9]
    plain = model.make_cache()
    model.trunk(mx.array([PROMPT]), plain)
    want = mx.concatenate([model.logits(model.trunk(mx.array([[t]]), plain)[0])
                           for t in rows], axis=1)
    spec = model.make_cache()
    model.trunk(mx.array([PROMPT]), spec)
    got = model.logits(model.trunk(mx.array([rows]), spec, capture=True)[0])
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-6, atol=1e-4)
    assert mx.array_equal(got.argmax(-1), want.argmax(-1))
    for c in spec:
        c.accept([2])
    assert [c.offset for c in spec] == [len(PROMPT) + 2] * len(spec)
    again = model.logits(model.trunk(mx.array([[2]]), spec)[0])
    np.testing.assert_allclose(np.array(again), np.array(want[:, 2:3]), rtol=1e-6, atol=1e-4)


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
        if agree == "always":
            assert rate == 1.0
        elif agree == "never":
            assert rate < 0.2
        else:
            assert 0.0 < rate < 1.0


def _rms(x, w, eps):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * w


def test_mtp_layer_equals_reference(ckpt):
    """[enorm(e) || hnorm(h)] @ eh_proj -> the DSA block (with its own indexer, past its
    top-k) as mlx-lm runs it -> shared_head.norm, from the checkpoint's tensors."""
    from safetensors.numpy import load_file

    path = ckpt("deepseek_v32", "noisy")
    raw = {}
    for f in Path(path).glob("*.safetensors"):
        raw.update(load_file(f))
    p = "model.layers.2."
    model = load_model(path)[0]
    H, eps = model.args.hidden_size, model.args.rms_norm_eps
    hidden = np.random.default_rng(3).standard_normal((1, 9, H)).astype(np.float32)
    tokens = np.array([[int(x) for x in RNG.integers(0, 128, 9)]])
    e = _rms(raw["model.embed_tokens.weight"][tokens], raw[p + "enorm.weight"], eps)
    h = _rms(hidden, raw[p + "hnorm.weight"], eps)
    x = mx.array(np.concatenate([e, h], axis=-1) @ raw[p + "eh_proj.weight"].T)
    from mlx_lm.models.base import create_causal_mask

    block = model.mtp.layers[0].block
    x = np.array(block(x, create_causal_mask(9), (KVCache(), KVCache())))
    want = _rms(x, raw[p + "shared_head.norm.weight"], eps)
    got = model.mtp_forward(mx.array(hidden), mx.array(tokens), model.make_mtp_cache())
    np.testing.assert_allclose(np.array(got), want, atol=2e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_rows_equal_mlx_lm(ckpt, family):
    path = ckpt(family, "noisy")
    model, ref = load_model(path)[0], mlx_lm_model(path)
    want = [mlx_lm_greedy(ref, p, 16) for p in PROMPTS]
    for k in (0, 2):
        bd = BatchDecoder(model, k, adaptive=False)
        outs = {}
        for i, p in enumerate(PROMPTS):
            dec = MTPDecoder(model, k, adaptive=False)
            dec.prefill(p)
            bd.add(i, dec)
            outs[i] = []
            for key, o in bd.step().items():
                outs[key] += o.tokens
        while min(len(t) for t in outs.values()) < 16:
            for key, o in bd.step().items():
                outs[key] += o.tokens
        assert [outs[i][:16] for i in range(len(PROMPTS))] == want, f"K={k}"


def test_missing_head_and_convert(ckpt, tmp_path):
    path = ckpt("glm_moe_dsa", drop_mtp=True)
    with pytest.raises(MissingMTPWeightsError, match="model.layers.2.eh_proj.weight"):
        load_model(path)
    src = ckpt("glm_moe_dsa", "noisy")
    convert(src, tmp_path / "out", verbose=False)
    ours, original = load_model(tmp_path / "out")[0], load_model(src)[0]
    assert mtp_tokens(ours, PROMPT, 2)[0] == mtp_tokens(original, PROMPT, 2)[0]
    x = mx.array([PROMPT])
    assert mx.array_equal(mlx_lm_model(tmp_path / "out")(x), ours(x))
