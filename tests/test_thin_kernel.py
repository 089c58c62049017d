"""The OpenBLAS shim's thin-product kernel (float32 products of 1..8 rows that read the weight
once, ``sgemm_thin`` in ``platform/csrc/openblas_shim.c``): results against numpy float64 at
every layout cblas_sgemm passes, rows bit-identical whatever the row count (a verify row rounds
as the plain step's), MLX's matmul and nn.Linear through it, and the start-up check catching a
wrong kernel. Shim runs happen in child processes (the suite runs on the reference BLAS)."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from mlx_mtp.platform import blas
from mlx_mtp.platform.gemv_limits import thin_rows

pytestmark = pytest.mark.skipif(not blas.reference_blas_in_use(),
                                reason="needs the mlx[cpu] Linux wheel (reference BLAS)")


def clean_env(cache, **extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", blas.ENV_MODE, blas.ENV_OPENBLAS, blas.ENV_GEMV_ROWS,
                        blas.ENV_THIN, "MLX_MTP_OPENBLAS_THREADS")}
    return {**env, "XDG_CACHE_HOME": str(cache), "MLX_MTP_MEASURE_DTYPE": "0", **extra}


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory):
    if blas._compiler() is None or blas.find_openblas() is None:
        pytest.fail("the shim needs a C compiler and numpy's bundled OpenBLAS (see CI)")
    home = tmp_path_factory.mktemp("xdg")
    assert blas.build_shim(home / "mlx-mtp") is not None
    return home


def run(code, env, *args):
    p = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_thin_rows_prefers_the_kernel_within_slack():
    kernel, sgemv, sgemm = [1.0, 1.04, 2.0, 1.0], [1.0, 1.0, 1.0, 3.0], [3.0, 3.0, 3.0, 0.5]
    assert thin_rows(kernel, sgemv, sgemm) == [1, 2]  # tie, 4 % slower, 2x slower, vs sgemm
    assert thin_rows([2.0, 1.0, 9.0, 1.0], [1.0] * 4, [1.0] * 4) == [2, 3, 4]  # a spike at 3
    assert thin_rows([2.0] * 4, [1.0] * 4, [1.0] * 4) == []


# cblas_sgemm called directly on the kernel route: both orders, every transpose, 1..8 rows and
# 1..8 columns, K and N odd (a SIMD tail) and K under one vector, leading dimensions wider than
# the product (padding filled with NaN: never read, never written), alpha/beta and beta = 0
# over a C of NaN, against numpy float64.
DIRECT = textwrap.dedent("""
    import json
    import mlx_mtp
    from mlx_mtp.platform import blas
    from mlx_mtp.testing.sgemm_cases import check_direct_calls
    blas.configure()
    blas.route("kernel")
    thin = [(m, 83) for m in range(1, 9)] + [(83, n) for n in range(1, 9)]
    print(json.dumps(check_direct_calls(blas._shim.cblas_sgemm, blas.thin_calls, "the kernel",
                                        thin, ks=(7, 301), pads=(0, 3), seed=11)))
""")


def test_direct_calls_equal_float64_at_every_layout(cache_home):
    got = run(DIRECT, clean_env(cache_home))
    assert got["cases"] == 2 * 3 * 2 * 16 * 2 * 2 * 2 and got["errors"] == [], got


# Rows of products of 1..8 rows against the rows alone, x @ W.T (linear layers) and x @ W,
# odd K and N, a weight large enough to take every block shape and (with two threads) to be
# split; nn.Linear (bias: beta = 1) and mx.matmul equal the shim's cblas_sgemm on the kernel.
ROWS = textwrap.dedent("""
    import ctypes, json
    import mlx_mtp
    from mlx_mtp.platform import blas
    blas.configure()
    import mlx.core as mx, mlx.nn as nn, numpy as np
    rng = np.random.default_rng(5)
    k, n = 301, 517
    x = rng.standard_normal((8, k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    blas.route("kernel")
    out, before = {}, blas.thin_calls()
    for name, weight in (("dot", mx.array(w).T), ("axpy", mx.array(np.ascontiguousarray(w.T)))):
        alone = np.concatenate([np.array(mx.matmul(mx.array(x[i:i + 1]), weight))
                                for i in range(8)])
        out[name] = {"alone": alone.tolist(), "same": [
            [start, m] for m in range(1, 9) for start in range(0, 9 - m)
            if np.array_equal(np.array(mx.matmul(mx.array(x[start:start + m]), weight)),
                              alone[start:start + m])]}
    layer = nn.Linear(k, n)
    layer.weight, layer.bias = mx.array(w), mx.array(bias)
    linear = np.array(layer(mx.array(x[:5])))
    f = blas._shim.cblas_sgemm
    P = ctypes.c_void_p
    f.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, P, ctypes.c_int, P, ctypes.c_int,
                                       ctypes.c_float, P, ctypes.c_int]
    direct = np.tile(bias, (5, 1))
    f(101, 111, 112, 5, n, k, 1.0, x.ctypes.data, k, w.ctypes.data, k, 1.0, direct.ctypes.data, n)
    out["linear"] = bool(np.array_equal(linear, direct))
    out["calls"] = blas.thin_calls() - before
    print(json.dumps(out))
""")


def test_rows_are_bit_identical_whatever_the_row_count(cache_home):
    one = run(ROWS, clean_env(cache_home))
    two = run(ROWS, clean_env(cache_home, MLX_MTP_OPENBLAS_THREADS="2"))
    every = [[start, m] for m in range(1, 9) for start in range(0, 9 - m)]
    for got in (one, two):
        assert got["dot"]["same"] == every and got["axpy"]["same"] == every, got
        assert got["linear"], "nn.Linear through the shim differs from the kernel's product"
        assert got["calls"] >= 2 * (8 + len(every)) + 1
    # split over two threads, every output is summed as on one
    assert one["dot"]["alone"] == two["dot"]["alone"]
    assert one["axpy"]["alone"] == two["axpy"]["alone"]
    # the kernel rounds x @ W.T and x @ W differently, but both are float32-close
    np.testing.assert_allclose(one["dot"]["alone"], one["axpy"]["alone"], rtol=1e-5, atol=1e-5)


# Routing: a large weight no measurement covers runs 1..8 rows on the kernel, 9 on sgemm;
# $MLX_MTP_BLAS_THIN=0 keeps the older routes.
ROUTES = textwrap.dedent("""
    import json
    import mlx_mtp
    from mlx_mtp.platform import blas
    blas.configure()
    import mlx.core as mx
    w = mx.zeros((blas.LARGE_ELEMS // 1024, 1024))
    rows = []
    for m in range(1, 10):
        before = blas.thin_calls()
        mx.eval(mx.ones((m, 1024)) @ w.T)
        rows.append(m) if blas.thin_calls() > before else None
    print(json.dumps({"rows": rows, "routing": blas.routing(), "describe": blas.describe()}))
""")


def test_large_unmeasured_weights_take_the_kernel_unless_turned_off(cache_home):
    on = run(ROUTES, clean_env(cache_home))
    off = run(ROUTES, clean_env(cache_home, MLX_MTP_BLAS_THIN="0"))
    assert on["rows"] == list(range(1, 9)) and off["rows"] == [], (on, off)
    assert "thin kernel" in on["routing"] and "thin kernel" not in off["routing"]
    assert "thin kernel" in on["describe"] and "thin kernel" not in off["describe"]


# A kernel 1 % off (the shim built from a copy whose stores scale the sum) fails the start-up
# check, and every product then runs on the reference BLAS.
BAD_KERNEL = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    os.environ["MLX_MTP_BLAS"] = "reference"  # import without loading the real shim
    import mlx_mtp
    from mlx_mtp.platform import blas
    del os.environ["MLX_MTP_BLAS"]
    blas.SHIM_SOURCE = Path(sys.argv[1])
    assert blas.preload()
    blas.configure()
    import mlx.core as mx, numpy as np
    x = mx.array(np.linspace(-1, 1, 3 * 64, dtype=np.float32).reshape(3, 64))
    w = mx.array(np.linspace(1, -1, 48 * 64, dtype=np.float32).reshape(48, 64))
    got = np.array(x @ w.T)
    print(json.dumps({"active": blas.active(), "describe": blas.describe(),
                      "close": bool(np.allclose(got, np.array(x) @ np.array(w).T, rtol=1e-5,
                                                atol=1e-5))}))
""")


def test_a_wrong_kernel_sends_everything_back_to_reference(cache_home, tmp_path):
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for f in blas.SHIM_SOURCE.parent.glob("*.c"):
        (csrc / f.name).write_text(f.read_text())
    kernel = (csrc / "thin_kernel.c").read_text()
    store = "*y = t->beta == 0.0f ? t->alpha * s"
    assert kernel.count(store) == 1
    (csrc / "thin_kernel.c").write_text(kernel.replace(store, "s *= 1.01f;\n  " + store))
    got = run(BAD_KERNEL, clean_env(tmp_path), str(csrc / blas.SHIM_SOURCE.name))
    assert not got["active"] and "disagreed with the reference check" in got["describe"], got
    good = run(BAD_KERNEL, clean_env(cache_home), str(blas.SHIM_SOURCE))
    assert good["active"], good
    assert got["close"] and good["close"], (got, good)
