"""Chunked Gated DeltaNet vs the per-token reference (mlx_lm gated_delta_ops)."""

from functools import partial

import mlx.core as mx
import pytest
from mlx_lm.models.gated_delta import gated_delta_ops

from mlx_mtp.models.kernels.gated_delta_chunked import gated_delta_chunked
from mlx_mtp.testing.kernels import random_gated_delta_inputs as _random_inputs

TOL = 1e-4


def _inputs(B=2, T=37, Hk=2, Hv=4, Dk=32, Dv=16, seed=0, dtype=mx.float32):
    return _random_inputs(B, T, Hk, Hv, Dk, Dv, seed=seed, dtype=dtype)


def _state(B=2, Hv=4, Dv=16, Dk=32, seed=1):
    return 0.5 * mx.random.normal((B, Hv, Dv, Dk), key=mx.random.key(seed))


def _assert_close(x, ref, tol=TOL, where=None):
    """max |x - ref| <= tol * max(1, max |ref|), optionally only where mask."""
    x, ref = x.astype(mx.float32), ref.astype(mx.float32)
    if where is not None:
        x = mx.where(where, x, 0.0)
        ref = mx.where(where, ref, 0.0)
    assert x.shape == ref.shape
    scale = max(1.0, mx.abs(ref).max().item())
    err = mx.abs(x - ref).max().item()
    assert err <= tol * scale, f"max abs err {err:.3g} > {tol:.1g} * {scale:.3g}"


@pytest.mark.parametrize(
    "T,chunk",
    [(1, 8), (7, 8), (37, 8), (37, 16), (100, 16), (100, 64), (64, 64), (37, 64)],
)
@pytest.mark.parametrize("with_state", [False, True])
def test_matches_reference(T, chunk, with_state):
    q, k, v, g, beta = _inputs(T=T, seed=T)
    state = _state() if with_state else None
    y_ref, s_ref = gated_delta_ops(q, k, v, g, beta, state)
    y, s = gated_delta_chunked(q, k, v, g, beta, state, chunk_size=chunk)
    assert y.dtype == q.dtype and s.dtype == mx.float32
    _assert_close(y, y_ref)
    _assert_close(s, s_ref)


@pytest.mark.parametrize("Hk,Hv", [(4, 4), (2, 4), (1, 4)])
def test_gqa(Hk, Hv):
    q, k, v, g, beta = _inputs(T=29, Hk=Hk, Hv=Hv)
    state = _state(Hv=Hv)
    y_ref, s_ref = gated_delta_ops(q, k, v, g, beta, state)
    y, s = gated_delta_chunked(q, k, v, g, beta, state, chunk_size=8)
    _assert_close(y, y_ref)
    _assert_close(s, s_ref)


@pytest.mark.parametrize("chunk", [8, 16, 64])
def test_mask(chunk):
    T = 37
    q, k, v, g, beta = _inputs(T=T, seed=3)
    state = _state()
    pos = mx.arange(T)[None]
    # Row 0 left-padded by 5; row 1 has holes in the middle and at the end.
    mask = mx.concatenate([pos >= 5, (pos % 7 != 3) & (pos < T - 2)])  # [2, T]
    y_ref, s_ref = gated_delta_ops(q, k, v, g, beta, state, mask)
    y, s = gated_delta_chunked(q, k, v, g, beta, state, mask, chunk_size=chunk)
    _assert_close(y, y_ref, where=mask[..., None, None])
    _assert_close(s, s_ref)
    # Masked positions output zero, like the Metal kernel.
    assert mx.all(mx.where(mask[..., None, None], 0.0, y) == 0).item()


def test_fully_masked_row_keeps_state():
    q, k, v, g, beta = _inputs(T=20)
    state = _state()
    mask = mx.array([[False] * 20, [True] * 20])
    _, s = gated_delta_chunked(q, k, v, g, beta, state, mask, chunk_size=8)
    _assert_close(s[0], state[0], tol=1e-6)


def test_masked_left_padding_equals_unpadded():
    # A left-padded row must give the same outputs/state as the unpadded one.
    q, k, v, g, beta = _inputs(B=1, T=30, seed=5)
    pad = 6
    padded = [mx.pad(x, [(0, 0), (pad, 0), (0, 0), (0, 0)]) for x in (q, k, v)]
    g_p = mx.pad(g, [(0, 0), (pad, 0), (0, 0)], constant_values=0.5)
    b_p = mx.pad(beta, [(0, 0), (pad, 0), (0, 0)], constant_values=0.5)
    mask = mx.arange(30 + pad)[None] >= pad
    y, s = gated_delta_chunked(q, k, v, g, beta, chunk_size=16)
    y_p, s_p = gated_delta_chunked(*padded, g_p, b_p, mask=mask, chunk_size=16)
    _assert_close(y_p[:, pad:], y)
    _assert_close(s_p, s)


def test_bf16_inputs():
    q, k, v, g, beta = _inputs(T=45, dtype=mx.bfloat16)
    g, beta = g.astype(mx.bfloat16), beta.astype(mx.bfloat16)
    state = _state()
    y_ref, s_ref = gated_delta_ops(q, k, v, g, beta, state)
    y, s = gated_delta_chunked(q, k, v, g, beta, state, chunk_size=16)
    assert y.dtype == mx.bfloat16 and s.dtype == mx.float32
    # Reference and chunked both accumulate in float32; outputs are rounded
    # to bf16, so allow a few bf16 ulps.
    _assert_close(y, y_ref, tol=2e-2)
    _assert_close(s, s_ref, tol=1e-3)


def test_extreme_gates_and_degenerate_keys():
    # Identical keys with beta = 1 make the intra-chunk system as
    # ill-conditioned as it gets; g spans exact 1 down to exact 0.
    q, k, v, g, beta = _inputs(T=40, seed=7)
    k = mx.broadcast_to(k[:, :1], k.shape)
    beta = mx.ones_like(beta)
    u = mx.random.uniform(shape=g.shape, key=mx.random.key(9))
    g = mx.where(u < 0.3, 1.0, mx.where(u < 0.4, 0.0, mx.where(u < 0.5, 1e-30, g)))
    state = _state()
    y_ref, s_ref = gated_delta_ops(q, k, v, g, beta, state)
    y, s = gated_delta_chunked(q, k, v, g, beta, state, chunk_size=16)
    _assert_close(y, y_ref)
    _assert_close(s, s_ref)


def test_chunk_size_invariance_long():
    q, k, v, g, beta = _inputs(B=1, T=300, Hk=2, Hv=4, Dk=16, Dv=16, seed=11)
    state = _state(B=1, Dv=16, Dk=16)
    y8, s8 = gated_delta_chunked(q, k, v, g, beta, state, chunk_size=8)
    for chunk in (16, 64, 128):
        y, s = gated_delta_chunked(q, k, v, g, beta, state, chunk_size=chunk)
        _assert_close(y, y8)
        _assert_close(s, s8)


def test_empty_sequence():
    q, k, v, g, beta = _inputs(T=0)
    state = _state()
    y, s = gated_delta_chunked(q, k, v, g, beta, state)
    assert y.shape == (2, 0, 4, 16)
    _assert_close(s, state, tol=0.0)


def test_compile():
    q, k, v, g, beta = _inputs(T=33)
    fn = mx.compile(partial(gated_delta_chunked, chunk_size=16))
    y_ref, s_ref = gated_delta_ops(q, k, v, g, beta)
    y, s = fn(q, k, v, g, beta)
    _assert_close(y, y_ref)
    _assert_close(s, s_ref)


def _loss(fn, mask):
    # Nonlinear in y and uses the final state, so every cotangent path
    # (outputs, deltas, carried state) is exercised.
    def loss(q, k, v, g, beta, state):
        y, s = fn(q, k, v, g, beta, state, mask)
        if mask is not None:
            y = mx.where(mask[..., None, None], y, 0.0)
        return (mx.sin(3.0 * y) * y).sum() + 0.3 * (s * s).sum() + s.sum()

    return mx.grad(loss, argnums=(0, 1, 2, 3, 4, 5))


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("chunk", [4, 16])
def test_gradients_match_reference(masked, chunk):
    T = 21
    q, k, v, g, beta = _inputs(T=T, seed=13)
    state = _state()
    mask = (mx.arange(T)[None] >= mx.array([[4], [0]])) if masked else None
    grads_ref = _loss(gated_delta_ops, mask)(q, k, v, g, beta, state)
    grads = _loss(partial(gated_delta_chunked, chunk_size=chunk), mask)(
        q, k, v, g, beta, state
    )
    for name, gc, gr in zip(("q", "k", "v", "g", "beta", "state"), grads, grads_ref):
        assert gc.shape == gr.shape, name
        _assert_close(gc, gr, tol=2e-4)


def test_gradients_through_compile():
    q, k, v, g, beta = _inputs(T=19, seed=17)
    state = _state()
    fn = mx.compile(partial(gated_delta_chunked, chunk_size=8))
    grads = mx.compile(_loss(fn, None))(q, k, v, g, beta, state)
    grads_ref = _loss(gated_delta_ops, None)(q, k, v, g, beta, state)
    for gc, gr in zip(grads, grads_ref):
        _assert_close(gc, gr, tol=2e-4)
