"""OpenBLAS shim (mlx_mtp.platform.blas): loaded in-process before MLX, same matmul results,
thin float32 products as OpenBLAS sgemv (bit-identical to numpy's own one-row products, which
use it), the older single-row routing when that is off, safe fallbacks, and the CLI end to end."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from mlx_mtp.platform import blas

pytestmark = pytest.mark.skipif(not blas.reference_blas_in_use(),
                                reason="needs the mlx[cpu] Linux wheel (reference BLAS)")

# Matmuls through every cblas path MLX uses: M = 1, 2, 3, 64, N = 2, 3, transposes (a (64, 1)
# A transposed is one row with lda 1), batched, float64, and the calls with strides wider than
# the product (grouped conv1d: lda 24 for K 12, ldc 6 for N 3; segmented_mm: lda 64 for K 20
# and 44) or one row per expert (gather_mm). b is scaled by 1/sqrt(K) (like a weight init) so
# results are O(1) and the 1e-5 tolerances measure the BLAS, not float32 rounding of large sums.
CHILD = textwrap.dedent("""
    import json, sys
    first = sys.argv[2]
    if first == "mlx":  # MLX imported before mlx_mtp: the shim can no longer take effect
        import mlx.core
    import mlx_mtp
    from mlx_mtp.platform import blas
    blas.configure()
    import mlx.core as mx, numpy as np
    rng = np.random.default_rng(1234)
    cases = [((1, 300), (300, 200), 0, 0), ((3, 300), (300, 200), 0, 0),
             ((64, 128), (128, 96), 0, 0), ((300, 5), (200, 300), 1, 1),
             ((7, 64), (32, 64), 0, 1), ((64, 7), (64, 32), 1, 0),
             ((2, 3, 64), (2, 64, 40), 0, 0), ((4, 1, 128), (128, 64), 0, 0),
             ((1, 2048), (2048, 1024), 0, 0), ((1, 2048), (1024, 2048), 0, 1),
             ((64, 1), (48, 64), 1, 1), ((2, 128), (96, 128), 0, 1),
             ((40, 128), (128, 2), 0, 0), ((128, 40), (3, 128), 1, 1)]
    out = {}
    for i, (sa, sb, ta, tb) in enumerate(cases):
        a = rng.standard_normal(sa).astype(np.float32)
        b = (rng.standard_normal(sb) / np.sqrt(sa[-2 if ta else -1])).astype(np.float32)
        a, b = (a.T if ta else a), (b.T if tb else b)
        out[f"f32_{i}"] = np.array(mx.matmul(mx.array(a), mx.array(b), stream=mx.cpu))
        out[f"numpy_{i}"] = a @ b  # numpy runs one-row products as OpenBLAS sgemv
    x, w = rng.standard_normal((1, 3, 8)), rng.standard_normal((6, 3, 4)) / 4
    out["conv"] = np.array(mx.conv1d(*(mx.array(v.astype(np.float32)) for v in (x, w)),
                                     groups=2, stream=mx.cpu))
    a, b = rng.standard_normal((1, 64)), rng.standard_normal((64, 32)) / 8
    segments = mx.array([[0, 20], [20, 64]], dtype=mx.uint32)
    out["segmented"] = np.array(mx.segmented_mm(mx.array(a.astype(np.float32)),
                                                mx.array(b.astype(np.float32)), segments,
                                                stream=mx.cpu))
    a, b = rng.standard_normal((4, 1, 64)), rng.standard_normal((8, 64, 32)) / 8
    out["gather"] = np.array(mx.gather_mm(mx.array(a.astype(np.float32)),
                                          mx.array(b.astype(np.float32)),
                                          rhs_indices=mx.array([3, 1, 7, 0], dtype=mx.uint32),
                                          stream=mx.cpu))
    a, b = rng.standard_normal((3, 50)), rng.standard_normal((50, 20))
    a, b = mx.array(a, dtype=mx.float64), mx.array(b, dtype=mx.float64)
    out["f64"] = np.array(mx.matmul(a, b, stream=mx.cpu))
    np.savez(sys.argv[1], **out)
    maps = open("/proc/self/maps").read()
    print(json.dumps({"shim_mapped": "openblas-shim-" in maps, "active": blas.active(),
                      "describe": blas.describe(), "padded": blas.padded_calls(),
                      "gemv": blas.gemv_calls()}))
""")
# Products of at most three rows or columns (one row: x @ W, x @ W.T, A transposed with lda 1;
# two and three rows; two and three columns) and the strided calls: one sgemv per row.
THIN = ("f32_0", "f32_1", "f32_8", "f32_9", "f32_10", "f32_11", "f32_12", "f32_13")
STRIDED = ("conv", "segmented", "gather")
ONE_ROW = ("f32_0", "f32_8", "f32_9", "f32_10")
# With the sgemv route off, one row times a large weight stored (K, N) (x @ W) is routed to the
# reference BLAS (one row times a small one, f32_0, goes to OpenBLAS's sgemm; so does x @ W.T,
# f32_9, whatever its size).
SINGLE_ROW = ("f32_8",)
SINGLE_ROW_TRANSPOSED = "f32_9"
NO_GEMV = {"MLX_MTP_BLAS_GEMV_ROWS": "0"}


def clean_env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", blas.ENV_MODE, blas.ENV_OPENBLAS, blas.ENV_MIN_ROWS,
                        blas.ENV_GEMV_ROWS)}
    return {**env, "XDG_CACHE_HOME": str(tmp_path), **extra}


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory):
    if blas._compiler() is None:
        pytest.fail("no C compiler (cc/gcc/$CC) to build the shim: the CI installs gcc")
    if blas.find_openblas() is None:
        pytest.fail("numpy has no bundled libscipy_openblas64_ (install numpy's PyPI wheel)")
    home = tmp_path_factory.mktemp("xdg")
    assert blas.build_shim(home / "mlx-mtp") is not None
    return home


def run_child(tmp_path, env, first="mlx_mtp"):
    out = tmp_path / "out.npz"
    p = subprocess.run([sys.executable, "-c", CHILD, str(out), first], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return dict(np.load(out)), json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reference(cache_home, tmp_path_factory):
    got, info = run_child(tmp_path_factory.mktemp("ref"),
                          clean_env(cache_home, MLX_MTP_BLAS="reference"))
    assert not info["shim_mapped"] and not info["active"]
    return got


def test_import_loads_shim_in_process_and_results_match(cache_home, reference, tmp_path):
    got, info = run_child(tmp_path, clean_env(cache_home))
    assert info["shim_mapped"] and info["active"], info
    assert "OpenBLAS, float32 products of up to 3 rows as sgemv" in info["describe"]
    assert reference["f64"].dtype == np.float64
    for k in reference:
        np.testing.assert_allclose(got[k], reference[k], rtol=1e-5, atol=1e-5, err_msg=k)
    # Thin products ran as sgemv: one row is bit-identical to numpy's own product (the same
    # OpenBLAS sgemv), and differs from the reference BLAS's loop.
    for k in ONE_ROW:
        np.testing.assert_array_equal(got[k], got[k.replace("f32", "numpy")], err_msg=k)
        assert not np.array_equal(got[k], reference[k]), k
    assert info["gemv"] >= len(THIN) + len(STRIDED), info
    # Products of 5 and 7 rows (plain and transposed A, batched) ran padded to 8 rows, and
    # matched.
    assert info["padded"] >= 3, info


def test_thin_products_take_the_older_routes_without_sgemv(cache_home, reference, tmp_path):
    got, info = run_child(tmp_path, clean_env(cache_home, **NO_GEMV))
    assert info["active"] and info["gemv"] == 0, info
    assert "OpenBLAS except single rows times large x @ W weights" in info["describe"]
    for k in reference:
        if k in SINGLE_ROW:  # same library, same arithmetic: bit-identical
            np.testing.assert_array_equal(got[k], reference[k], err_msg=k)
        else:
            np.testing.assert_allclose(got[k], reference[k], rtol=1e-5, atol=1e-5, err_msg=k)
    # Products of 2, 3, 5 and 7 rows (plain and transposed A, batched) ran padded to 4 or 8
    # rows, and matched.
    assert info["padded"] >= 5, info
    # A linear layer's single row (x @ W.T) runs on OpenBLAS even with a large weight: it
    # rounds differently from the reference loop, which is the proof it ran there.
    assert not np.array_equal(got[SINGLE_ROW_TRANSPOSED], reference[SINGLE_ROW_TRANSPOSED])


def test_single_rows_go_to_openblas_when_asked(cache_home, reference, tmp_path):
    got, info = run_child(tmp_path, clean_env(cache_home, MLX_MTP_BLAS_MIN_ROWS="1", **NO_GEMV))
    assert info["active"] and info["gemv"] == 0, info
    # OpenBLAS rounds a 1-row product differently from the reference loop: proof it ran there.
    assert not np.array_equal(got["f32_8"], reference["f32_8"])
    np.testing.assert_allclose(got["f32_8"], reference["f32_8"], rtol=1e-5, atol=1e-5)


# The shim's cblas_sgemm called directly with every order, transpose and thin shape it routes
# to sgemv, strides wider than the product (padding filled with NaN: never read, never
# written), alpha/beta, and beta = 0 over a C of NaN (gemm ignores C then; sgemv alone would
# not), against numpy float64.
DIRECT = textwrap.dedent("""
    import json
    import mlx_mtp
    from mlx_mtp.platform import blas
    from mlx_mtp.testing.sgemm_cases import check_direct_calls
    blas.configure()
    thin = ((1, 45), (2, 45), (3, 45), (45, 1), (45, 3), (1, 1))
    print(json.dumps(check_direct_calls(blas._shim.cblas_sgemm, blas.gemv_calls, "sgemv",
                                        thin, ks=(37,), pads=(0, 5), seed=7)))
""")


def test_direct_thin_calls_equal_float64_at_every_layout(cache_home):
    p = subprocess.run([sys.executable, "-c", DIRECT], env=clean_env(cache_home),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["cases"] == 2 * 3 * 2 * 6 * 2 * 2 and got["errors"] == [], got


# Which row counts (1..9, x @ W.T) the shim runs as sgemv under $MLX_MTP_BLAS_GEMV_ROWS.
GEMV_ROWS = textwrap.dedent("""
    import json
    import mlx_mtp
    from mlx_mtp.platform import blas
    blas.configure()
    import mlx.core as mx, numpy as np
    w = mx.ones((16, 8))

    def gemv_rows():
        rows = []
        for m in range(1, 10):
            before = blas.gemv_calls()
            mx.eval(mx.matmul(mx.ones((m, 8)), w.T, stream=mx.cpu))
            if blas.gemv_calls() > before:
                rows.append(m)
        return rows

    # Rows of an m-row product bit-identical to the same rows alone (what makes a verify pass
    # round as plain steps do).
    rng = np.random.default_rng(3)
    x, w2 = (mx.array(rng.standard_normal(s).astype(np.float32)) for s in ((9, 64), (48, 64)))
    alone = np.concatenate([np.array(x[i:i + 1] @ w2.T) for i in range(9)])
    invariant = [m for m in range(1, 10) if np.array_equal(np.array(x[:m] @ w2.T), alone[:m])]
    got = {"rows": gemv_rows(), "describe": blas.describe(), "invariant": invariant}
    for path in (*blas.ROUTES, None):  # what python -m mlx_mtp.platform times
        blas.route(path)
        got[str(path)] = [gemv_rows(), blas.active()]
    print(json.dumps(got))
""")


@pytest.mark.parametrize("value, rows, says", [
    (None, [1, 2, 3], "up to 3 rows as sgemv"), ("1", [1], "up to 1 row as sgemv"),
    ("8", list(range(1, 9)), "up to 8 rows as sgemv"), ("0", [], "except single rows"),
    ("many", [1, 2, 3], "up to 3 rows as sgemv")])
def test_gemv_rows_env(cache_home, value, rows, says):
    env = clean_env(cache_home, **({} if value is None else {blas.ENV_GEMV_ROWS: value}))
    p = subprocess.run([sys.executable, "-c", GEMV_ROWS], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["rows"] == rows and says in got["describe"], got
    assert set(rows) <= set(got["invariant"]), got
    # The bench's paths: the reference BLAS, OpenBLAS's sgemm for every row count, sgemv up
    # to 8 rows, then back to the routing configured.
    assert got["reference"] == [[], False] and got["sgemm"] == [[], True], got
    assert got["sgemv"] == [list(range(1, 9)), True] and got["None"] == [rows, True], got


DEMO = textwrap.dedent("""
    import json
    import mlx_mtp
    from mlx_mtp.platform import blas
    blas.configure()
    from mlx_mtp.decode.sampling import SamplingParams
    from mlx_mtp.decode.speculative import generate_step
    from mlx_mtp.models.io.loader import load
    model, tok = load(None, dtype="float32")  # float32: the products that go through BLAS
    prompt = tok.encode("import os\\n\\n\\ndef read_lines(path):\\n    ")
    out = {k: [t for t, _, _ in generate_step(prompt, model, num_draft_tokens=k,
                                             sampling=SamplingParams(), max_tokens=24,
                                             adaptive=False)] for k in (0, 2)}
    print(json.dumps({"tokens": out, "gemv": blas.gemv_calls(), "padded": blas.padded_calls()}))
""")


def test_demo_model_greedy_output_unchanged_by_sgemv(cache_home):
    """Greedy decoding of the float32 demo model, plain and MTP (K = 2: verify passes of three
    rows, sgemv too), gives the tokens of the reference-BLAS run."""
    runs = {}
    for mode in ("reference", "auto"):
        p = subprocess.run([sys.executable, "-c", DEMO], capture_output=True, text=True,
                           env=clean_env(cache_home, MLX_MTP_BLAS=mode), timeout=300)
        assert p.returncode == 0, p.stderr
        runs[mode] = json.loads(p.stdout.strip().splitlines()[-1])
    assert runs["reference"]["gemv"] == 0 and runs["auto"]["gemv"] > 100, runs
    assert len(runs["reference"]["tokens"]["0"]) == 24
    assert runs["auto"]["tokens"] == runs["reference"]["tokens"]
    assert runs["auto"]["tokens"]["2"] == runs["auto"]["tokens"]["0"]


def test_bad_openblas_path_falls_back_to_reference(cache_home, reference, tmp_path):
    got, info = run_child(tmp_path, clean_env(cache_home, MLX_MTP_OPENBLAS=str(
        tmp_path / "missing.so")))
    assert info["shim_mapped"] and not info["active"]
    for k in reference:  # every product on the reference BLAS: bit-identical
        np.testing.assert_array_equal(got[k], reference[k], err_msg=k)


def test_mlx_imported_first_stays_on_reference_and_says_why(cache_home, reference, tmp_path):
    got, info = run_child(tmp_path, clean_env(cache_home), first="mlx")
    assert not info["shim_mapped"] and not info["active"]
    assert "MLX was imported before mlx_mtp" in info["describe"]
    for k in reference:
        np.testing.assert_array_equal(got[k], reference[k], err_msg=k)


def test_build_is_cached_and_failures_return_none(cache_home, tmp_path, monkeypatch):
    shim = blas.build_shim(cache_home / "mlx-mtp")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert blas.build_shim(cache_home / "mlx-mtp") == shim  # reused, no compiler needed
    assert blas.build_shim(tmp_path / "empty") is None
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails
    assert blas.build_shim(tmp_path / "failing") is None
    assert not list((tmp_path / "failing").glob("*"))  # no partial files left behind


CONFIGURE = textwrap.dedent("""
    import mlx_mtp
    from mlx_mtp.platform import blas
    assert blas.active(), blas.describe()
    blas.configure("reference")
    assert not blas.active() and "requested with --blas reference" in blas.describe()
    blas.configure("auto")
    assert blas.active()
    blas._mismatch = lambda rtol: "float32 (1, 8) @ (8, 8): 0.5"  # a BLAS that fails the check
    try:
        blas.configure("openblas")
        raise SystemExit("openblas mode accepted a failed check")
    except blas.BlasError as e:
        assert "failed the check" in str(e)
    blas.configure("auto")
    assert not blas.active() and "disagreed with the reference check" in blas.describe()
    try:
        blas.configure("fast")
        raise SystemExit("an unknown mode was accepted")
    except blas.BlasError as e:
        assert "must be one of" in str(e)
    print("ok")
""")


def test_configure_modes_and_failed_check(cache_home):
    """Reference mode turns routing off without a restart; a failed numerical check goes back
    to the reference BLAS (auto) or is an error (openblas)."""
    p = subprocess.run([sys.executable, "-c", CONFIGURE], env=clean_env(cache_home),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stdout + p.stderr


# An OpenBLAS whose sgemv is 1 % off: a library that links numpy's OpenBLAS (so its sgemm,
# dgemm and cgemm are found through it) and defines its own scipy_cblas_sgemv64_.
BAD_SGEMV = r"""
#include <stdint.h>
void scipy_cblas_sgemv64_(int order, int trans, int64_t m, int64_t n, float alpha,
                          const float *a, int64_t lda, const float *x, int64_t incx, float beta,
                          float *y, int64_t incy) {
  int t = (order == 101) == (trans != 111); /* y = A^T x for row-major Trans */
  int64_t rows = t ? n : m, cols = t ? m : n;
  for (int64_t i = 0; i < rows; i++) {
    float s = 0;
    for (int64_t j = 0; j < cols; j++) {
      int64_t r = t ? j : i, c = t ? i : j;
      s += (order == 101 ? a[r * lda + c] : a[c * lda + r]) * x[j * incx];
    }
    y[i * incy] = 1.01f * alpha * s + (beta == 0 ? 0 : beta * y[i * incy]);
  }
}
"""


def test_bad_sgemv_sends_everything_back_to_reference(cache_home, reference, tmp_path):
    """The start-up check covers the sgemv route: a wrong sgemv fails it, and every product
    then runs on the reference BLAS."""
    openblas = blas.find_openblas()
    src = tmp_path / "bad_sgemv.c"
    src.write_text(BAD_SGEMV)
    lib = tmp_path / "libbad_sgemv.so"
    subprocess.run([*blas._compiler(), "-O1", "-shared", "-fPIC", "-o", str(lib), str(src),
                    "-Wl,--no-as-needed", str(openblas), f"-Wl,-rpath,{openblas.parent}"],
                   check=True)
    got, info = run_child(tmp_path, clean_env(cache_home, MLX_MTP_OPENBLAS=str(lib)))
    assert not info["active"] and "disagreed with the reference check" in info["describe"]
    assert info["gemv"] > 0, info  # the check ran through the bad sgemv
    for k in reference:
        np.testing.assert_array_equal(got[k], reference[k], err_msg=k)


# --- CLI end to end ---------------------------------------------------------------------------
def cli(env, *args):
    p = subprocess.run([sys.executable, "-m", "mlx_mtp.cli", "generate", "--prompt", "hi",
                        "--max-tokens", "4", "--temp", "0", *args], env=env,
                       capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout + p.stderr


def test_cli_generate_auto_compiles_and_uses_openblas(tmp_path):
    code, out = cli(clean_env(tmp_path), "--blas", "auto")  # fresh cache: compiles the shim
    assert code == 0, out
    assert "CPU matmuls: OpenBLAS, float32 products of up to 3 rows as sgemv" in out
    assert list((tmp_path / "mlx-mtp").glob("openblas-shim-*.so"))


def test_cli_generate_reference_and_impossible_openblas(cache_home, tmp_path):
    code, out = cli(clean_env(cache_home), "--blas", "reference")
    assert code == 0, out
    assert "CPU matmuls: reference BLAS (requested with --blas reference)" in out
    code, out = cli(clean_env(tmp_path, CC=str(tmp_path / "no-such-cc")), "--blas", "openblas")
    assert code == 2 and "no C compiler" in out and "--blas reference" in out
    assert "Traceback" not in out
