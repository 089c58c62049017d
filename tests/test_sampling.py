"""Acceptance math: filters, greedy table cases, exact target distribution."""

from functools import cache
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from scipy import stats as sps

from distribution_check import sample_rows
from mlx_mtp.decode.noise import ACCEPT, DRAFT, TARGET, gumbel, position_keys, uniform
from mlx_mtp.decode.sampling import SamplingParams, filtered_logprobs, log_softmax, sample, verify


def lp(probs):
    return mx.log(mx.array(np.asarray(probs, np.float32)))


def test_params_validation_messages():
    for bad, word in [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
                      (dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"),
                      (dict(temperature=float("nan")), "temperature")]:
        with pytest.raises(ValueError, match=word):
            SamplingParams(**bad)


def test_filters_match_numpy_reference():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 50)).astype(np.float32) * 3
    x = log_softmax(mx.array(logits))
    p = np.exp(np.array(x))
    # top-k keeps exactly the k largest
    out = np.array(filtered_logprobs(x, SamplingParams(temperature=1, top_k=5)))
    for r in range(4):
        assert set(np.where(np.isfinite(out[r]))[0]) == set(np.argsort(-p[r])[:5])
    # top-p keeps the smallest prefix with mass >= p
    out = np.array(filtered_logprobs(x, SamplingParams(temperature=1, top_p=0.7)))
    for r in range(4):
        order = np.argsort(-p[r])
        n = int(np.searchsorted(np.cumsum(p[r][order]), 0.7) + 1)
        assert set(np.where(np.isfinite(out[r]))[0]) == set(order[:n])
    # min-p relative to the max
    out = np.array(filtered_logprobs(x, SamplingParams(temperature=1, min_p=0.2)))
    for r in range(4):
        assert set(np.where(np.isfinite(out[r]))[0]) == set(np.where(p[r] >= 0.2 * p[r].max())[0])
    # temperature renormalises
    out = np.array(filtered_logprobs(x, SamplingParams(temperature=0.5)))
    ref = np.exp(logits / 0.5 - np.log(np.exp(logits / 0.5).sum(-1, keepdims=True)))
    np.testing.assert_allclose(np.exp(out), ref, rtol=1e-4, atol=1e-6)


def _reference_filter(logprobs, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """numpy, full sort: temperature, then top-k, top-p, min-p (transformers' order)."""
    x = logprobs / temperature
    keep = np.ones_like(x, bool)
    for r in range(len(x)):
        p = np.exp(x[r] - np.logaddexp.reduce(x[r]))
        order = np.argsort(-p, kind="stable")
        if top_k:
            keep[r, order[top_k:]] = False
        p = np.where(keep[r], p, 0) / np.where(keep[r], p, 0).sum()
        mass_before = np.cumsum(p[order]) - p[order]
        keep[r, order[mass_before >= top_p]] = False
        keep[r] &= p >= min_p * p.max()
    out = np.where(keep, x, -np.inf)
    return out - np.logaddexp.reduce(out, axis=-1, keepdims=True)


@pytest.mark.parametrize("kw", [dict(temperature=0.5, top_p=0.7), dict(temperature=2.0, min_p=0.3),
                                dict(temperature=0.7, top_k=8, top_p=0.6),
                                dict(temperature=1.5, top_k=20, top_p=0.9, min_p=0.05),
                                dict(temperature=0.9, top_k=1)])
def test_filters_apply_temperature_first(kw):
    rng = np.random.default_rng(3)
    x = log_softmax(mx.array(rng.standard_normal((5, 300)).astype(np.float32) * 3))
    got = np.array(filtered_logprobs(x, SamplingParams(**kw)))
    want = _reference_filter(np.array(x, np.float64), **kw)
    assert (np.isfinite(got) == np.isfinite(want)).all()
    np.testing.assert_allclose(np.exp(got), np.exp(want), atol=1e-5)


def test_top_k_one_keeps_only_the_argmax():
    x = log_softmax(mx.random.normal((3, 2, 50), key=mx.random.key(4)))
    out = np.array(filtered_logprobs(x, SamplingParams(temperature=0.8, top_k=1)))
    assert (np.isfinite(out).sum(axis=-1) == 1).all()
    assert (out.argmax(-1) == np.array(x).argmax(-1)).all()
    assert np.allclose(out.max(-1), 0.0)


def test_top_k_never_sorts_the_vocabulary(monkeypatch):
    """With top_k set, top-p sorts only the k survivors (partition selects them)."""
    sorted_lengths = []
    for name in ("sort", "argsort"):
        real = getattr(mx, name)

        def recording(a, *args, _real=real, **kwargs):
            sorted_lengths.append(a.shape[-1])
            return _real(a, *args, **kwargs)

        monkeypatch.setattr(mx, name, recording)
    x = log_softmax(mx.random.normal((4, 5000), key=mx.random.key(5)))
    mx.eval(filtered_logprobs(x, SamplingParams(temperature=0.7, top_k=20, top_p=0.8, min_p=0.01)))
    assert sorted_lengths == [20]


def onehot_rows(idx, V=6):
    m = np.full((len(idx), V), -100.0, np.float32)
    m[np.arange(len(idx)), idx] = 100.0
    return log_softmax(mx.array(m))[None]


@pytest.mark.parametrize("drafts,argmax,n,nxt", [
    ([1, 2, 3], [1, 2, 3, 4], 3, 4),   # all accepted + bonus
    ([1, 5, 3], [1, 2, 3, 4], 1, 2),   # early mismatch -> target token
    ([5, 2, 3], [1, 2, 3, 4], 0, 1),   # first mismatch
    ([], [4], 0, 4),                   # no drafts: plain step
])
def test_greedy_verify_table(drafts, argmax, n, nxt):
    got_n, got_next = verify(onehot_rows(argmax), mx.array([drafts], mx.uint32).reshape(1, -1))
    assert got_n.item() == n and got_next.item() == nxt


@pytest.mark.parametrize("limit,n,nxt", [(3, 3, 4), (2, 2, 3), (1, 1, 2), (0, 0, 1)])
def test_greedy_verify_stops_at_the_rows_own_limit(limit, n, nxt):
    """A row that asked for fewer drafts than the batch drafted ends where a step with
    its own K would: the target's token at its limit."""
    got_n, got_next = verify(onehot_rows([1, 2, 3, 4]), mx.array([[1, 2, 3]], mx.uint32),
                             limit=mx.array([limit]))
    assert got_n.item() == n and got_next.item() == nxt


@cache  # keys are a Python loop over rows: built once per shape, shared by the parametrizations
def _noise(B, count, stream, V, start=0):
    """Independent per-row noise: row b is a request with seed b."""
    return position_keys(range(B), [start] * B, count, stream)


def _random_dists(rng, rows, V, sharp=1.5):
    p = rng.dirichlet(np.ones(V) * sharp, size=rows)
    return p.astype(np.float32)


@pytest.mark.parametrize("K", [1, 2, 3])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=4),
                                    SamplingParams(temperature=1.3, top_p=0.8),
                                    SamplingParams(temperature=0.8, top_k=4, top_p=0.7)])
def test_every_emitted_position_follows_target(K, params):
    """Goodness of fit: at each position j (given it is reached) the emitted token
    ~ p_j, including the bonus position K. Target and draft go through the same filter."""
    rng = np.random.default_rng(K)
    V, B = 6, 60000
    target = filtered_logprobs(log_softmax(lp(_random_dists(rng, K + 1, V))), params)
    draft = filtered_logprobs(log_softmax(lp(_random_dists(rng, K, V))), params)
    tgt = mx.broadcast_to(target[None], (B, K + 1, V))
    dq = mx.broadcast_to(draft[None], (B, K, V))
    drafts = sample(dq, gumbel(_noise(B, K, DRAFT, V), V))
    n, nxt = verify(tgt, drafts, dq, gumbel(_noise(B, K + 1, TARGET, V), V),
                    uniform(_noise(B, K, ACCEPT, V)))
    n, nxt, drafts = np.array(n), np.array(nxt), np.array(drafts)
    p = np.exp(np.array(target, np.float64))
    for j in range(K + 1):
        reached = n >= j
        emitted = np.where(n[reached] > j, drafts[reached, min(j, K - 1)], nxt[reached])
        emitted = np.where(n[reached] == j, nxt[reached], emitted)
        counts = np.bincount(emitted, minlength=V)
        support = p[j] > 0
        assert counts[~support].sum() == 0, "token outside the filtered support"
        expected = p[j][support] / p[j][support].sum() * reached.sum()
        chi2 = sps.chisquare(counts[support], expected)
        assert chi2.pvalue > 1e-3, (j, counts, expected)


def test_exact_acceptance_probability():
    """P(accept first draft) = sum_x min(p(x), q(x)) (no sampling error beyond binomial)."""
    rng = np.random.default_rng(7)
    V, B = 5, 80000
    p, q = _random_dists(rng, 2, V), _random_dists(rng, 1, V)
    target = log_softmax(lp(p))
    draft = log_softmax(lp(q))
    dq = mx.broadcast_to(draft[None], (B, 1, V))
    drafts = sample(dq, gumbel(_noise(B, 1, DRAFT, V), V))
    n, _ = verify(mx.broadcast_to(target[None], (B, 2, V)), drafts, dq,
                  gumbel(_noise(B, 2, TARGET, V), V), uniform(_noise(B, 1, ACCEPT, V)))
    alpha = np.minimum(p[0], q[0]).sum()
    rate = np.array(n).mean()
    assert abs(rate - alpha) < 4 * np.sqrt(alpha * (1 - alpha) / B)


def test_noise_is_a_function_of_seed_and_position():
    """The noise of position p does not depend on where the window of positions starts."""
    V = 50
    whole = gumbel(position_keys([5, 6], [0, 0], 6, TARGET), V)
    part = gumbel(position_keys([5, 6], [3, 3], 2, TARGET), V)
    assert mx.array_equal(whole[:, 3:5], part).item()
    assert not mx.array_equal(whole[0], whole[1]).item()  # seeds differ
    other = gumbel(position_keys([5], [0], 6, DRAFT), V)
    assert not mx.allclose(whole[0], other[0]).item()  # streams are independent


@pytest.mark.parametrize("K", [1, 3])
def test_coupled_verify_emits_the_plain_samples_and_follows_target(K):
    """Coupled mode: drafts use the target's own noise and are accepted iff they equal
    its Gumbel-max choice, so every emitted token is the plain sample of its position
    (and therefore ~ p), whatever the draft distribution."""
    rng = np.random.default_rng(K)
    V, B = 6, 40000
    params = SamplingParams(temperature=0.8, top_p=0.9)
    target = filtered_logprobs(log_softmax(lp(_random_dists(rng, K + 1, V))), params)
    draft = filtered_logprobs(log_softmax(lp(_random_dists(rng, K, V))), params)
    tgt = mx.broadcast_to(target[None], (B, K + 1, V))
    g = gumbel(_noise(B, K + 1, TARGET, V), V)
    drafts = sample(mx.broadcast_to(draft[None], (B, K, V)), g[:, :K])
    n, nxt = verify(tgt, drafts, None, g)
    plain = np.array(sample(tgt, g))  # (B, K+1): what plain sampling emits per position
    n, nxt, drafts = np.array(n), np.array(nxt), np.array(drafts)
    assert (nxt == plain[np.arange(B), n]).all()
    for j in range(K):
        reached = n > j
        assert (drafts[reached, j] == plain[reached, j]).all()
    p = np.exp(np.array(target, np.float64))
    for j in range(K + 1):
        counts = np.bincount(plain[:, j], minlength=V)
        support = p[j] > 0
        assert counts[~support].sum() == 0
        assert sps.chisquare(counts[support], p[j][support] / p[j][support].sum() * B).pvalue > 1e-3
    alpha = np.array(n).mean()
    assert 0 < alpha < K  # drafts from another distribution: some accepted, some not


def test_end_to_end_sampling_distribution(tiny_ckpt):
    """Two tokens generated with MTP sampling follow the plain model's joint distribution."""
    from mlx_mtp.models.io.loader import load_model

    V = 8
    # Random weights: spread-out distributions (an oracle trunk would make the joint
    # a point mass) and a head that agrees about half the time.
    model, _ = load_model(Path(tiny_ckpt("qwen3_5", "random", vocab_size=V)))
    prompt = [1, 2, 3, 4, 5]
    # Exact joint distribution of (t1, t2) under plain sampling.
    base = log_softmax(model(mx.array([prompt]))[0, -1])
    p1 = np.exp(np.array(base, np.float64))
    seqs = mx.array([prompt + [a] for a in range(V)])
    p2 = np.exp(np.array(log_softmax(model(seqs)[:, -1]), np.float64))
    joint = (p1[:, None] * p2).ravel()
    joint /= joint.sum()  # float32 softmax: sums to 1 only within ~1e-7
    n_runs = 1000
    seen, accepted, _ = sample_rows(model, prompt, 2, n_runs)  # at temperature 1
    counts = np.zeros(V * V)
    for (a, b), c in seen.items():
        counts[a * V + b] = c
    assert accepted > 100  # drafts were accepted, so the test exercises acceptance
    keep = joint * n_runs >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(joint[keep], joint[~keep].sum()) * n_runs
    assert sps.chisquare(obs, exp).pvalue > 1e-3


def test_top_k_one_sampling_equals_greedy(tiny_ckpt):
    """top_k=1 leaves one token: sampling (with MTP drafts) must give greedy output."""
    from mlx_mtp.models.io.loader import load_model
    from mlx_mtp.decode.speculative import generate_step

    model, _ = load_model(Path(tiny_ckpt("qwen3_5", "noisy", trunk_scale=0.1)))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]

    def run(params, k):
        return [t for t, _, _ in generate_step(prompt, model, num_draft_tokens=k,
                                               sampling=params, max_tokens=12, adaptive=False)]

    greedy = run(SamplingParams(), 0)
    for k in (0, 2):
        assert run(SamplingParams(temperature=0.8, top_k=1, seed=1), k) == greedy, k
