"""OpenBLAS shim (mlx_mtp.platform.blas): same matmul results, real use of OpenBLAS, safe fallbacks,
the re-exec decision, and the CLI end to end."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from mlx_mtp.platform import blas as fast_blas

pytestmark = pytest.mark.skipif(not fast_blas.reference_blas_in_use(),
                                reason="needs the mlx[cpu] Linux wheel (reference BLAS)")

# Matmuls through every cblas path MLX uses: M = 1, 3, 64, transposes, batched, float64.
# b is scaled by 1/sqrt(K) (like a weight init) so results are O(1) and the 1e-5 tolerances
# measure the BLAS, not float32 rounding of large sums.
CHILD = textwrap.dedent("""
    import ctypes, json, sys
    import mlx.core as mx, numpy as np
    rng = np.random.default_rng(1234)
    cases = [((1, 300), (300, 200), 0, 0), ((3, 300), (300, 200), 0, 0),
             ((64, 128), (128, 96), 0, 0), ((300, 5), (200, 300), 1, 1),
             ((7, 64), (32, 64), 0, 1), ((64, 7), (64, 32), 1, 0),
             ((2, 3, 64), (2, 64, 40), 0, 0), ((4, 1, 128), (128, 64), 0, 0)]
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
    shim = [l.split()[-1] for l in maps.splitlines() if "openblas-shim-" in l]
    uses = bool(ctypes.CDLL(shim[0]).mlx_mtp_shim_uses_openblas()) if shim else False
    print(json.dumps({"shim_mapped": bool(shim), "openblas_mapped": "libscipy_openblas64_" in maps,
                      "uses_openblas": uses}))
""")


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", fast_blas.ENV_GUARD, fast_blas.ENV_MODE,
                        fast_blas.ENV_OPENBLAS)}
    env["OPENBLAS_NUM_THREADS"] = "1"
    return {**env, **extra}


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory):
    return tmp_path_factory.mktemp("xdg")


@pytest.fixture(scope="module")
def shim(cache_home):
    if fast_blas._compiler() is None:
        pytest.skip("no C compiler (cc/gcc/$CC) to build the shim")
    if fast_blas.find_openblas() is None:
        pytest.skip("numpy has no bundled libscipy_openblas64_")
    path = fast_blas.build_shim(cache_home / "mlx-mtp")
    assert path is not None and path.exists(), "the compiler exists but the shim did not build"
    return path


def run_child(tmp_path, name, env):
    out = tmp_path / f"{name}.npz"
    p = subprocess.run([sys.executable, "-c", CHILD, str(out)], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return dict(np.load(out)), json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_child(tmp_path_factory.mktemp("ref"), "ref", clean_env())


def test_preloaded_shim_uses_openblas_and_matches(shim, reference, tmp_path):
    ref, ref_info = reference
    assert not ref_info["shim_mapped"]
    got, info = run_child(tmp_path, "fast", clean_env(
        LD_PRELOAD=str(shim), MLX_MTP_OPENBLAS=str(fast_blas.find_openblas())))
    assert info == {"shim_mapped": True, "openblas_mapped": True, "uses_openblas": True}
    assert got.keys() == ref.keys()
    assert ref["f64"].dtype == np.float64
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-5, err_msg=k)


def test_bad_openblas_path_falls_back_to_reference(shim, reference, tmp_path):
    ref, _ = reference
    got, info = run_child(tmp_path, "fallback", clean_env(
        LD_PRELOAD=str(shim), MLX_MTP_OPENBLAS=str(tmp_path / "missing.so")))
    assert info["shim_mapped"] and not info["uses_openblas"]
    for k in ref:  # same library, same arithmetic: bit-identical
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)


def test_build_is_cached_and_failures_return_none(shim, tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert fast_blas.build_shim(shim.parent) == shim  # reused, no compiler needed
    assert fast_blas.build_shim(tmp_path / "empty") is None
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails
    assert fast_blas.build_shim(tmp_path / "failing") is None
    assert not list((tmp_path / "failing").glob("*"))  # no partial files left behind


# --- maybe_reexec / check decisions (os.execve captured, never run) ------------------------
class Exec(Exception):
    pass


@pytest.fixture
def execs(monkeypatch, cache_home):
    calls = []

    def fake_execve(path, argv, env):
        calls.append((path, argv, env))
        raise Exec

    monkeypatch.setattr(fast_blas.os, "execve", fake_execve)
    for k in (fast_blas.ENV_GUARD, fast_blas.ENV_MODE, "OPENBLAS_NUM_THREADS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("LD_PRELOAD", "/opt/other/libfoo.so")
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_home))
    return calls


def test_auto_reexecs_with_the_shim_preloaded(shim, execs):
    with pytest.raises(Exec):
        fast_blas.maybe_reexec("auto", ["generate", "--prompt", "hi"])
    (path, argv, env), = execs
    assert path == sys.executable
    assert argv == [sys.executable, "-m", "mlx_mtp.cli", "generate", "--prompt", "hi"]
    assert env["LD_PRELOAD"].split() == [str(shim), "/opt/other/libfoo.so"]
    assert env[fast_blas.ENV_OPENBLAS] == str(fast_blas.find_openblas())
    assert env[fast_blas.ENV_GUARD] == "1" and env["OPENBLAS_NUM_THREADS"] == "1"


def test_reference_mode_and_guard_do_not_exec(shim, execs, monkeypatch):
    fast_blas.maybe_reexec("reference", ["generate"])
    assert "reference BLAS (requested" in fast_blas.describe()
    monkeypatch.setenv(fast_blas.ENV_GUARD, "1")  # already re-executed once: never loop
    fast_blas.maybe_reexec("auto", ["generate"])
    monkeypatch.setenv(fast_blas.ENV_GUARD, "1")
    with pytest.raises(fast_blas.BlasError, match="did not take effect"):
        fast_blas.maybe_reexec("openblas", ["generate"])
    assert execs == []


def test_no_compiler(shim, execs, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))
    fast_blas.maybe_reexec("auto", ["generate"])  # continues on the reference BLAS
    assert "no C compiler" in fast_blas.describe()
    with pytest.raises(fast_blas.BlasError) as e:
        fast_blas.maybe_reexec("openblas", ["generate"])
    assert "no C compiler" in str(e.value) and "--blas reference" in str(e.value)
    assert execs == []


def test_failed_check_reexecs_on_reference(shim, execs, monkeypatch):
    assert fast_blas.check("auto", ["generate"])  # shim not loaded here: nothing to check
    assert fast_blas._mismatch(1e-4) is None  # the reference BLAS passes its own check
    monkeypatch.setattr(fast_blas, "active", lambda: True)
    monkeypatch.setattr(fast_blas, "_mismatch", lambda rtol: "float32 (1, 8) @ (8, 8): 0.5")
    monkeypatch.setenv("LD_PRELOAD", f"{shim} /opt/other/libfoo.so")
    with pytest.raises(Exec):
        fast_blas.check("auto", ["serve"])
    (_, argv, env), = execs
    assert argv[-1] == "serve" and env["LD_PRELOAD"] == "/opt/other/libfoo.so"
    assert env[fast_blas.ENV_GUARD] == fast_blas.CHECK_FAILED
    with pytest.raises(fast_blas.BlasError, match="failed the check"):
        fast_blas.check("openblas", ["serve"])


# --- CLI end to end ---------------------------------------------------------------------------
def cli(tmp_path, *args, **env):
    p = subprocess.run([sys.executable, "-m", "mlx_mtp.cli", "generate", "--prompt", "hi",
                        "--max-tokens", "4", "--temp", "0", "--verbose", "true", *args],
                       env=clean_env(XDG_CACHE_HOME=str(tmp_path), **env), capture_output=True,
                       text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


def test_cli_generate_auto_uses_openblas(shim, tmp_path):
    code, out, err = cli(tmp_path, "--blas", "auto")  # fresh cache: compiles the shim itself
    assert code == 0, err
    assert "CPU matmuls: OpenBLAS via mlx-mtp shim" in out and "Generation: 4 tokens" in out
    assert list(Path(tmp_path, "mlx-mtp").glob("openblas-shim-*.so"))


def test_cli_generate_reference_and_impossible_openblas(shim, tmp_path):
    code, out, err = cli(tmp_path, "--blas", "reference")
    assert code == 0, err
    assert "CPU matmuls: reference BLAS" in out
    code, out, err = cli(tmp_path, "--blas", "openblas", CC=str(tmp_path / "no-such-cc"))
    assert code == 2 and "no C compiler" in err and "--blas reference" in err
