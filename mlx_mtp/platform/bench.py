"""Thin float32 matmuls on each BLAS path, timed against each other in one process: the
measurement behind the shim's routing defaults (``python -m mlx_mtp.platform``).

Paths (see :func:`blas.route`): the wheel's reference BLAS, OpenBLAS's sgemm (padded to four
rows), one OpenBLAS sgemv per row and the shim's thin kernel (the weight read once for all rows);
"auto" is the path the configured routing took. Repeats are interleaved (A B C C B A ...) so a busy machine
slows every path alike; the median of the repeats is shown, and only large ratios mean anything.
"""

import time
from functools import partial

import mlx.core as mx

from mlx_mtp.platform import blas, gemv_limits

# (K, N) of a weight: x @ W.T is what linear layers and tied output heads compute (W stored
# (N, K)), x @ W the other layout (W stored (K, N)).
SHAPES = (("x @ W.T", 384, 1152), ("x @ W.T", 1024, 4096), ("x @ W.T", 4096, 1024),
          ("x @ W.T", 2048, 2048), ("x @ W", 2048, 2048))
ROWS = (1, 2, 3, 4, 5, 8)


def median_ms(f, n):
    mx.eval(f())
    times = []
    for _ in range(n):
        t = time.perf_counter()
        mx.eval(f())
        times.append(time.perf_counter() - t)
    return sorted(times)[n // 2] * 1e3


def time_paths(f, repeats, n):
    """{path: median ms over `repeats` interleaved rounds of `n` timed calls each}."""
    order = list(blas.ROUTES)
    got = {p: [] for p in order}
    for r in range(repeats):
        for path in order if r % 2 == 0 else order[::-1]:
            blas.route(path)
            got[path].append(median_ms(f, n))
    blas.route(None)
    return {p: sorted(v)[len(v) // 2] for p, v in got.items()}


def auto_path(f) -> str:
    """The path the configured routing takes for ``f``'s product (by the shim's counters)."""
    thin, gemv = blas.thin_calls(), blas.gemv_calls()
    mx.eval(f())
    return ("kernel" if blas.thin_calls() > thin else "sgemv" if blas.gemv_calls() > gemv
            else "sgemm")


def main(repeats: int = 4, n: int = 10):
    if not blas.active():
        print("  (per-path timings need the OpenBLAS shim)")
        return
    print(f"  float32, ms, median of {repeats} interleaved rounds x {n} calls; "
          f"auto = the route taken ({blas.ENV_GEMV_ROWS}={blas.gemv_rows()}, "
          f"{blas.ENV_THIN}={int(blas.thin_on())}, measured shapes: gemv_limits.py)")
    print("  product                   rows  reference    sgemm    sgemv   kernel   auto")
    weights = [mx.random.normal((n_out, k) if layout == "x @ W.T" else (k, n_out))
               for layout, k, n_out in SHAPES]
    # routed as a model with these weights would be (measured now if not yet stored)
    gemv_limits.apply([(str(i), w) for i, w in enumerate(weights)], budget=60.0)
    for (layout, k, n_out), w in zip(SHAPES, weights):
        for m in ROWS:
            x = mx.random.normal((m, k))
            f = partial(mx.matmul, x, w.T if layout == "x @ W.T" else w)
            t = time_paths(f, repeats, n)
            print(f"  {layout:7} {k:>5}x{n_out:<5}     {m:4} {t['reference']:10.2f} "
                  f"{t['sgemm']:8.2f} {t['sgemv']:8.2f} {t['kernel']:8.2f}   {auto_path(f)}",
                  flush=True)
