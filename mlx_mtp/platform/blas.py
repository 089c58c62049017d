"""Fast CPU matmuls on Linux: run MLX's GEMMs on numpy's OpenBLAS instead of a reference BLAS.

Why: the ``mlx[cpu]`` Linux wheel links a bundled *reference* (netlib) BLAS. Its GEMM costs about
M times a single-row product for an M-row input, so verifying K draft tokens, or decoding a
batch, costs K (or B) plain decode steps and speculative decoding cannot win. numpy's wheel
bundles an optimised OpenBLAS, and libmlx only imports ``cblas_{s,d,c}gemm``, so a tiny
``LD_PRELOAD`` shim (``csrc/openblas_shim.c``) can route those three calls to it.

How: :func:`maybe_reexec` compiles the shim once into the user cache directory and re-executes
the CLI with it preloaded (a preload only takes effect at process start). :func:`check` then
compares a few MLX matmuls with numpy float64 results and goes back to the reference BLAS if
they disagree, so a bad BLAS can never silently change outputs. Without a C compiler, or with
``--blas reference`` / ``MLX_MTP_BLAS=reference``, nothing changes.

``python -m mlx_mtp.platform.blas`` prints what is in use and times two matmuls.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

log = logging.getLogger("mlx_mtp.blas")

MODES = ("auto", "openblas", "reference")
SHIM_SOURCE = Path(__file__).parent / "csrc" / "openblas_shim.c"
SHIM_PREFIX = "openblas-shim-"
ENV_MODE = "MLX_MTP_BLAS"  # default for --blas
ENV_OPENBLAS = "MLX_MTP_OPENBLAS"  # the library the shim loads
ENV_GUARD = "MLX_MTP_BLAS_ACTIVE"  # set on re-exec: "1" (shim preloaded) or a reason not to retry
CHECK_FAILED = "check-failed"

# Why this process is on the reference BLAS (for describe()); set by maybe_reexec().
_reason = "this process was not started through the mlx-mtp CLI"


class BlasError(RuntimeError):
    """``--blas openblas`` was requested but cannot be honoured."""


def default_mode() -> str:
    return os.environ.get(ENV_MODE) or "auto"


def _package_dirs(package: str) -> list:
    """Directories of an installed package, found without importing it. mlx is a namespace
    package, so any ``mlx`` directory on sys.path (the cwd, say) is listed too."""
    spec = importlib.util.find_spec(package)
    if spec is None:
        return []
    if spec.submodule_search_locations is not None:
        return [Path(p) for p in spec.submodule_search_locations]
    return [Path(spec.origin).parent] if spec.origin else []


def find_openblas() -> Optional[Path]:
    """numpy's bundled ILP64 OpenBLAS (``numpy.libs/libscipy_openblas64_*.so``), if any."""
    for numpy_dir in _package_dirs("numpy"):
        libs = sorted((numpy_dir.parent / "numpy.libs").glob("libscipy_openblas64_*.so"))
        if libs:
            return libs[0]
    return None


def reference_blas_in_use() -> bool:
    """True on Linux when MLX is the wheel that links the bundled reference ``libblas``."""
    return sys.platform == "linux" and any(
        any((d.parent / "mlx_cpu.libs").glob("libblas-*.so*")) for d in _package_dirs("mlx"))


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlx-mtp"


def _compiler() -> Optional[list]:
    if os.environ.get("CC"):  # respect $CC, even when it does not exist
        cmd = shlex.split(os.environ["CC"])
        return cmd if cmd and shutil.which(cmd[0]) else None
    return next(([c] for c in ("cc", "gcc") if shutil.which(c)), None)


def _build_shim(cache_dir=None) -> tuple[Optional[Path], str]:
    """(path of the compiled shim, "") or (None, why not)."""
    digest = hashlib.sha256(SHIM_SOURCE.read_bytes()).hexdigest()[:12]
    out = Path(cache_dir or _cache_dir()) / f"{SHIM_PREFIX}{digest}.so"
    if out.exists():
        return out, ""
    cc = _compiler()
    if cc is None:
        return None, ("no C compiler to build the OpenBLAS shim "
                      "(install one, e.g. apt-get install gcc, or set $CC)")
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")  # same dir, so os.replace is atomic
    cmd = [*cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(SHIM_SOURCE), "-ldl", "-lpthread"]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if p.returncode != 0:
            tail = p.stderr.strip()[-600:]
            log.info("compiling the OpenBLAS shim failed: %s\n%s", shlex.join(cmd), tail)
            last = tail.splitlines()[-1] if tail else f"exit code {p.returncode}"
            return None, f"compiling the OpenBLAS shim with {cc[0]} failed: {last}"
        os.replace(tmp, out)
        return out, ""
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"could not build the OpenBLAS shim in {out.parent}: {e}"
    finally:
        tmp.unlink(missing_ok=True)


def build_shim(cache_dir=None) -> Optional[Path]:
    """Compile ``csrc/openblas_shim.c`` once into the cache dir; None if that is impossible."""
    return _build_shim(cache_dir)[0]


def _mapped_shim() -> Optional[str]:
    """Path of the shim if it is loaded into this process."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").partition("/")[2]
                if path and os.path.basename(path).startswith(SHIM_PREFIX):
                    return "/" + path
    except OSError:
        pass
    return None


def active() -> bool:
    """True if the shim is loaded here *and* routes GEMMs to OpenBLAS (not to its fallback)."""
    if _mapped_shim() is None:
        return False
    import ctypes

    try:  # a preloaded shim's symbols are global; one merely dlopen'ed would not serve MLX
        return bool(ctypes.CDLL(None).mlx_mtp_shim_uses_openblas())
    except AttributeError:
        return False


def _preload_without_shim() -> list:
    """$LD_PRELOAD entries (space- or colon-separated) other than our shim."""
    return [p for p in os.environ.get("LD_PRELOAD", "").replace(":", " ").split()
            if not os.path.basename(p).startswith(SHIM_PREFIX)]


def _exec(argv, module: str, guard: str, shim: Optional[str] = None,
          openblas: Optional[Path] = None):
    preload = _preload_without_shim()
    env = dict(os.environ, **{ENV_GUARD: guard})
    env.pop("LD_PRELOAD", None)
    if shim:
        preload.insert(0, shim)
        env[ENV_OPENBLAS] = str(openblas)
        # MLX already runs its own CPU threads, and decode-sized GEMMs are memory bound:
        # OpenBLAS's spinning worker threads measured 30x slower than 1 thread on a busy
        # 2-core machine. An explicit OPENBLAS_NUM_THREADS wins.
        env.setdefault("OPENBLAS_NUM_THREADS", "1")
    if preload:
        env["LD_PRELOAD"] = " ".join(preload)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)


def _why_not_openblas() -> tuple[Optional[str], Optional[Path], Optional[Path]]:
    """(reason, None, None) or (None, shim, openblas)."""
    if not sys.executable:
        return "cannot re-execute Python (sys.executable is unknown)", None, None
    if sys.platform != "linux":
        return "MLX uses its platform BLAS here (the shim is for the Linux CPU wheel)", None, None
    if not reference_blas_in_use():
        return "MLX is not linked to the mlx-cpu wheel's reference BLAS", None, None
    openblas = find_openblas()
    if openblas is None:
        return ("numpy's bundled OpenBLAS (numpy.libs/libscipy_openblas64_*.so) not found; "
                "install numpy's PyPI wheel"), None, None
    shim, why = _build_shim()
    return (why, None, None) if shim is None else (None, shim, openblas)


def maybe_reexec(mode: Optional[str] = None, argv: Optional[Sequence[str]] = None,
                 module: str = "mlx_mtp.cli"):
    """Re-execute ``python -m module *argv`` with the OpenBLAS shim preloaded, when useful.

    mode: "auto" (use OpenBLAS when possible, else log one info line), "openblas" (raise
    BlasError when impossible) or "reference" (leave MLX alone). Default: $MLX_MTP_BLAS or auto.
    Returns normally when this process should simply continue.
    """
    global _reason
    mode = mode or default_mode()
    if mode not in MODES:
        raise BlasError(f"--blas / ${ENV_MODE} must be one of {', '.join(MODES)} (got {mode!r})")
    argv = list(sys.argv[1:] if argv is None else argv)
    # The preload is for this process only: processes it starts decide for themselves.
    guard = os.environ.pop(ENV_GUARD, None)
    shim_here = _mapped_shim()
    if shim_here:
        kept = _preload_without_shim()
        os.environ.pop("LD_PRELOAD", None)
        if kept:
            os.environ["LD_PRELOAD"] = " ".join(kept)

    if mode == "reference":
        _reason = "requested with --blas reference"
        if shim_here and active():  # inherited from a parent: restart without it
            _exec(argv, module, guard="reference")
        return
    if active():
        return
    if guard == CHECK_FAILED:
        why = "OpenBLAS results disagreed with the reference check"
    elif guard:
        why = "the OpenBLAS shim was preloaded but did not take effect"
    else:
        why, shim, openblas = _why_not_openblas()
        if why is None:
            log.debug("re-executing with %s preloaded (OpenBLAS: %s)", shim, openblas)
            _exec(argv, module, guard="1", shim=str(shim), openblas=openblas)
    _reason = why
    if mode == "openblas":
        raise BlasError(f"--blas openblas is not possible: {why}. "
                        "Fix that, or use --blas reference (or auto) to run on the reference BLAS.")
    log.info("CPU matmuls stay on the reference BLAS: %s", why)


def _check_cases():
    import numpy as np

    def r(*shape, dtype=np.float32, phase=0.0):  # cheap deterministic data (no numpy.random)
        n = int(np.prod(shape))
        return np.sin(np.arange(n) * 0.7315 + n + phase).reshape(shape).astype(dtype)

    def c(*shape):
        return (r(*shape) + 1j * r(*shape, phase=1.0)).astype(np.complex64)

    return [  # (a, b, transpose a, transpose b): M = 1, 3, 64, transposes, batched, f64, c64
        (r(1, 256), r(256, 192), False, False), (r(3, 256), r(256, 192), False, False),
        (r(64, 96), r(96, 64), False, False), (r(256, 3), r(192, 256), True, True),
        (r(4, 5, 64), r(4, 64, 48), False, False),
        (r(3, 64, dtype=np.float64), r(64, 32, dtype=np.float64), False, False),
        (c(3, 16), c(16, 8), False, False)]


def _mismatch(rtol: float) -> Optional[str]:
    """Describe the first MLX matmul that disagrees with numpy's float64/complex128 result."""
    import mlx.core as mx
    import numpy as np

    cases = _check_cases()
    outs = []
    for a, b, ta, tb in cases:
        # explicit dtype: mx.array() would turn float64 input into float32
        x, y = (mx.array(v, dtype=getattr(mx, v.dtype.name)) for v in (a, b))
        outs.append(mx.matmul(x.T if ta else x, y.T if tb else y, stream=mx.cpu))
    mx.eval(outs)
    for (a, b, ta, tb), got in zip(cases, outs):
        wide = np.complex128 if np.iscomplexobj(a) else np.float64
        ref = (a.T if ta else a).astype(wide) @ (b.T if tb else b).astype(wide)
        got = np.array(got)
        if not np.allclose(got, ref, rtol=rtol, atol=rtol * np.abs(ref).max()):
            return (f"{a.dtype} {a.shape}{'.T' if ta else ''} @ {b.shape}{'.T' if tb else ''}: "
                    f"max error {np.abs(got - ref).max():.3g}")
    return None


def check(mode: Optional[str] = None, argv: Optional[Sequence[str]] = None,
          module: str = "mlx_mtp.cli", rtol: float = 1e-4) -> bool:
    """If OpenBLAS is in use, verify a few MLX matmuls against numpy (float64) in ~10 ms.

    On a mismatch: warn, then re-execute on the reference BLAS (mode "openblas": BlasError).
    """
    if not active():
        return True
    bad = _mismatch(rtol)
    if bad is None:
        return True
    if (mode or default_mode()) == "openblas":
        raise BlasError(f"--blas openblas: OpenBLAS results failed the check ({bad}); "
                        "use --blas reference")
    log.warning("OpenBLAS matmul check failed (%s); restarting on the reference BLAS", bad)
    _exec(list(sys.argv[1:] if argv is None else argv), module, guard=CHECK_FAILED)
    return False  # only reached if os.execve is patched out


def add_argument(parser):
    parser.add_argument(
        "--blas", choices=MODES, default=default_mode(),
        help="CPU matmul library on Linux: auto = numpy's OpenBLAS through a small compiled "
             "shim when possible, else MLX's reference BLAS; openblas = fail if that is "
             "impossible (default: $MLX_MTP_BLAS or auto)")


def setup(args, argv):
    """Move this CLI process onto OpenBLAS if wanted (re-executes it), verify, report it.

    Only for the process's entry point: re-executing replaces the whole process, which
    must not happen to a caller of ``cli.main(argv)`` (tests, ``python -m``).
    """
    if getattr(args, "server", None):  # bench --server: a client, it runs no model
        return
    maybe_reexec(args.blas, argv)
    check(args.blas, argv)
    if args.command == "serve":  # the server's basicConfig is then a no-op: keep its format
        logging.basicConfig(level=args.log_level,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        log.info(describe())
    elif args.command != "generate" and not getattr(args, "quiet", False):
        print(describe(), file=sys.stderr)  # generate prints it with its stats


def describe() -> str:
    """One line for logs: which BLAS runs MLX's CPU matmuls, and why."""
    if active():
        return (f"CPU matmuls: OpenBLAS via mlx-mtp shim "
                f"(numpy's {Path(os.environ.get(ENV_OPENBLAS, '?')).name})")
    if not reference_blas_in_use():
        return "CPU matmuls: MLX's built-in BLAS"
    if _mapped_shim():
        return f"CPU matmuls: reference BLAS (shim loaded but ${ENV_OPENBLAS} could not be used)"
    return f"CPU matmuls: reference BLAS ({_reason})"


def _bench():
    import time

    import mlx.core as mx

    w = mx.random.normal((2048, 2048))
    for m in (1, 8):
        x = mx.random.normal((m, 2048))
        mx.eval(x, w, x @ w)
        times = []
        for _ in range(20):
            t = time.perf_counter()
            mx.eval(x @ w)
            times.append(time.perf_counter() - t)
        print(f"  {m}x2048 @ 2048x2048 float32: {sorted(times)[len(times) // 2] * 1e3:7.2f} ms"
              " (median of 20)")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        maybe_reexec(module="mlx_mtp.platform.blas")
        check(module="mlx_mtp.platform.blas")
    except BlasError as e:
        sys.exit(f"mlx_mtp.platform.blas: error: {e}")
    print(describe())
    _bench()
