"""Per-shape sgemv limits (mlx_mtp.platform.gemv_limits and the shim's table): which row counts a
weight shape runs as sgemv, what is measured and stored per machine, and that results stay those
of the other routes. Shim runs happen in child processes (the suite runs on the reference BLAS)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from mlx_mtp.platform import blas
from mlx_mtp.platform.gemv_limits import MAX_ROWS, best_limit

needs_shim = pytest.mark.skipif(not blas.reference_blas_in_use(),
                                reason="needs the mlx[cpu] Linux wheel (reference BLAS)")


def test_best_limit_is_the_cheapest_split():
    flat = [1.0] * MAX_ROWS
    per_row = [0.3 * (m + 1) for m in range(MAX_ROWS)]  # sgemv: one weight read per row
    assert best_limit(per_row, flat) == 3  # 0.3, 0.6, 0.9 < 1; 1.2 > 1
    assert best_limit([0.1] * MAX_ROWS, flat) == MAX_ROWS  # a weight that stays in cache
    assert best_limit([2.0] * MAX_ROWS, flat) == 0
    late_spike = list(per_row)
    late_spike[6] = 9.0  # a spike where sgemm runs anyway changes nothing
    assert best_limit(late_spike, flat) == 3
    assert best_limit(flat, flat) == MAX_ROWS  # ties go to sgemv


CHILD = textwrap.dedent("""
    import json, os, sys
    import mlx_mtp
    from mlx_mtp.platform import blas, gemv_limits
    blas.configure()
    import mlx.core as mx, numpy as np

    def sgemv_rows(k, n):
        w, rows = mx.ones((n, k)), []
        for m in range(1, 10):
            before = blas.gemv_calls()
            mx.eval(mx.matmul(mx.ones((m, k)), w.T, stream=mx.cpu))
            rows.append(m) if blas.gemv_calls() > before else None
        return rows

    def routes(k, n):  # the route each row count 1..8 takes, by the shim's counters
        w, out = mx.ones((n, k)), []
        for m in range(1, 9):
            thin, gemv = blas.thin_calls(), blas.gemv_calls()
            mx.eval(mx.matmul(mx.ones((m, k)), w.T, stream=mx.cpu))
            out.append("kernel" if blas.thin_calls() > thin else
                       "sgemv" if blas.gemv_calls() > gemv else "sgemm")
        return out

    got = {"before": sgemv_rows(16, 24)}
    blas.set_gemv_limit(16, 24, 6)
    got["limited"], got["other"] = sgemv_rows(16, 24), sgemv_rows(16, 40)
    got["query"] = [blas.gemv_limit(16, 24), blas.gemv_limit(16, 40)]
    blas.route("sgemm")
    got["sgemm"] = sgemv_rows(16, 24)
    blas.route(None)
    got["restored"] = sgemv_rows(16, 24)
    # Rows of a 6-row sgemv product are the rows alone, and close to the sgemm route's.
    rng = np.random.default_rng(0)
    x, w = (mx.array(rng.standard_normal(s).astype(np.float32)) for s in ((6, 16), (24, 16)))
    alone = np.concatenate([np.array(x[i:i + 1] @ w.T) for i in range(6)])
    got["invariant"] = bool(np.array_equal(np.array(x @ w.T), alone))
    blas.route("sgemm")
    got["close"] = bool(np.allclose(np.array(x @ w.T), alone, rtol=1e-5, atol=1e-5))
    blas.route(None)
    # apply(): measured (when allowed) and stored, read back by a later call.
    params = [("a", mx.zeros((96, 64))), ("b", mx.zeros((64, 96))), ("c", mx.zeros((96, 64))),
              ("half", mx.zeros((96, 64), dtype=mx.bfloat16)), ("vec", mx.zeros((64,)))]
    got["shapes"] = gemv_limits.shapes_of(params)
    got["applied"] = {f"{k}x{n}": r for (k, n), r in gemv_limits.apply(params).items()}
    got["file"] = gemv_limits.limits_file().exists()
    got["stored"] = {f"{k}x{n}": r for (k, n), r in gemv_limits.stored().items()}
    got["shim"] = {f"{k}x{n}": blas.gemv_limit(k, n) for k, n in gemv_limits.shapes_of(params)}
    got["routes"] = {f"{k}x{n}": routes(k, n) for k, n in gemv_limits.shapes_of(params)}
    print(json.dumps(got))
""")


def run_child(cache, **env):
    base = {k: v for k, v in os.environ.items()
            if k not in ("LD_PRELOAD", blas.ENV_MODE, blas.ENV_OPENBLAS, blas.ENV_GEMV_ROWS)}
    p = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                       env={**base, "XDG_CACHE_HOME": str(cache), **env}, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


@needs_shim
def test_a_shape_limit_routes_that_shape_only_and_is_measured_once(tmp_path):
    got = run_child(tmp_path, MLX_MTP_MEASURE_DTYPE="1")
    assert got["before"] == [1, 2, 3]
    assert got["limited"] == [1, 2, 3, 4, 5, 6] and got["other"] == [1, 2, 3], got
    assert got["query"] == [6, 3]
    assert got["sgemm"] == [] and got["restored"] == [1, 2, 3, 4, 5, 6], got
    assert got["invariant"] and got["close"], got
    # float32 matrices only, each shape once, as (inputs, outputs) of x @ W.T
    assert sorted(map(tuple, got["shapes"])) == [(64, 96), (96, 64)]
    # stored as applied: (sgemv limit, row counts on the thin kernel); the shim routes each
    # row count so (the kernel first, then sgemv up to the limit, then sgemm)
    assert got["file"] and got["stored"] == got["applied"], got
    assert set(got["applied"]) == {"64x96", "96x64"}
    for shape, (rows, thin) in got["applied"].items():
        assert 0 <= rows <= MAX_ROWS and set(thin) <= set(range(1, MAX_ROWS + 1)), got
        assert got["shim"][shape] == rows
        assert got["routes"][shape] == ["kernel" if m in thin else "sgemv" if m <= rows
                                        else "sgemm" for m in range(1, MAX_ROWS + 1)], got
    # A later process reads the stored routes, with measuring forbidden.
    again = run_child(tmp_path, MLX_MTP_MEASURE_DTYPE="0")
    assert again["applied"] == got["applied"] and again["shim"] == got["shim"]
    assert again["routes"] == got["routes"]


@needs_shim
def test_nothing_is_measured_when_measuring_is_forbidden(tmp_path):
    got = run_child(tmp_path, MLX_MTP_MEASURE_DTYPE="0")
    assert got["applied"] == {} and not got["file"]
    assert got["shim"] == {"64x96": 3, "96x64": 3}  # the default limit
    # small weights: sgemv up to the default, sgemm past it, never the kernel unmeasured
    default = ["sgemv"] * 3 + ["sgemm"] * (MAX_ROWS - 3)
    assert got["routes"] == {"64x96": default, "96x64": default}, got
