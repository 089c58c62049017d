"""DraftPolicy against simulated step costs: drafting must pay where it can and never lose.

Two cost shapes bracket real hardware: "linear" (every extra row costs as much as
the first: the reference BLAS of MLX's Linux CPU wheel) and "flat" (extra rows
are almost free: Apple GPUs, a good BLAS). Timings get 10% log-normal noise.
"""

import math
import random

import pytest

from mlx_mtp.draft_policy import DraftPolicy, StepCosts


def linear_cost(B, K):  # ms
    return 8 + 4 * B * (K + 1) + 0.5 * K * B


def flat_cost(B, K):
    return 10 + 0.2 * B * (K + 1) + 1.0 * K


def simulate(policy, cost, accept_p, batch_sizes, seed=0):
    """Run the policy for one step per entry of ``batch_sizes``; returns tokens/ms and K's."""
    rng = random.Random(seed)
    tokens = elapsed = 0.0
    ks = []
    for B in batch_sizes:
        k = policy.choose(B)
        t = cost(B, k) * math.exp(rng.gauss(0, 0.1))
        accepted = []
        for _ in range(B):
            n = 0
            while n < k and rng.random() < accept_p:
                n += 1
            accepted.append(n)
        tokens += sum(n + 1 for n in accepted)
        elapsed += t
        policy.record_step(B, k, t / 1e3, accepted)
        ks.append(k)
    return tokens / elapsed, ks


def plain_rate(cost, batch_sizes):
    return sum(batch_sizes) / sum(cost(B, 0) for B in batch_sizes)


def varying_batch(n=3000, seed=1):
    rng = random.Random(seed)
    B, out = 1, []
    for _ in range(n):
        B = min(16, max(1, B + rng.choice((-1, 0, 0, 0, 1))))
        out.append(B)
    return out


@pytest.mark.parametrize("cost", [linear_cost, flat_cost])
@pytest.mark.parametrize("accept_p", [0.0, 0.5, 1.0])
def test_never_loses_to_plain_decoding(cost, accept_p):
    sizes = varying_batch()
    rate, ks = simulate(DraftPolicy(3), cost, accept_p, sizes)
    assert rate >= 0.97 * plain_rate(cost, sizes)
    if accept_p == 0.0:
        assert sum(k > 0 for k in ks) / len(ks) < 0.03  # drafting paused, probes rare


def test_pays_where_drafting_is_cheap():
    sizes = varying_batch()
    rate, ks = simulate(DraftPolicy(3), flat_cost, 1.0, sizes)
    always_k3 = 4 * sum(sizes) / sum(flat_cost(B, 3) for B in sizes)
    assert rate >= 0.93 * always_k3 and always_k3 > 2 * plain_rate(flat_cost, sizes)
    assert sum(k == 3 for k in ks[500:]) / len(ks[500:]) > 0.95


def test_linear_costs_draft_alone_but_not_in_a_big_batch():
    policy = DraftPolicy(3)
    simulate(policy, linear_cost, 1.0, [1] * 200 + [2] * 200 + [16] * 400)
    assert policy.choose(1) == 3
    # At 16 rows the fit predicts drafting loses: no K > 0 steps late in the run.
    _, ks = simulate(policy, linear_cost, 1.0, [16] * 200, seed=3)
    assert set(ks) == {0}


def test_fit_extrapolates_to_unseen_batch_sizes():
    costs = StepCosts()
    for B in (1, 2, 3):
        for K in range(4):
            for _ in range(5):
                costs.observe(B, K, linear_cost(B, K))
    for B, K in [(8, 0), (8, 3), (16, 1)]:
        assert costs.predict(B, K) == pytest.approx(linear_cost(B, K), rel=1e-6)
    assert costs.measured(8, 0) is None


def test_without_data_plain_first_then_explores_one_step():
    policy = DraftPolicy(2)
    assert policy.choose(4) == 0  # plain cost unknown at this batch size
    policy.record_step(4, 0, 0.05)
    assert policy.choose(4) == 1  # prior acceptance 0.7: try one step of K=1
    assert policy.would_draft(4)


def test_fixed_k_and_no_mtp():
    assert DraftPolicy(3, adaptive=False).choose(8) == 3
    assert DraftPolicy(0).choose(1) == 0
    assert not DraftPolicy(0).would_draft(1)


def test_acceptance_is_per_position_and_forgets():
    policy = DraftPolicy(2)
    for _ in range(50):
        policy.record_step(2, 2, 0.01, [1, 1])  # position 1 always, position 2 never
    a1, a2 = policy.alpha
    assert a1 > 0.98 and a2 < 0.02
    assert policy.expected_tokens(2) == pytest.approx(1 + a1 + a1 * a2)
    for _ in range(50):
        policy.record_step(2, 2, 0.01, [2, 2])
    assert policy.alpha[1] > 0.98
