"""Deterministic proposals (context drafts) verified in index form (``sampling.verify``
with ``deterministic``): no one-hot q is built, and the emitted tokens still follow the
target exactly, in rows mixing head drafts (a real q) and context drafts."""

from functools import cache

import mlx.core as mx
import numpy as np
import pytest
from scipy import stats as sps

from mlx_mtp.decode.noise import ACCEPT, DRAFT, TARGET, gumbel, position_keys, uniform
from mlx_mtp.decode.sampling import log_softmax, sample, verify


@cache  # keys are a Python loop over rows: built once per shape, shared by the parametrizations
def _noise(B, count, stream):
    return position_keys(range(B), [0] * B, count, stream)


def _dists(rng, rows, V):
    return rng.dirichlet(np.ones(V) * 1.5, size=rows).astype(np.float32)


def _emitted(n, nxt, drafts, j):
    """Token emitted at position j by each row that reached it."""
    reached = n >= j
    out = np.where(n[reached] > j, drafts[reached, min(j, drafts.shape[1] - 1)], nxt[reached])
    return reached, out


@pytest.mark.parametrize("layout", ["context", "context_then_head", "mixed_rows"])
def test_deterministic_proposals_keep_the_target_distribution(layout):
    """Per position, given it is reached, the emitted token ~ p_j. Context drafts are
    fixed tokens, chosen among the likely ones (accepted often, rejected often: a
    rejection is recovered from p without the draft)."""
    rng = np.random.default_rng({"context": 1, "context_then_head": 2, "mixed_rows": 3}[layout])
    V, K, B = 6, 3, 60000
    p = _dists(rng, K + 1, V)
    target = log_softmax(mx.log(mx.array(p)))
    tgt = mx.broadcast_to(target[None], (B, K + 1, V))
    likely = [int(np.argsort(p[j])[-2]) for j in range(K)]  # second most likely: ~p < 1/2
    fixed_drafts = mx.broadcast_to(mx.array(likely, mx.uint32)[None], (B, K))
    if layout == "context":  # every position a context draft, no head pass (J = 0)
        q, det, drafts = None, None, fixed_drafts
    else:
        J = 2
        qd = log_softmax(mx.log(mx.array(_dists(rng, J, V))))
        q = mx.broadcast_to(qd[None], (B, J, V))
        head = sample(q, gumbel(_noise(B, J, DRAFT), V)).astype(mx.uint32)
        if layout == "context_then_head":  # one context draft, the head after it, the
            det = mx.broadcast_to(mx.array([[True, False, True]]), (B, K))  # context again
        else:  # even rows: head drafts then a context draft; odd rows: context drafts only
            odd = (mx.arange(B) % 2 == 1)[:, None]
            det = mx.concatenate([mx.broadcast_to(odd, (B, J)), mx.ones((B, 1), mx.bool_)], 1)
        drafts = mx.where(det, fixed_drafts, mx.concatenate([head, fixed_drafts[:, J:]], 1))
    n, nxt = verify(tgt, drafts, q, gumbel(_noise(B, K + 1, TARGET), V),
                    uniform(_noise(B, K, ACCEPT)), deterministic=det)
    n, nxt, drafts = np.array(n), np.array(nxt), np.array(drafts)
    pd = p.astype(np.float64)
    for j in range(K + 1):
        reached, out = _emitted(n, nxt, drafts, j)
        counts = np.bincount(out, minlength=V)
        expected = pd[j] / pd[j].sum() * reached.sum()
        assert sps.chisquare(counts, expected).pvalue > 1e-3, (layout, j, counts, expected)
    if layout == "context":  # P(accept a context draft) = p(d), and rejections happen
        rate = (n >= 1).mean()
        a = pd[0, likely[0]]
        assert abs(rate - a) < 4 * np.sqrt(a * (1 - a) / B) and 0.05 < rate < 0.95


def test_a_rejected_context_draft_is_never_emitted_at_its_position():
    """p without d: the recovered token at a rejected context draft is never d."""
    V, B = 5, 20000
    p = np.array([[0.4, 0.3, 0.2, 0.05, 0.05]] * 2, np.float32)
    target = mx.broadcast_to(log_softmax(mx.log(mx.array(p)))[None], (B, 2, V))
    drafts = mx.zeros((B, 1), mx.uint32)  # token 0, p = 0.4
    n, nxt = verify(target, drafts, None, gumbel(_noise(B, 2, TARGET), V),
                    uniform(_noise(B, 1, ACCEPT)), deterministic=mx.ones((B, 1), mx.bool_))
    n, nxt = np.array(n), np.array(nxt)
    rejected = nxt[n == 0]
    assert len(rejected) > 0.5 * B and (rejected != 0).all()
    counts = np.bincount(rejected, minlength=V)[1:]
    rest = p[0, 1:].astype(np.float64) / p[0, 1:].astype(np.float64).sum() * len(rejected)
    assert sps.chisquare(counts, rest).pvalue > 1e-3
