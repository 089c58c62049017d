"""Batched MTP decoding: rows join and leave, each accepts its own drafts."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step as mlx_lm_generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model

from mlx_mtp.decode.batch import BatchDecoder
from mlx_mtp.models.cache.recurrent import RecurrentCache
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.decode.speculative import MTPDecoder, generate_step

RNG = np.random.default_rng(0)
PROMPTS = [[int(x) for x in RNG.integers(0, 512, n)] for n in (5, 11, 3, 20, 1, 8)]
N = 16


def run_batch(model, k, prompts, params=None, n=N):
    """Staggered joins (one per step), removal when done. Returns tokens per row."""
    bd = BatchDecoder(model, k > 0, adaptive=False)
    outs, done = {}, set()
    for i, pr in enumerate(prompts):
        dec = MTPDecoder(model, k, params[i] if params else SamplingParams(), adaptive=False)
        dec.prefill(pr)
        bd.add(i, dec)
        outs[i] = []
        for key, o in bd.step().items():
            outs[key] += o.tokens
    while len(done) < len(prompts):
        for key, o in bd.step().items():
            outs[key] += o.tokens
        for key, toks in outs.items():
            if len(toks) >= n and key not in done:
                bd.remove(key)
                done.add(key)
    return {i: t[:n] for i, t in outs.items()}, bd


def mlx_lm_greedy(path, prompt, n):
    model, _ = mlx_lm_load_model(Path(path))
    return [int(t) for t, _ in mlx_lm_generate_step(mx.array(prompt), model, max_tokens=n)]


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("head,kw", [("oracle", {"trunk_scale": 0.1}),  # always agrees
                                     ("noisy", {"trunk_scale": 0.1}),  # sometimes
                                     ("random", {})])  # never
def test_batched_greedy_equals_mlx_lm_for_every_row(tiny_ckpt, family, head, kw):
    path = tiny_ckpt(family, head, **kw)
    model, _ = load_model(Path(path))
    refs = [mlx_lm_greedy(path, p, N) for p in PROMPTS]
    for k in (0, 1, 3):
        outs, _ = run_batch(model, k, PROMPTS)
        assert [outs[i] for i in range(len(PROMPTS))] == refs, f"K={k}"


def test_batched_seeded_sampling_equals_solo(tiny_ckpt):
    model, _ = load_model(Path(tiny_ckpt("qwen3_5", "noisy", trunk_scale=0.1)))
    params = [SamplingParams(temperature=0.8, top_k=20, seed=i) for i in range(len(PROMPTS))]
    outs, _ = run_batch(model, 2, PROMPTS, params)
    for i, p in enumerate(PROMPTS):
        dec = MTPDecoder(model, 2, params[i], adaptive=False)
        solo = [t for t, _, _ in generate_step(p, model, decoder=dec, max_tokens=N)]
        assert outs[i] == solo


def test_per_row_rollback_matches_plain_decode(tiny_ckpt):
    """Each row's valid KV entries and recurrent state equal its own plain decode."""
    model, _ = load_model(Path(tiny_ckpt("qwen3_5", "noisy", trunk_scale=0.1)))
    bd = BatchDecoder(model, adaptive=False)
    emitted = {}
    for i, p in enumerate(PROMPTS[:4]):
        dec = MTPDecoder(model, 3, adaptive=False)
        dec.prefill(p)
        bd.add(i, dec)
        emitted[i] = []
    patterns = set()
    for _ in range(6):
        for key, o in bd.step().items():
            emitted[key] += o.tokens
            patterns.add(o.num_accepted)
    assert len(patterns) > 1
    for b, row in enumerate(bd.rows):
        tokens = PROMPTS[row.key] + emitted[row.key][:-1]
        cache = model.make_cache()
        for t in tokens:
            model.trunk(mx.array([[t]]), cache)
        for mine, ref in zip(bd.cache, cache):
            if isinstance(ref, RecurrentCache):
                assert mx.allclose(mine.conv[b], ref.conv[0], atol=1e-4).item()
                assert mx.allclose(mine.ssm[b], ref.ssm[0], atol=1e-4).item()
            else:
                k, v = mine.row_state(b)
                assert k.shape == ref.state[0].shape
                assert mx.allclose(k, ref.state[0], atol=1e-4).item()
                assert mx.allclose(v, ref.state[1], atol=1e-4).item()
                assert mine.pos[b] == ref.offset


def test_failed_step_restores_batch_and_names_one_row(tiny_ckpt):
    """A failure of the shared forward fails one row (longest context); the rest go on."""
    from mlx_mtp.decode.batch import BatchStepError

    model, _ = load_model(Path(tiny_ckpt("qwen3_5", "noisy", trunk_scale=0.1)))
    prompts = PROMPTS[:3]
    refs = [[t for t, _, _ in generate_step(p, model, num_draft_tokens=0, max_tokens=N)]
            for p in prompts]
    bd = BatchDecoder(model, adaptive=False)
    outs = {}
    for i, p in enumerate(prompts):
        dec = MTPDecoder(model, 2, adaptive=False)
        dec.prefill(p)
        bd.add(i, dec)
        outs[i] = []
    for key, o in bd.step().items():
        outs[key] += o.tokens
    text = model.text  # the model a wrapper's trunk is
    real_trunk = text.trunk

    def failing_trunk(*a, **k):
        h = real_trunk(*a, **k)
        raise MemoryError("out of memory")

    text.trunk = failing_trunk
    try:
        with pytest.raises(BatchStepError) as e:
            bd.step()
    finally:
        del text.trunk
    longest = max(range(3), key=lambda i: len(prompts[i]) + len(outs[i]))
    assert e.value.key == longest
    bd.remove(longest)
    while any(len(outs[i]) < N for i in outs if i != longest):
        for key, o in bd.step().items():
            outs[key] += o.tokens
    for i in outs:
        if i != longest:
            assert outs[i][:N] == refs[i]


def test_calibrate_fills_the_cost_model_and_leaves_the_batch_empty():
    from mlx_mtp.testing.tiny import make_tiny
    import tempfile
    from mlx_mtp.models.io.loader import load_model

    with tempfile.TemporaryDirectory() as d:  # token ids only: the model without a tokenizer
        model, _ = load_model(make_tiny(d + "/m", "qwen3_5", "oracle"))
    bd = BatchDecoder(model)
    assert bd.calibrate(2, (1, 3), steps=3) > 0
    assert len(bd) == 0 and bd.cache is None
    for B in (1, 3):
        for k in (0, 1, 2):
            assert bd.policy.costs.count(B, k) == 3
    assert set(bd.policy.acceptance.alpha) == {0.7}  # dummy drafts teach nothing about acceptance
    # the batch still decodes correctly afterwards
    ref = [t for t, _, _ in generate_step([5, 6, 7, 8], model, num_draft_tokens=0, max_tokens=8)]
    dec = MTPDecoder(model, 2, SamplingParams(), adaptive=False)
    dec.prefill([5, 6, 7, 8])
    bd.add("r", dec)
    got = []
    while len(got) < 8:
        got += bd.step()["r"].tokens
    assert got[:8] == ref
