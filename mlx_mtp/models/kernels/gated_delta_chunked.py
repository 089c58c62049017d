"""Chunked (matmul-form) Gated DeltaNet recurrence for prefill and training.

The per-token recurrence (``mlx_lm.models.gated_delta.gated_delta_ops``) is

    S_t = g_t S_{t-1}
    S_t = S_t + beta_t (v_t - S_t k_t) k_t^T
    y_t = S_t q_t

with S of shape [Dv, Dk]. Writing M = S^T and delta_t for the value actually
written at step t, M_t = g_t M_{t-1} + k_t delta_t^T. Within a chunk of C tokens
with a_t = sum_{s<=t} log g_s and Gamma_t = exp(a_t), unrolling from the chunk's
initial state M0 gives the lower-triangular system

    (I + A) Delta = diag(beta) (V - diag(Gamma) K M0),
    A[t, s] = beta_t exp(a_t - a_s) k_t.k_s   for s < t,

so with T = (I + A)^-1 (the "UT transform"):

    W = T diag(beta Gamma) K,   U = T diag(beta) V,   Delta = U - W M0
    Y = diag(Gamma) Q M0 + (Q K^T o D) Delta,          D[t, s] = exp(a_t - a_s), s <= t
    M_C = Gamma_C M0 + K^T diag(exp(a_C - a_s)) Delta.

Everything except the state hand-off between chunks (Delta and M_C, two small
matmuls per chunk) is batched over all chunks. On a CPU the cost is dominated
by matmul flops, ~(4 C Dk + 3 Dk Dv) multiply-adds per token and head, which
is why the default chunk is smaller than the 64 used by GPU kernels.
"""

from typing import Optional, Tuple

import mlx.core as mx
import numpy as np

# MLX's Linux CPU wheel links the reference BLAS (a few GFLOP/s), so the
# O(C) per-token matmul work is not free; on a 2-core x86 CPU 16 was as fast
# as 8 and faster than 32 and 64, forward and backward. A fast BLAS or a GPU
# favours larger chunks.
DEFAULT_CHUNK_SIZE = 16
_TINY = float(np.finfo(np.float32).tiny)


@mx.custom_function
def _unit_lower_inverse(a: mx.array) -> mx.array:
    """(I + a)^-1 for strictly lower-triangular ``a`` (batched over leading axes).

    LAPACK's triangular inverse is several times faster on CPU than anything
    built from MLX matmuls, but MLX has no VJP for it (and it only runs on the
    CPU stream), hence the custom VJP below.
    """
    eye = mx.eye(a.shape[-1], dtype=a.dtype)
    return mx.linalg.tri_inv(a + eye, upper=False, stream=mx.cpu)


@_unit_lower_inverse.vjp
def _unit_lower_inverse_vjp(primals, cotangent, output):
    # d(X^-1) = -X^-1 dX X^-1; only the strictly-lower part of a is free.
    t_inv = output.swapaxes(-1, -2)
    return mx.tril(-(t_inv @ cotangent @ t_inv), k=-1)


@mx.custom_function
def _chunk_scan(wq, u, kd_t, gamma_last, m0):
    """Sequential state hand-off between chunks.

    Per chunk n (leading axis), with M the chunk's initial state [Dk, Dv]:
        X = wq[n] @ M,  Delta = u[n] - X[:C],  Y_inter = X[C:]
        M <- gamma_last[n] * M + kd_t[n] @ Delta
    where wq[n] stacks W on top of diag(Gamma) Q. Returns (Y_inter, Delta)
    stacked over chunks and the final state.

    The VJP is written by hand: autodiff through a python loop that indexes
    per-chunk operands produces a full-size scatter per chunk (quadratic in
    the number of chunks), while the reverse scan below is linear and does
    everything that does not depend on the carried cotangent batched.
    """
    C = u.shape[-2]
    m = m0
    ys, deltas = [], []
    for n in range(wq.shape[0]):
        x = wq[n] @ m
        delta = u[n] - x[..., :C, :]
        ys.append(x[..., C:, :])
        deltas.append(delta)
        m = gamma_last[n] * m + kd_t[n] @ delta
    return mx.stack(ys), mx.stack(deltas), m


@_chunk_scan.vjp
def _chunk_scan_vjp(primals, cotangents, outputs):
    wq, u, kd_t, gamma_last, m0 = primals
    d_y, d_delta_out, d_m = cotangents
    deltas = outputs[1]
    N, C = wq.shape[0], u.shape[-2]
    w_t = wq[..., :C, :].swapaxes(-1, -2)  # W^T, [N, ..., Dk, C]
    k_d = kd_t.swapaxes(-1, -2)  # [N, ..., C, Dk]

    # Chunk-initial states are recomputed (one matmul per chunk) rather than
    # kept by the forward, so inference does not pay for storing them.
    states = [m0]
    for n in range(N - 1):
        states.append(gamma_last[n] * states[-1] + kd_t[n] @ deltas[n])
    states = mx.stack(states)

    # Contribution of Y_inter to dM does not depend on the carry: batch it.
    d_m_from_y = wq[..., C:, :].swapaxes(-1, -2) @ d_y  # [N, ..., Dk, Dv]
    d_m_next = [None] * N  # cotangent of each chunk's final state
    d_delta = [None] * N
    for n in reversed(range(N)):
        d_m_next[n] = d_m
        d_delta[n] = d_delta_out[n] + k_d[n] @ d_m
        d_m = gamma_last[n] * d_m - w_t[n] @ d_delta[n] + d_m_from_y[n]
    d_m_next = mx.stack(d_m_next)
    d_delta = mx.stack(d_delta)

    d_x = mx.concatenate([-d_delta, d_y], axis=-2)
    d_wq = d_x @ states.swapaxes(-1, -2)
    d_kd_t = d_m_next @ deltas.swapaxes(-1, -2)
    d_gamma_last = (d_m_next * states).sum(axis=(-2, -1), keepdims=True)
    return d_wq, d_delta, d_kd_t, d_gamma_last, d_m


def _to_chunks(x: mx.array, n_chunks: int, chunk: int) -> mx.array:
    """[B, T_pad, H, ...] -> [N, B, H, C, ...] (chunk axis leading so the
    sequential loop slices contiguous blocks)."""
    B, _, H = x.shape[:3]
    x = x.reshape(B, n_chunks, chunk, H, *x.shape[3:])
    return mx.moveaxis(mx.moveaxis(x, 1, 0), 3, 2)


def _check(q, v, g, chunk_size):
    Hk, Hv = q.shape[2], v.shape[2]
    if g.ndim != 3:
        raise ValueError("gated_delta_chunked supports scalar gating g: [B, T, Hv]")
    if Hv % Hk:
        raise ValueError(f"Hv={Hv} must be a multiple of Hk={Hk}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")


def _chunked_inputs(q, k, v, g, beta, mask, C: int):
    """float32 inputs padded to whole chunks of ``C`` and laid out per chunk and group:
    q, k [N, B, Hk, 1, C, Dk]; v [N, B, Hk, R, C, Dv]; log g, beta [N, B, Hk, R, C]."""
    B, T, Hk, _ = q.shape
    R = v.shape[2] // Hk
    f32 = mx.float32
    q, k, v = q.astype(f32), k.astype(f32), v.astype(f32)
    # g == 0 can come out of an underflowing exp; flooring it at the smallest
    # normal float keeps log finite while the decay is still numerically zero.
    log_g = mx.log(mx.maximum(g.astype(f32), _TINY))
    beta = beta.astype(f32)
    if mask is not None:
        # beta = 0 and g = 1 make a step the identity on the state.
        m = mask[..., None]
        beta = mx.where(m, beta, 0.0)
        log_g = mx.where(m, log_g, 0.0)

    N = -(-T // C)
    pad = N * C - T
    if pad:
        # Trailing identity steps (beta = 0, log g = 0) leave the state unchanged.
        def _pad(x):
            return mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))

        q, k, v, log_g, beta = map(_pad, (q, k, v, log_g, beta))

    # Grouped-query layout: keys/queries carry a singleton group axis that
    # broadcasts over the R value heads sharing them (hv = hk * R + r, as in
    # mx.repeat), so the Gram matrices are computed once per key head.
    Dv = v.shape[-1]
    return (_to_chunks(q, N, C)[:, :, :, None], _to_chunks(k, N, C)[:, :, :, None],
            _to_chunks(v, N, C).reshape(N, B, Hk, R, C, Dv),
            _to_chunks(log_g, N, C).reshape(N, B, Hk, R, C),
            _to_chunks(beta, N, C).reshape(N, B, Hk, R, C))


def _intra_chunk(q, k, v, log_g, beta):
    """Everything batched over chunks: (decay D, UT-transformed wq and u, kd_t = K^T
    diag(exp(a_C - a_s)), Gamma_C, Q K^T) in the module doc's notation."""
    C, Dk = k.shape[-2:]
    a = mx.cumsum(log_g, axis=-1)  # inclusive log-decay within each chunk
    # Only differences a_t - a_s with s <= t (all <= 0) are exponentiated: the
    # upper triangle is zeroed *before* exp (it would overflow), and with a
    # multiply rather than mx.where/minimum, which are slow on CPU and (for
    # minimum) drop the gradient at ties such as g == 1.
    causal = mx.tril(mx.ones((C, C), dtype=mx.float32))
    strict = mx.tril(mx.ones((C, C), dtype=mx.float32), k=-1)
    decay = mx.exp((a[..., :, None] - a[..., None, :]) * causal) * causal
    gamma = mx.exp(a)[..., None]  # [..., C, 1]
    a_last = a[..., -1:]
    gamma_last = mx.exp(a_last)[..., None]  # [..., 1, 1]
    tail_decay = mx.exp(a_last - a)[..., None]  # exp(a_C - a_s), [..., C, 1]

    kkt = k @ k.swapaxes(-1, -2)
    beta_c = beta[..., None]
    t_inv = _unit_lower_inverse(beta_c * strict * decay * kkt)

    # One matmul applies the UT transform to keys and values together.
    wu = t_inv @ mx.concatenate([beta_c * gamma * k, beta_c * v], axis=-1)
    # Rows [0, C) give W (for Delta = U - W M0), rows [C, 2C) are Gamma Q
    # (the inter-chunk part of Y), so the loop does one matmul for both.
    w, u = wu[..., :Dk], wu[..., Dk:]  # [..., C, Dk], [..., C, Dv]
    wq = mx.concatenate([w, mx.broadcast_to(gamma * q, w.shape)], axis=-2)
    kd_t = (tail_decay * k).swapaxes(-1, -2)  # [..., Dk, C]
    return decay, wq, u, kd_t, gamma_last, q @ k.swapaxes(-1, -2)


def gated_delta_chunked(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: Optional[mx.array] = None,
    mask: Optional[mx.array] = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tuple[mx.array, mx.array]:
    """Chunked Gated DeltaNet; same contract as ``gated_delta_ops`` (scalar g).

    Shapes:
      q, k: [B, T, Hk, Dk] (L2-normalised, q pre-scaled)
      v: [B, T, Hv, Dv], g, beta: [B, T, Hv], Hv a multiple of Hk
      state: [B, Hv, Dv, Dk] or None (zeros)
      mask: optional bool [B, T]; False positions leave the state untouched
            and produce y = 0 there (as the Metal kernel does).
    Returns (y [B, T, Hv, Dv] in q.dtype, final state [B, Hv, Dv, Dk] float32).
    Computation is float32 throughout and differentiable with mx.grad.
    """
    _check(q, v, g, chunk_size)
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if T == 0:
        return mx.zeros((B, 0, Hv, Dv), dtype=q.dtype), state.astype(mx.float32)

    C = min(chunk_size, T)
    chunks = _chunked_inputs(q, k, v, g, beta, mask, C)
    decay, wq, u, kd_t, gamma_last, qkt = _intra_chunk(*chunks)
    m_state = state.astype(mx.float32).reshape(B, Hk, Hv // Hk, Dv, Dk).swapaxes(-1, -2)
    y_inter, deltas, m_state = _chunk_scan(wq, u, kd_t, gamma_last, m_state)

    N = wq.shape[0]
    y = y_inter + (qkt * decay) @ deltas  # [N, B, Hk, R, C, Dv]
    y = y.reshape(N, B, Hv, C, Dv).transpose(1, 0, 3, 2, 4)
    y = y.reshape(B, N * C, Hv, Dv)[:, :T]
    if mask is not None:
        y = mx.where(mask[..., None, None], y, 0.0)
    final_state = m_state.swapaxes(-1, -2).reshape(B, Hv, Dv, Dk)
    return y.astype(q.dtype), final_state
