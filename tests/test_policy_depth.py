"""Issue 40: the adaptive K policy goes as deep as pays with a head that keeps being right,
and a head that is never right costs a few drafts from a fresh policy.

A fresh policy here is what a new process has: step costs known (stored or calibrated,
injected and frozen so nothing depends on this machine's speed), no acceptance. The
tables are step costs in plain steps: the issue's hidden-1024 checkpoint as measured
(``ORACLE_MS``) and the real 0.8B shape, ``c_verify(K) + K * c_draft`` with
c_verify(3) = 1.2 and a draft-vocabulary draft of 0.09 plain steps.
"""

import math
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step as mlx_lm_generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model

from mlx_mtp.decode.policy import DraftPolicy
from mlx_mtp.decode.speculative import MTPDecoder
from mlx_mtp.models.io.loader import load_model

ORACLE_MS = {0: 33.0, 1: 46.0, 2: 60.0, 3: 75.0}
REAL_SHAPE = {k: 1.0 + 0.2 * k / 3 + 0.09 * k for k in range(4)}
TABLES = {"hidden-1024": ORACLE_MS, "real-shape": REAL_SHAPE}


def fresh_policy(table) -> DraftPolicy:
    """A policy that knows the step costs (``table``, seconds up to scale) and nothing
    else; the costs stay as given."""
    policy = DraftPolicy()
    for _ in range(3):
        for k, t in table.items():
            policy.costs.observe(1, k, k, t / 1e3)
    policy.costs.observe = lambda *a, **kw: None
    return policy


def drive(policy, table, lands, tokens):
    """One sequence until ``tokens`` are emitted; ``lands(i, j)``: whether the draft at
    position j of step i is accepted. Returns the K's and the speedup over plain steps."""
    ks, emitted, spent = [], 0, 0.0
    while emitted < tokens:
        k = policy.choose(1, 3)
        n = 0
        while n < k and lands(len(ks), n):
            n += 1
        policy.record_step(1, k, table[k] / 1e3, [n])
        ks.append(k)
        emitted += n + 1
        spent += table[k]
    return ks, emitted * table[0] / spent


def fixed_speedup(table, k, accept=1.0):
    return sum(accept ** j for j in range(k + 1)) * table[0] / table[k]


@pytest.mark.parametrize("name", TABLES)
def test_an_always_right_head_reaches_the_deepest_k_that_pays(name):
    """Depth pays on both tables (fixed K=3 beats K=2). With a flat prior on positions it
    had not drafted, the policy stayed at K=2 on the hidden-1024 table for good (the
    issue's run: mean accepted length 3.00, 100 % accepted); each depth now reads as the
    deepest drafted until observed."""
    table = TABLES[name]
    assert max(range(4), key=lambda k: fixed_speedup(table, k)) == 3
    ks, speedup = drive(fresh_policy(table), table, lambda i, j: True, 128)
    assert 3 in ks[:4]  # K=1, then one position deeper per step that lands
    assert ks[3:].count(3) == len(ks) - 3
    assert speedup >= 0.95 * fixed_speedup(table, 3)


@pytest.mark.parametrize("name", TABLES)
def test_a_never_right_head_makes_a_few_drafts_from_a_fresh_policy(name):
    """It drafted 9 (hidden-1024) and 25 (real shape: drafts are cheap, so its upper
    estimate stayed above break-even for a dozen misses, and the prior drafted K=3 first)
    tokens in 128 tokens, 0.95x plain decoding in the first 64 at the real shape. Now: one position at a time until a draft lands, a pause after
    three dry steps, then the re-checks (the first soon, for a good head paused by bad
    luck: ``test_policy_exploration``), whatever a draft costs."""
    table = TABLES[name]
    ks, speedup = drive(fresh_policy(table), table, lambda i, j: False, 128)
    assert sum(ks) <= 9 and max(ks) == 1 and ks[:4] == [1, 1, 1, 0]
    ks64, speedup64 = drive(fresh_policy(table), table, lambda i, j: False, 64)
    # The target at the real shape; a K=1 step costs 0.39 plain steps more at
    # hidden 1024 (0.16 at the real shape), so the same drafts cost more there.
    assert sum(ks64) <= 7 and speedup64 >= {"hidden-1024": 0.95, "real-shape": 0.97}[name]


@pytest.mark.parametrize("name", TABLES)
def test_a_head_right_two_times_in_three_drafts_as_deep_as_pays(name):
    """A ~65 % head (every third draft at each position rejected, deterministically):
    within 5 % of the best fixed K over 256 tokens (the issue's target), from a fresh policy."""
    table = TABLES[name]

    def lands(i, j):
        return (i + 2 * j) % 3 != 2

    def fixed(k):
        """Fixed K on the same stream (accepted count of step i when drafting k)."""
        spent = emitted = 0.0
        i = 0
        while emitted < 256:
            n = 0
            while n < k and lands(i, n):
                n += 1
            emitted += n + 1
            spent += table[k]
            i += 1
        return emitted * table[0] / spent

    _, speedup = drive(fresh_policy(table), table, lands, 256)
    assert speedup >= 0.95 * max(fixed(k) for k in range(4))


# Measured at the real shape once plain steps ran as sgemv (idle Xeon, issue 40): a verify
# pass costs c_verify(1/2/3) = 1.88 / 2.57 / 2.99 plain steps, so K=1 cannot pay even when
# every draft lands (2 / 1.97 tokens per plain step) and K=3 can (4 / 3.26).
DEAR_VERIFY = {k: c + 0.09 * k for k, c in {0: 1.0, 1: 1.88, 2: 2.57, 3: 2.99}.items()}


def test_where_only_deep_drafts_pay_an_always_right_head_climbs_to_them():
    """The policy paused there (54 of 68 steps plain with a head right every time): K=1
    re-checks never showed a step that pays. Re-checks now go one position past what
    landed, where K=1 alone cannot pay."""
    table = DEAR_VERIFY
    assert fixed_speedup(table, 1) < 1.05 < fixed_speedup(table, 3)
    ks, speedup = drive(fresh_policy(table), table, lambda i, j: True, 256)
    assert ks.index(3) < 24 and ks[24:].count(3) == len(ks) - 24
    assert speedup >= 0.97 * fixed_speedup(table, 3)
    _, speedup64 = drive(fresh_policy(table), table, lambda i, j: True, 64)
    assert speedup64 >= 0.9 * fixed_speedup(table, 3)


def test_where_only_deep_drafts_pay_a_never_right_head_costs_little():
    """Its re-checks stay at one position and come later: each costs ~1 plain step."""
    table = DEAR_VERIFY
    ks, speedup = drive(fresh_policy(table), table, lambda i, j: False, 64)
    assert max(ks) == 1 and sum(ks) <= 2 and speedup >= 0.97


# -- end to end: the decoder on tiny checkpoints, greedy output unchanged -------------------

def greedy(path, policy, prompt, n):
    model, _ = load_model(Path(path))
    dec = MTPDecoder(model, 3, policy=policy)
    dec.prefill(prompt)
    got, ks = [], []
    while len(got) < n:
        out = dec.step()
        got += out.tokens
        ks.append(out.num_drafted)
    ref_model, _ = mlx_lm_load_model(Path(path))
    ref = [int(t) for t, _ in mlx_lm_generate_step(mx.array(prompt), ref_model, max_tokens=n)]
    assert got[:n] == ref
    return ks


def test_the_decoder_drafts_deep_with_an_oracle_head_and_little_with_a_random_one(tiny_ckpt):
    prompt = [3, 14, 15, 92, 65, 35, 89, 79]
    ks = greedy(tiny_ckpt("qwen3_5", "oracle", trunk_scale=0.1), fresh_policy(ORACLE_MS),
                prompt, 64)
    assert 3 in ks[:4] and ks[4:].count(3) >= len(ks[4:]) - 1
    ks = greedy(tiny_ckpt("qwen3_5", "random"), fresh_policy(ORACLE_MS), prompt, 128)
    assert sum(ks) <= 8
    assert math.isclose(len(ks), 128, abs_tol=8)  # (nearly) every step emitted one token
