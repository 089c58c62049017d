"""The checks every MTP family's tests run, written once: greedy output equals mlx-lm's plain
decoding at every K (with the acceptance each head must give), batched rows equal mlx-lm's,
trunk logits follow mlx-lm's, verify rows equal one-token decoding, a checkpoint without its
MTP layer is explained and still decodes without it, sampling follows the target
distribution, and convert / add-mtp results still load in plain mlx-lm."""

import json
from functools import partial
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step as mlx_lm_generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model as mlx_lm_load_model

from distribution_check import assert_follows, sample_rows, two_token_joint_of
from mlx_mtp.decode.batch import BatchDecoder
from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.models.io.layout import MissingMTPWeightsError
from mlx_mtp.models.io.loader import load_model

N_TOKENS = 24
# How often each tiny head's drafts agree with the trunk -> the head the builders make.
HEADS = {"always": "oracle", "sometimes": "noisy", "never": "random"}


def checkpoints(tmp_path_factory, build):
    """``make(family, head="random", **kw)``: ``build(path, family, head, **kw)``, memoised, so
    a module builds each tiny checkpoint once."""
    made = {}

    def make(family, head="random", **kw):
        key = (family, head, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = build(tmp_path_factory.mktemp(f"{family}_{head}"), family, head, **kw)
        return made[key]

    return make


def by_family(builders: dict):
    """``{family: build(path, head, **kw)}`` as one ``build(path, family, head, **kw)``."""
    return lambda path, family, head, **kw: builders[family](path, head, **kw)


def one_family(tmp_path_factory, family: str, build):
    """For a module of one family: ``make(head="random", **kw)``, memoised."""
    return partial(checkpoints(tmp_path_factory, by_family({family: build})), family)


def reference_config(path) -> dict:
    """Config overrides under which mlx-lm's class computes what the released model does,
    where mlx-lm 0.32.2 departs from it (docs/model-families.md, "Where we differ from
    mlx-lm"): MiMo-V2-Flash's window layers attend to ``sliding_window_size + 1`` keys (the
    reference's semantics, which tests/test_trunk_fidelity.py checks against
    transformers), mlx-lm's to ``sliding_window_size``."""
    config = json.loads((Path(path) / "config.json").read_text())
    if config.get("model_type") == "mimo_v2_flash":
        return {"sliding_window_size": config["sliding_window_size"] + 1}
    return {}


def mlx_lm_model(path, strict: bool = True):
    """mlx-lm's model of ``path``, run as the released model runs (``reference_config``)."""
    return mlx_lm_load_model(Path(path), strict=strict, model_config=reference_config(path))[0]


def mlx_lm_greedy(model, prompt, n: int = N_TOKENS):
    return [int(t) for t, _ in mlx_lm_generate_step(mx.array(prompt), model, max_tokens=n)]


def mtp_tokens(model, prompt, k: int, sampling=SamplingParams(), n: int = N_TOKENS):
    dec = MTPDecoder(model, k, sampling, adaptive=False)
    return [t for t, _, _ in generate_step(prompt, model, decoder=dec, max_tokens=n)], dec


def decode_and_accepted(model, prompt, k: int, n: int = N_TOKENS):
    toks, dec = mtp_tokens(model, prompt, k, n=n)
    return toks, dec.stats.num_accepted_tokens


def assert_acceptance(rate: float, agree: str):
    if agree == "always":  # proves concat order, norms and chaining
        assert rate == 1.0
    elif agree == "never":
        assert rate < 0.2
    else:
        assert 0.0 < rate < 1.0


def assert_greedy_identical(path, prompt, agree=None, ks=(1, 2, 3), n: int = N_TOKENS,
                            strict: bool = True):
    """K=0 and every K in ``ks`` give mlx-lm's greedy tokens for the checkpoint at ``path``;
    with ``agree`` (a key of HEADS) the acceptance rate is the head's. Returns the decoders
    of ``ks``."""
    ref = mlx_lm_greedy(mlx_lm_model(path, strict), prompt, n)
    model = load_model(path)[0]
    assert mtp_tokens(model, prompt, 0, n=n)[0] == ref
    decoders = []
    for k in ks:
        got, dec = mtp_tokens(model, prompt, k, n=n)
        assert got == ref, f"K={k}"
        if agree is not None:
            assert_acceptance(dec.stats.acceptance_rate, agree)
        decoders.append(dec)
    return decoders


def run_batch(model, k: int, prompts, n: int = 16, decoders=None):
    """Rows join one per step (so they sit at different positions) and decode together
    (``decoders``: one per prompt, default ``MTPDecoder(model, k)``). Returns each row's
    first ``n`` tokens and the batch decoder."""
    bd = BatchDecoder(model, k > 0, adaptive=False)
    outs = {}
    for i, p in enumerate(prompts):
        dec = decoders[i] if decoders else MTPDecoder(model, k, adaptive=False)
        dec.prefill(p)
        bd.add(i, dec)
        outs[i] = []
        for key, o in bd.step().items():
            outs[key] += o.tokens
    while min(len(t) for t in outs.values()) < n:
        for key, o in bd.step().items():
            outs[key] += o.tokens
    return [outs[i][:n] for i in range(len(prompts))], bd


def assert_batched_rows_equal_mlx_lm(model, ref_model, prompts, n: int = 16, ks=(0, 2)):
    """Returns the batch decoders of ``ks``, for checks on their caches."""
    want = [mlx_lm_greedy(ref_model, p, n) for p in prompts]
    decoders = []
    for k in ks:
        rows, bd = run_batch(model, k, prompts, n)
        assert rows == want, f"K={k}"
        decoders.append(bd)
    return decoders


def assert_trunk_follows_mlx_lm(model, ref_model, chunks, atol=None):
    """Feeds ``chunks`` (token lists) in turn through both trunks with their caches: logits
    equal bit for bit, or within ``atol``. Returns both caches."""
    ours, theirs = model.make_cache(), make_prompt_cache(ref_model)
    for chunk in chunks:
        a = model.logits(model.trunk(mx.array([chunk]), ours)[0])
        b = ref_model(mx.array([chunk]), cache=theirs)
        if atol is None:
            assert mx.array_equal(a, b)
        else:
            np.testing.assert_allclose(np.array(a), np.array(b), atol=atol)
    return ours, theirs


def prefilled_cache(model, prompt):
    cache = model.make_cache()
    model.trunk(mx.array([prompt]), cache)
    return cache


def verified_and_plain(model, prefix, rows, keep):
    """(``spec``, ``plain``): after ``prefix``, a verify pass over ``rows`` keeping ``keep`` of
    them, and the same kept rows fed one at a time: the two caches a rollback must make equal."""
    plain = prefilled_cache(model, prefix)
    for t in rows[:keep]:
        model.trunk(mx.array([[t]]), plain)
    spec = prefilled_cache(model, prefix)
    model.trunk(mx.array([rows]), spec, capture=True)
    for c in spec:
        c.accept([keep])
    return spec, plain


def one_by_one_logits(model, prompt, tokens):
    """Logits of plain decoding: ``tokens`` one at a time after ``prompt``, as (1, T, V)."""
    cache = prefilled_cache(model, prompt)
    return mx.concatenate([model.logits(model.trunk(mx.array([[t]]), cache)[0])
                           for t in tokens], axis=1)


def verify_logits(model, prompt, rows, capture: bool = True):
    """Logits of one verify pass over ``rows`` after ``prompt``, and the cache after it."""
    cache = prefilled_cache(model, prompt)
    return model.logits(model.trunk(mx.array([rows]), cache, capture=capture)[0]), cache


def assert_missing_head_explained(path, *names):
    """Loading a checkpoint without its MTP layer names what is missing and the fix."""
    with pytest.raises(MissingMTPWeightsError) as e:
        load_model(path)
    for s in ("add-mtp",) + names:
        assert s in str(e.value), s


def assert_decodes_without_head(path, prompt, strict: bool = True, n: int = N_TOKENS):
    """``mtp=False`` loads the trunk alone: plain decoding equals mlx-lm's."""
    model = load_model(path, mtp=False)[0]
    assert model.num_mtp_layers == 0
    ref = mlx_lm_greedy(mlx_lm_model(path, strict), prompt, n)
    assert mtp_tokens(model, prompt, 0, n=n)[0] == ref


def rms(x, w, eps):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * w


def reference_inputs(hidden_size: int, tokens=((5, 60, 11),)):
    """The trunk hidden states (1, T, H) and tokens (1, T) MTP-layer references run on."""
    tokens = np.array(tokens)
    shape = (1, tokens.shape[1], hidden_size)
    return np.random.default_rng(3).standard_normal(shape).astype(np.float32), tokens


def fused_input(embedded, hidden, enorm, hnorm, eh_proj, eps, hidden_first: bool = False):
    """An MTP layer's input in numpy: [enorm(e) || hnorm(h)] @ eh_proj^T (MiMo: h first)."""
    e, h = rms(embedded, enorm, eps), rms(hidden, hnorm, eps)
    return np.concatenate([h, e] if hidden_first else [e, h], axis=-1) @ eh_proj.T


def assert_mtp_forward_equals(model, hidden, tokens, want, cache=None):
    got = model.mtp_forward(mx.array(hidden), mx.array(tokens), cache)
    np.testing.assert_allclose(np.array(got), want, atol=2e-5)


def raw_tensors(path, pattern: str = "*.safetensors") -> dict:
    """A checkpoint's tensors under their stored names, as numpy arrays."""
    from safetensors.numpy import load_file

    raw = {}
    for f in Path(path).glob(pattern):
        raw.update(load_file(f))
    return raw


def assert_sampling_follows_target(model, ref_model, prompt, n_samples: int = 400):
    """K=2 at temperature 1, many seeds: the next two tokens follow mlx-lm's exact joint
    distribution (chi-square), with drafts accepted often enough to matter."""

    def targets(prefixes):  # one batched forward
        logits = ref_model(mx.array([prompt + p for p in prefixes]))[:, -1].astype(mx.float32)
        return np.exp(np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True),
                               np.float64))

    seen, accepted, _ = sample_rows(model, prompt, 2, n_samples)
    assert accepted > n_samples // 10
    assert_follows(seen, two_token_joint_of(targets), n_samples)


def assert_oracle_accepts_everything(model, prompt, n: int = 20) -> dict:
    """Every draft of an oracle head accepted at K = 1..3 (each verify keeps all its rows:
    the caches' all-accepted path), the output plain decoding's (not one token repeated).
    Returns each K's tokens and decoder."""
    plain = mtp_tokens(model, prompt, 0, n=n)[0]
    assert len(set(plain)) > 3
    runs = {}
    for k in (1, 2, 3):
        got, dec = runs[k] = mtp_tokens(model, prompt, k, n=n)
        assert got == plain, f"K={k}"
        assert dec.stats.acceptance_rate == 1.0, f"K={k}"
    return runs


def assert_convert_round_trip(src, out, prompt, n: int = N_TOKENS, atol=None):
    """``convert`` keeps the MTP layer (same drafts, same acceptance at K=2) and plain
    mlx-lm loads the result strictly, with the same logits (bit for bit, or within ``atol``).
    Returns our model of ``out``."""
    from mlx_mtp.convert.main import convert

    convert(src, out, verbose=False)
    ours, original = load_model(out)[0], load_model(src)[0]
    assert decode_and_accepted(ours, prompt, 2, n) == decode_and_accepted(original, prompt, 2, n)
    x = mx.array([prompt])
    plain, mine = mlx_lm_model(out)(x), ours(x)  # strict: mlx-lm never opens mtp.safetensors
    if atol is None:
        assert mx.array_equal(plain, mine)
    else:
        np.testing.assert_allclose(np.array(plain), np.array(mine), atol=atol)
    return ours


def mlx_lm_convert(src, dst, quantize: bool):
    from mlx_lm import convert as mlx_lm_convert_fn

    mlx_lm_convert_fn(str(src), str(dst), quantize=quantize, q_group_size=32, q_bits=4)


def assert_add_mtp_onto_mlx_lm_conversion(src, dst, prompt, quantize: bool, n: int = 16):
    """mlx-lm's convert drops the MTP layer (loading says add-mtp); add-mtp grafts it back:
    greedy output equals mlx-lm's on the same folder, drafts are accepted, and an unquantized
    graft drafts exactly as the original. Returns our model of ``dst``."""
    from mlx_mtp.convert.add_mtp import add_mtp

    mlx_lm_convert(src, dst, quantize)
    with pytest.raises(MissingMTPWeightsError, match="add-mtp"):
        load_model(dst)
    add_mtp(dst, src, verbose=False)
    model = load_model(dst)[0]
    toks, accepted = decode_and_accepted(model, prompt, 2, n)
    assert toks == mlx_lm_greedy(mlx_lm_model(dst), prompt, n) and accepted > 0
    if not quantize:  # the grafted layer is the original's: same drafts, same acceptance
        assert (toks, accepted) == decode_and_accepted(load_model(src)[0], prompt, 2, n)
    return model
