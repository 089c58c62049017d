"""OpenBLAS shim (mlx_mtp.platform.blas): loaded in-process before MLX, same matmul results,
single-row products left on the reference BLAS, safe fallbacks, and the CLI end to end."""

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

# Matmuls through every cblas path MLX uses: M = 1, 3, 64, transposes, batched, float64.
# b is scaled by 1/sqrt(K) (like a weight init) so results are O(1) and the 1e-5 tolerances
# measure the BLAS, not float32 rounding of large sums.
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
             ((1, 2048), (2048, 1024), 0, 0), ((1, 2048), (1024, 2048), 0, 1)]
    out = {}
    for i, (sa, sb, ta, tb) in enumerate(cases):
        a = mx.array(rng.standard_normal(sa).astype(np.float32))
        b = mx.array((rng.standard_normal(sb) / np.sqrt(sa[-2 if ta else -1])).astype(np.float32))
        out[f"f32_{i}"] = np.array(mx.matmul(a.T if ta else a, b.T if tb else b, stream=mx.cpu))
    a, b = rng.standard_normal((3, 50)), rng.standard_normal((50, 20))
    a, b = mx.array(a, dtype=mx.float64), mx.array(b, dtype=mx.float64)
    out["f64"] = np.array(mx.matmul(a, b, stream=mx.cpu))
    np.savez(sys.argv[1], **out)
    maps = open("/proc/self/maps").read()
    print(json.dumps({"shim_mapped": "openblas-shim-" in maps, "active": blas.active(),
                      "describe": blas.describe(), "padded": blas.padded_calls()}))
""")
# One row times a large weight stored (K, N) (x @ W): routed to the reference BLAS (one row
# times a small one, f32_0, goes to OpenBLAS; so does x @ W.T, f32_9, whatever its size).
SINGLE_ROW = ("f32_8",)
SINGLE_ROW_TRANSPOSED = "f32_9"


def clean_env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", blas.ENV_MODE, blas.ENV_OPENBLAS, blas.ENV_MIN_ROWS)}
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
    assert "OpenBLAS except single rows times large x @ W weights" in info["describe"]
    assert reference["f64"].dtype == np.float64
    for k in reference:
        if k in SINGLE_ROW:  # same library, same arithmetic: bit-identical
            np.testing.assert_array_equal(got[k], reference[k], err_msg=k)
        else:
            np.testing.assert_allclose(got[k], reference[k], rtol=1e-5, atol=1e-5, err_msg=k)
    # Products of 3, 5 and 7 rows (plain and transposed A, batched) ran padded to 4 or 8
    # rows, and matched.
    assert info["padded"] >= 4, info
    # A linear layer's single row (x @ W.T) runs on OpenBLAS even with a large weight: it
    # rounds differently from the reference loop, which is the proof it ran there.
    assert not np.array_equal(got[SINGLE_ROW_TRANSPOSED], reference[SINGLE_ROW_TRANSPOSED])


def test_single_rows_go_to_openblas_when_asked(cache_home, reference, tmp_path):
    got, info = run_child(tmp_path, clean_env(cache_home, MLX_MTP_BLAS_MIN_ROWS="1"))
    assert info["active"]
    # OpenBLAS rounds a 1-row product differently from the reference loop: proof it ran there.
    assert not np.array_equal(got["f32_8"], reference["f32_8"])
    np.testing.assert_allclose(got["f32_8"], reference["f32_8"], rtol=1e-5, atol=1e-5)


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


# --- CLI end to end ---------------------------------------------------------------------------
def cli(env, *args):
    p = subprocess.run([sys.executable, "-m", "mlx_mtp.cli", "generate", "--prompt", "hi",
                        "--max-tokens", "4", "--temp", "0", *args], env=env,
                       capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout + p.stderr


def test_cli_generate_auto_compiles_and_uses_openblas(tmp_path):
    code, out = cli(clean_env(tmp_path), "--blas", "auto")  # fresh cache: compiles the shim
    assert code == 0, out
    assert "CPU matmuls: OpenBLAS except single rows" in out
    assert list((tmp_path / "mlx-mtp").glob("openblas-shim-*.so"))


def test_cli_generate_reference_and_impossible_openblas(cache_home, tmp_path):
    code, out = cli(clean_env(cache_home), "--blas", "reference")
    assert code == 0, out
    assert "CPU matmuls: reference BLAS (requested with --blas reference)" in out
    code, out = cli(clean_env(tmp_path, CC=str(tmp_path / "no-such-cc")), "--blas", "openblas")
    assert code == 2 and "no C compiler" in out and "--blas reference" in out
    assert "Traceback" not in out
