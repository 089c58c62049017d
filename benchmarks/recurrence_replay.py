"""Gated DeltaNet verify + rollback alone, Qwen3.5-27B shapes (Hk=16, Hv=48, 128x128, float32
state): the removed capture path (a state per position, then select) against replay (one
gated_delta_update over K+1 positions, one more over the kept prefix on rejection), interleaved
in one process: graph primitives and median ms.

    python benchmarks/recurrence_replay.py [BATCH]
"""

import statistics
import sys
import tempfile
import time

import mlx_mtp  # noqa: F401  (before MLX: it routes CPU matmuls to OpenBLAS)
import mlx.core as mx
from mlx_lm.models.gated_delta import compute_g, gated_delta_update

_DOT = tempfile.mktemp(suffix=".dot")


def gated_delta_steps(q, k, v, g, beta, state, mask=None):  # the removed capture path
    T = q.shape[1]
    if (rep := v.shape[2] // q.shape[2]) > 1:
        q, k = mx.repeat(q, rep, -2), mx.repeat(k, rep, -2)
    ys, states = [], []
    for t in range(T):
        prev = state
        state = state * g[:, t, :, None, None]
        kv_mem = (state * k[:, t, :, None, :]).sum(axis=-1)
        delta = (v[:, t] - kv_mem) * beta[:, t, :, None]
        state = state + k[:, t, :, None, :] * delta[..., None]
        y = (state * q[:, t, :, None, :]).sum(axis=-1)
        if mask is not None:
            state = mx.where(mask[:, t, None, None, None], state, prev)
        ys.append(y.astype(q.dtype))
        states.append(state)
    return mx.stack(ys, axis=1), states


B, T, Hk, Hv, D = int(sys.argv[1]) if len(sys.argv) > 1 else 1, 4, 16, 48, 128
key = mx.random.key(0)
ks = mx.random.split(key, 8)
q = mx.random.normal((B, T, Hk, D), key=ks[0]).astype(mx.bfloat16) * 0.1
k = mx.random.normal((B, T, Hk, D), key=ks[1]).astype(mx.bfloat16) * 0.1
v = mx.random.normal((B, T, Hv, D), key=ks[2]).astype(mx.bfloat16)
a = mx.random.normal((B, T, Hv), key=ks[3]).astype(mx.bfloat16)
b = mx.random.normal((B, T, Hv), key=ks[4]).astype(mx.bfloat16)
A_log = mx.random.normal((Hv,), key=ks[5])
dt = mx.random.normal((Hv,), key=ks[6]).astype(mx.bfloat16)
s0 = mx.random.normal((B, Hv, D, D), key=ks[7]) * 0.01
mx.eval(q, k, v, a, b, A_log, dt, s0)


def old(n):
    g = compute_g(A_log, a, dt)
    y, states = gated_delta_steps(q, k, v, g, mx.sigmoid(b), s0)
    return [y, states[n - 1]]


def new(n):
    y, s = gated_delta_update(q, k, v, a, b, A_log, dt, s0)
    if n < T:
        _, s = gated_delta_update(q[:, :n], k[:, :n], v[:, :n], a[:, :n], b[:, :n], A_log, dt, s0)
    return [y, s]


def plain():
    return list(gated_delta_update(q[:, :1], k[:, :1], v[:, :1], a[:, :1], b[:, :1], A_log, dt, s0))


def nodes(arrs):
    mx.export_to_dot(_DOT, *arrs)
    return sum("shape=rectangle" in ln for ln in open(_DOT))


# bit-identity of the replayed state with the captured one
for n in range(1, T + 1):
    o, nw = old(n)[1], new(n)[1]
    print(f"n={n}: max |old - new| state = {mx.abs(o - nw).max().item():.2e}")
fns = {"plain T=1": plain}
for n in (T, 2, 1):
    fns[f"old keep{n}"] = lambda n=n: old(n)
    fns[f"new keep{n}"] = lambda n=n: new(n)
print({name: nodes(fn()) for name, fn in fns.items()})
times = {name: [] for name in fns}
for i in range(40):
    for name, fn in fns.items():
        t = time.perf_counter(); mx.eval(fn()); dt_ = time.perf_counter() - t
        if i >= 5:
            times[name].append(dt_ * 1e3)
print(f"B={B}", {name: round(statistics.median(v), 2) for name, v in times.items()})
