"""LongCat-Flash: two MLA attention sublayers per layer (two KV caches, both rolled back),
zero-compute experts, MLA LoRA scaling, MTP at model.mtp.*; greedy output equals mlx-lm's
plain decoding."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step as mlx_lm_generate_step
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model as mlx_lm_load_model

from mlx_mtp.convert.main import convert
from mlx_mtp.decode.batch import BatchDecoder
from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.models.layout import MissingMTPWeightsError
from mlx_mtp.models.loader import load_model
from mlx_mtp.testing.tiny_special import make_tiny_longcat_flash

RNG = np.random.default_rng(3)
PROMPT = [int(x) for x in RNG.integers(0, 128, 11)]
PROMPTS = [[int(x) for x in RNG.integers(0, 128, n)] for n in (5, 11, 1, 8)]
N_TOKENS = 24


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    made = {}

    def make(head="random", **kw):
        key = (head, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = make_tiny_longcat_flash(tmp_path_factory.mktemp(f"longcat_{head}"),
                                                head, **kw)
        return made[key]

    return make


def mlx_lm_model(path):
    return mlx_lm_load_model(Path(path))[0]  # strict: its sanitize drops model.mtp*


def mlx_lm_greedy(model, prompt, n=N_TOKENS):
    return [int(t) for t, _ in mlx_lm_generate_step(mx.array(prompt), model, max_tokens=n)]


def mtp_tokens(model, prompt, k, sampling=SamplingParams(), n=N_TOKENS):
    dec = MTPDecoder(model, k, sampling, adaptive=False)
    return [t for t, _, _ in generate_step(prompt, model, decoder=dec, max_tokens=n)], dec


def test_trunk_logits_equal_mlx_lm(ckpt):
    path = ckpt()
    model, ref = load_model(path)[0], mlx_lm_model(path)
    ours, theirs = model.make_cache(), make_prompt_cache(ref)
    assert len(ours) == 2 * len(theirs)  # one cache per attention sublayer
    for chunk in ([PROMPT], [[4]], [[77]], [[2]]):
        a = model.logits(model.trunk(mx.array(chunk), ours)[0])
        b = ref(mx.array(chunk), cache=theirs)
        assert mx.array_equal(a, b)


def test_verify_rows_equal_plain_decoding_and_both_sublayers_roll_back(ckpt):
    model = load_model(ckpt("noisy"))[0]
    rows = [4, 77, 2, 9]
    plain = model.make_cache()
    model.trunk(mx.array([PROMPT]), plain)
    want = mx.concatenate([model.logits(model.trunk(mx.array([[t]]), plain)[0])
                           for t in rows], axis=1)
    spec = model.make_cache()
    model.trunk(mx.array([PROMPT]), spec)
    verify = model.logits(model.trunk(mx.array([rows]), spec, capture=True)[0])
    assert mx.array_equal(verify, want)  # absorbed formula on every verify row
    for c in spec:
        c.accept([2])
    assert [c.offset for c in spec] == [len(PROMPT) + 2] * len(spec)
    again = model.logits(model.trunk(mx.array([[2]]), spec)[0])
    assert mx.array_equal(again, want[:, 2:3])
    expanded = model.make_cache()
    model.trunk(mx.array([PROMPT]), expanded)
    other = model.logits(model.trunk(mx.array([rows]), expanded)[0])
    assert not mx.array_equal(other, want) and mx.allclose(other, want, atol=1e-4)


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
        else:
            assert 0.0 < rate < 1.0


def _rms(x, w, eps):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * w


def test_mtp_layer_equals_reference(ckpt):
    """[enorm.m(e) || hnorm.m(h)] @ eh_proj, the block (mlx-lm's LongCat MLA and MLP),
    model.mtp.norm; tensors under the release's names."""
    from safetensors.numpy import load_file

    path = ckpt("noisy")
    raw = {}
    for f in Path(path).glob("*.safetensors"):
        raw.update(load_file(f))
    p = "model.mtp.layers.0."
    model = load_model(path)[0]
    H, eps = model.args.hidden_size, model.args.rms_norm_eps
    hidden = np.random.default_rng(3).standard_normal((1, 3, H)).astype(np.float32)
    tokens = np.array([[5, 60, 11]])
    e = _rms(raw["model.embed_tokens.weight"][tokens], raw[p + "enorm.m.weight"], eps)
    h = _rms(hidden, raw[p + "hnorm.m.weight"], eps)
    x = mx.array(np.concatenate([e, h], axis=-1) @ raw[p + "eh_proj.weight"].T)
    block = model.mtp.layers[0].block
    np.testing.assert_array_equal(np.array(block.mlp.down_proj.weight),
                                  raw[p + "transformer_layer.mlp.down_proj.weight"])
    x = x + block.self_attn(block.input_layernorm(x), create_causal_mask(3), None)
    x = np.array(x + block.mlp(block.post_attention_layernorm(x)))
    want = _rms(x, raw["model.mtp.norm.weight"], eps)
    got = model.mtp_forward(mx.array(hidden), mx.array(tokens), None)
    np.testing.assert_allclose(np.array(got), want, atol=2e-5)


def test_batched_rows_equal_mlx_lm(ckpt):
    path = ckpt("noisy")
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


def test_checkpoint_without_its_mtp_layer(ckpt):
    path = ckpt(drop_mtp=True)
    with pytest.raises(MissingMTPWeightsError) as e:
        load_model(path)
    assert "model.mtp.layers.0.eh_proj.weight" in str(e.value) and "add-mtp" in str(e.value)
    assert "model.mtp.norm.weight" in str(e.value)
    model = load_model(path, mtp=False)[0]
    assert mtp_tokens(model, PROMPT, 0)[0] == mlx_lm_greedy(mlx_lm_model(path), PROMPT)


def test_convert_and_add_mtp_keep_the_released_names(ckpt, tmp_path):
    from mlx_lm import convert as mlx_lm_convert

    from mlx_mtp.convert.add_mtp import add_mtp

    src = ckpt("noisy")
    convert(src, tmp_path / "out", verbose=False)
    ours, original = load_model(tmp_path / "out")[0], load_model(src)[0]
    assert mtp_tokens(ours, PROMPT, 2)[0] == mtp_tokens(original, PROMPT, 2)[0]
    x = mx.array([PROMPT])
    assert mx.array_equal(mlx_lm_model(tmp_path / "out")(x), ours(x))
    dst = tmp_path / "mlx-community"
    mlx_lm_convert(str(src), str(dst), quantize=True, q_group_size=32, q_bits=4)
    add_mtp(dst, src, verbose=False)
    model = load_model(dst)[0]
    got, dec = mtp_tokens(model, PROMPT, 2, n=16)
    assert got == mlx_lm_greedy(mlx_lm_model(dst), PROMPT, 16)
    assert dec.stats.num_accepted_tokens > 0
