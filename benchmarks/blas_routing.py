"""Single-row matmul time on OpenBLAS vs the reference BLAS, interleaved in one process
(switching the shim's routing at run time), for both weight layouts: ``x @ W`` (W stored
(K, N)) and ``x @ W.T`` (W stored (N, K), what linear layers and tied output heads compute).
Used to pick the shim's routing and MLX_MTP_BLAS_SMALL, which apply when single rows do not run
as sgemv (MLX_MTP_BLAS_GEMV_ROWS=0); ``python -m mlx_mtp.platform`` times the sgemv route too.

    python benchmarks/blas_routing.py [--repeats 3]
"""
import argparse
import time

import mlx_mtp  # noqa: F401  (loads the shim before MLX)
from mlx_mtp.platform import blas

blas.configure()
import mlx.core as mx  # noqa: E402

SHAPES = [(256, 768), (384, 1152), (384, 4096), (1024, 1024), (1024, 3072), (2048, 2048),
          (1024, 8192), (4096, 4096)]
ROUTES = {"openblas": "sgemm", "reference": "reference"}  # blas.route paths


def median_us(f, n):
    mx.eval(f())
    ts = []
    for _ in range(n):
        s = time.perf_counter()
        mx.eval(f())
        ts.append(time.perf_counter() - s)
    return sorted(ts)[n // 2] * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    if not blas.active():
        raise SystemExit(f"the OpenBLAS shim is not active: {blas.describe()}")
    print("| one row times | layout | OpenBLAS µs | reference µs | reference / OpenBLAS |")
    print("|---|---|---:|---:|---:|")
    for k, n in SHAPES:
        x = mx.random.normal((1, k))
        w, wt = mx.random.normal((k, n)), mx.random.normal((n, k))
        mx.eval(x, w, wt)
        for layout, f in (("x @ W", lambda: x @ w), ("x @ W.T", lambda: x @ wt.T)):
            res = {r: [] for r in ROUTES}
            for _ in range(a.repeats):
                for r in ("openblas", "reference", "reference", "openblas"):  # A B B A
                    blas.route(ROUTES[r])
                    res[r].append(median_us(f, 40))
            ob, ref = (sorted(v)[len(v) // 2] for v in (res["openblas"], res["reference"]))
            print(f"| {k}×{n} ({k * n / 1e6:.2f}M) | {layout} | {ob:.0f} | {ref:.0f} | "
                  f"{ref / ob:.2f} |", flush=True)
    blas.route(None)  # back to the default routing


if __name__ == "__main__":
    main()
