"""Chunked Gated DeltaNet (models/kernels/gated_delta_chunked.py) against mlx-lm's per-token
recurrence, forward and forward+backward, at a few chunk sizes."""

import time
from functools import partial

from mlx_mtp.models.kernels.gated_delta_chunked import DEFAULT_CHUNK_SIZE, gated_delta_chunked
from mlx_mtp.testing.kernels import random_gated_delta_inputs
import mlx.core as mx


def benchmark(
    T=512,
    B=1,
    Hk=4,
    Hv=8,
    Dk=64,
    Dv=64,
    chunk_sizes=(DEFAULT_CHUNK_SIZE,),
    repeats=3,
):
    """Time gated_delta_ops vs gated_delta_chunked, forward and forward+backward.

    Reports the best of ``repeats`` runs in milliseconds (best-of, because a
    shared machine adds one-sided noise).

    Not run by the tests; ``python benchmarks/gated_delta_chunked.py``.
    """
    from mlx_lm.models.gated_delta import gated_delta_ops

    q, k, v, g, beta = random_gated_delta_inputs(B, T, Hk, Hv, Dk, Dv)
    state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    args = (q, k, v, g, beta, state)
    mx.eval(*args)

    def fwd_bwd(fn):
        def loss(*a):
            y, s = fn(*a)
            return (y * y).sum() + s.sum()

        return mx.grad(loss, argnums=tuple(range(len(args))))

    fns = {"ops": gated_delta_ops}
    for c in chunk_sizes:
        fns[f"chunked_C{c}"] = partial(gated_delta_chunked, chunk_size=c)

    cases = {}
    for name, fn in fns.items():
        cases[(name, "fwd")] = fn
        cases[(name, "fwd+bwd")] = fwd_bwd(fn)
    for f in cases.values():
        mx.eval(f(*args))  # warm-up (compiles the reference step)
    # Interleave the cases so drifting background load hits them alike.
    results = {key: float("inf") for key in cases}
    for _ in range(repeats):
        for key, f in cases.items():
            t0 = time.perf_counter()
            mx.eval(f(*args))
            results[key] = min(results[key], (time.perf_counter() - t0) * 1e3)
    for (name, mode), ms in results.items():
        print(f"T={T:5d} {name:12s} {mode:8s} {ms:9.1f} ms", flush=True)
    return results


if __name__ == "__main__":
    for T in (512, 2048):
        benchmark(T=T, chunk_sizes=(8, 16, 32, 64), repeats=5)
