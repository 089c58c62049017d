"""DraftPolicy learns acceptance by context length (issue 38): a long row drafts as deep
as it pays there, a short one keeps its depth.

Synthetic acceptance that falls with context, as vLLM measured for Qwen's MTP (80-91%
near 100 tokens, ~53% at 34k), and step costs that grow with K.
"""

import math
import random
from pathlib import Path

import pytest

from mlx_mtp.decode.policy import DraftPolicy, context_bucket
from mlx_mtp.decode.speculative import MTPDecoder
from mlx_mtp.models.io.loader import load_model

STEP_MS = {0: 10.0, 1: 11.5, 2: 13.5, 3: 15.5}
SHORT_ACCEPT = [0.95, 0.9, 0.9]  # K=3 pays best
LONG_ACCEPT = [0.6, 0.25, 0.2]  # K=1 pays best, plain loses
SHORT, LONG = 600, 40_000


def best_k(accept):
    def rate(k):
        return sum(math.prod(accept[:j]) for j in range(k + 1)) / STEP_MS[k]
    return max(range(4), key=rate)


def run(policy, context, accept, steps, rng):
    """``steps`` steps of one sequence at about ``context`` tokens (a turn within one
    bucket); the K's chosen."""
    ks = []
    for _ in range(steps):
        k = policy.choose(1, 3, contexts=[context])
        n = 0
        while n < k and rng.random() < accept[n]:
            n += 1
        policy.record_step(1, k, STEP_MS[k] * math.exp(rng.gauss(0, 0.05)) / 1e3, [n],
                           contexts=[context])
        ks.append(k)
    return ks


def test_the_synthetic_acceptance_asks_for_different_depths():
    assert best_k(SHORT_ACCEPT) == 3 and best_k(LONG_ACCEPT) == 1


def test_context_buckets_are_log2_above_1k():
    assert [context_bucket(n) for n in (0, 1023, 1024, 2047, 2048, 40_000)] == [0, 0, 1, 1, 2, 6]


@pytest.mark.parametrize("seed", range(8))
def test_a_long_turn_drafts_shallower_and_a_short_one_keeps_its_k(seed):
    rng = random.Random(seed)
    policy = DraftPolicy()
    short = run(policy, SHORT, SHORT_ACCEPT, 300, rng)
    assert short[-100:].count(3) > 90
    long = run(policy, LONG, LONG_ACCEPT, 400, rng)
    assert long[-150:].count(1) > 120 and long[-150:].count(3) < 10
    # Back to a short row: its own bucket still says K=3, whatever the long turn learned.
    assert run(policy, SHORT, SHORT_ACCEPT, 100, rng)[-50:].count(3) > 45
    assert policy.by_context.estimate(LONG).alpha[0] < 0.75
    assert policy.by_context.estimate(SHORT).alpha[0] > 0.85


def test_a_new_bucket_starts_from_its_nearest_neighbour():
    policy = DraftPolicy()
    assert policy.by_context.estimate(SHORT) is policy.acceptance  # nothing recorded yet
    for _ in range(200):
        policy.record_step(1, 3, 0.016, [1], contexts=[SHORT])  # position 2 always fails
    near = policy.by_context.estimate(4_000)  # unrecorded: reads its neighbour
    assert near is policy.by_context.estimate(SHORT) and near.alpha[1] < 0.05
    policy.record_step(1, 3, 0.016, [3], contexts=[4_000])  # one full hit at 4k
    fresh = policy.by_context.estimate(4_000)
    assert fresh is not near
    # Its prior (worth 3 steps) is the neighbour's: one hit lifts position 2 to ~1/4.
    assert 0.2 < fresh.alpha[1] < 0.3 and fresh.alpha[0] > 0.95


def test_rows_of_one_batch_record_into_their_own_buckets():
    policy = DraftPolicy()
    for _ in range(100):
        policy.record_step(2, 2, 0.02, [2, 0], contexts=[SHORT, LONG])
    assert policy.by_context.estimate(SHORT).alpha[0] > 0.95
    assert policy.by_context.estimate(LONG).alpha[0] < 0.05
    assert 0.4 < policy.acceptance.alpha[0] < 0.6  # every row alike: the mean
    both = policy.by_context.expected_tokens(2, [SHORT, LONG])
    assert both == pytest.approx((policy.by_context.estimate(SHORT).expected_tokens(2)
                                  + policy.by_context.estimate(LONG).expected_tokens(2)) / 2)


@pytest.mark.parametrize("seed", range(4))
def test_drafting_pauses_where_it_never_pays_and_only_there(seed):
    """At 40k tokens the head's drafts almost never land: plain steps there (a re-check
    now and then), while a short row keeps K=3."""
    rng = random.Random(seed)
    policy = DraftPolicy()
    run(policy, SHORT, SHORT_ACCEPT, 300, rng)
    long = run(policy, LONG, [0.05, 0.05, 0.05], 300, rng)
    assert sum(k > 0 for k in long[-200:]) <= 12
    assert run(policy, SHORT, SHORT_ACCEPT, 100, rng)[-50:].count(3) > 45


def test_the_decoder_records_each_step_by_the_row_context(tiny_ckpt):
    """``BatchDecoder`` (under ``MTPDecoder``) hands the policy each row's context length:
    a 1,500-token prompt's steps land in the 1k-2k bucket, none elsewhere."""
    model, _ = load_model(Path(tiny_ckpt("qwen3_5", "oracle", trunk_scale=0.1)))
    dec = MTPDecoder(model, 2, adaptive=True, prefill_step_size=512)
    dec.prefill([(7 * j + 3) % 500 for j in range(1500)])
    for _ in range(12):
        dec.step()
    assert list(dec.policy.by_context.buckets) == [context_bucket(1500)] == [1]
    bucket = dec.policy.by_context.buckets[1]
    assert bucket.trials[0] > 0  # it drafted
    assert bucket.trials[0] == pytest.approx(dec.policy.acceptance.trials[0])  # every step
