"""Fast CPU matmuls on Linux: run MLX's multi-row GEMMs on numpy's OpenBLAS.

Why: the ``mlx[cpu]`` Linux wheel links a bundled *reference* (netlib) BLAS. Its GEMM costs about
M times a single-row product for an M-row input, so verifying K draft tokens, or decoding a
batch, costs K (or B) plain decode steps and speculative decoding cannot win. numpy's wheel
bundles an optimised OpenBLAS, and libmlx only imports ``cblas_{s,d,c}gemm``, so a tiny shim
(``csrc/openblas_shim.c``) can route those three calls to it.

How: :func:`preload` (run by ``import mlx_mtp``, so the CLI and the Python API both get it)
compiles the shim once into the user cache directory and loads it with ``RTLD_GLOBAL`` before
MLX is first imported, so libmlx binds to it; nothing restarts. :func:`configure` then picks the
routing (float32 products of 1..8 rows or columns run on the shim's thin kernel, which reads the
weight once for all rows, where that was measured fastest for the weight's shape or the weight is
large (``gemv_limits.py``); others of up to three rows or columns run as one OpenBLAS sgemv per
row, 3.5x faster than its sgemm or the reference BLAS for a single row; other products of 2..64
rows are padded to a multiple of four, as OpenBLAS's kernels want) and compares a few MLX matmuls
with numpy float64 results, on the configured routes and on the kernel, sending everything back
to the reference BLAS if they disagree, so a bad BLAS or kernel can never silently change
outputs. The shim is compiled with ``-O3 -march=native -fopenmp`` (``BUILD_FLAGS``: without
those the compiler lacks), once per CPU. Without a C compiler, if
MLX was imported before mlx_mtp, or with ``--blas reference`` / ``MLX_MTP_BLAS=reference``,
nothing changes. bf16 and fp16 matmuls never go through BLAS on MLX's CPU backend: the choice
only matters for float32 (and quantized models' float32 parts).

``python -m mlx_mtp.platform`` prints what is in use and times 1- to 8-row matmuls on each path
(``platform/bench.py``).
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
from typing import Optional

log = logging.getLogger("mlx_mtp.blas")

MODES = ("auto", "openblas", "reference")
SHIM_SOURCE = Path(__file__).parent / "csrc" / "openblas_shim.c"
SHIM_PREFIX = "openblas-shim-"
ENV_MODE = "MLX_MTP_BLAS"  # default for --blas
ENV_OPENBLAS = "MLX_MTP_OPENBLAS"  # the library the shim loads
ENV_MIN_ROWS = "MLX_MTP_BLAS_MIN_ROWS"  # products with fewer rows (or columns) are "thin"
ENV_SMALL = "MLX_MTP_BLAS_SMALL"  # thin products with a smaller weight still go to OpenBLAS
ENV_PAD = "MLX_MTP_BLAS_PAD"  # 0: no row padding (see the shim's sgemm_padded)
ENV_GEMV_ROWS = "MLX_MTP_BLAS_GEMV_ROWS"  # float32 products this thin run as sgemv (0: never)
ENV_THIN = "MLX_MTP_BLAS_THIN"  # 0: no thin-product kernel (see the shim's sgemm_thin)
THIN_MAX_ROWS = 8  # the kernel's row limit (the shim's THIN_MAX_ROWS)
# Weights at least this large (float32 elements) that no measurement covers run 1..8-row
# products on the kernel: they stream from memory, which the kernel reads once for all rows.
LARGE_ELEMS = 4 << 20

# Why this process is on the reference BLAS (for describe()).
_reason = "the OpenBLAS shim was not loaded"


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


# Tried in order: the thin-product kernel is vectorised for the CPU it is built on and split
# over threads with OpenMP; a compiler without -march=native or OpenMP builds it without them.
BUILD_FLAGS = (("-O3", "-march=native", "-fopenmp"), ("-O3", "-march=native"),
               ("-O3", "-fopenmp"), ("-O3",))


def _compile(cc: list, tmp: Path) -> tuple[Optional[list], str]:
    """(the command that built ``tmp``, "") or (None, the last failure's last line)."""
    last = ""
    for flags in BUILD_FLAGS:
        cmd = [*cc, *flags, "-shared", "-fPIC", "-o", str(tmp), str(SHIM_SOURCE), "-ldl",
               "-lpthread"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if p.returncode == 0:
            return cmd, ""
        tail = p.stderr.strip()[-600:]
        log.info("compiling the OpenBLAS shim failed: %s\n%s", shlex.join(cmd), tail)
        last = tail.splitlines()[-1] if tail else f"exit code {p.returncode}"
    return None, last


def _build_shim(cache_dir=None) -> tuple[Optional[Path], str]:
    """(path of the compiled shim, "") or (None, why not). Built per CPU (-march=native)."""
    from . import machine

    sources = sorted(SHIM_SOURCE.parent.glob("*.c"))  # the shim and the files it includes
    text = b"".join(f.read_bytes() for f in sources)
    text += f"|{machine.cpu_name()}|{BUILD_FLAGS}".encode()
    digest = hashlib.sha256(text).hexdigest()[:12]
    out = Path(cache_dir or _cache_dir()) / f"{SHIM_PREFIX}{digest}.so"
    if out.exists():
        return out, ""
    cc = _compiler()
    if cc is None:
        return None, ("no C compiler to build the OpenBLAS shim "
                      "(install one, e.g. apt-get install gcc, or set $CC)")
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")  # same dir, so os.replace is atomic
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd, last = _compile(cc, tmp)
        if cmd is None:
            return None, f"compiling the OpenBLAS shim with {cc[0]} failed: {last}"
        log.info("built the OpenBLAS shim: %s", shlex.join(cmd))
        os.replace(tmp, out)
        return out, ""
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"could not build the OpenBLAS shim in {out.parent}: {e}"
    finally:
        tmp.unlink(missing_ok=True)


def build_shim(cache_dir=None) -> Optional[Path]:
    """Compile ``csrc/openblas_shim.c`` once into the cache dir; None if that is impossible."""
    return _build_shim(cache_dir)[0]


_shim = None  # the loaded shim (ctypes.CDLL), once preload() succeeded
_configured = False
_openblas_on = True  # what configure() decided (route(None) restores it)


def small_elems() -> int:
    """Thin (single-row) products ``x @ W`` (W stored (K, N)) that do not run as sgemv (see
    :func:`gemv_rows`) go to OpenBLAS's gemm while their weight has fewer elements than this ($MLX_MTP_BLAS_SMALL, default 1.3M: measured crossover between
    1.05M, where OpenBLAS is faster for one row, and 1.57M, where the reference BLAS is). Other
    thin products, ``x @ W.T`` among them (linear layers), always go to OpenBLAS."""
    try:
        return max(0, int(os.environ.get(ENV_SMALL, "1300000")))
    except ValueError:
        return 1300000


def min_rows() -> int:
    """Smallest row and column count routed to OpenBLAS's gemm whatever the layout, for products
    that do not run as sgemv ($MLX_MTP_BLAS_MIN_ROWS, default 2)."""
    try:
        return max(1, int(os.environ.get(ENV_MIN_ROWS, "2")))
    except ValueError:
        return 2


def gemv_rows() -> int:
    """Float32 products with at most this many rows (or columns) run as one OpenBLAS sgemv per
    row ($MLX_MTP_BLAS_GEMV_ROWS, default 3: per row, sgemv streams the weight ~3.5x faster than
    sgemm's packing, and four sgemv cost as much as one 4-row sgemm; measured with
    ``python -m mlx_mtp.platform``). 0 turns the route off; thinner products then follow
    :func:`min_rows` and :func:`small_elems`."""
    try:
        return max(0, int(os.environ.get(ENV_GEMV_ROWS, "3")))
    except ValueError:
        return 3


def thin_on() -> bool:
    """Whether products of 1..8 rows may run on the shim's thin kernel ($MLX_MTP_BLAS_THIN, on
    unless "0"): which ones do is measured per weight shape (``gemv_limits.py``)."""
    return os.environ.get(ENV_THIN, "1") != "0"


def _why_not_openblas() -> tuple[Optional[str], Optional[Path], Optional[Path]]:
    """(reason, None, None) or (None, shim, openblas)."""
    if sys.platform != "linux":
        return "MLX uses its platform BLAS here (the shim is for the Linux CPU wheel)", None, None
    if not reference_blas_in_use():
        return "MLX is not linked to the mlx-cpu wheel's reference BLAS", None, None
    if "mlx.core" in sys.modules:
        return ("MLX was imported before mlx_mtp (import mlx_mtp first to get OpenBLAS "
                "matmuls)"), None, None
    openblas = find_openblas()
    if openblas is None:
        return ("numpy's bundled OpenBLAS (numpy.libs/libscipy_openblas64_*.so) not found; "
                "install numpy's PyPI wheel"), None, None
    shim, why = _build_shim()
    return (why, None, None) if shim is None else (None, shim, openblas)


def preload() -> bool:
    """Load the shim before MLX is imported, routing multi-row GEMMs to OpenBLAS.

    Safe to call any number of times; never raises (a failure leaves the reference BLAS).
    ``MLX_MTP_BLAS=reference`` skips it. Returns whether the shim is loaded.
    """
    global _shim, _reason
    if _shim is not None:
        return True
    if default_mode() == "reference":
        _reason = f"requested with ${ENV_MODE}=reference"
        return False
    try:
        why, shim, openblas = _why_not_openblas()
        if why is not None:
            _reason = why
            return False
        import ctypes

        # Read by the shim on its first call; an explicit $MLX_MTP_OPENBLAS wins.
        os.environ.setdefault(ENV_OPENBLAS, str(openblas))
        _shim = ctypes.CDLL(str(shim), mode=ctypes.RTLD_GLOBAL)
        _shim.mlx_mtp_shim_configure.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_long]
        _shim.mlx_mtp_shim_configure(1, min_rows(), small_elems())
        _shim.mlx_mtp_shim_padded_calls.restype = ctypes.c_long
        _shim.mlx_mtp_shim_set_padding(int(os.environ.get(ENV_PAD, "1") != "0"))
        _shim.mlx_mtp_shim_set_gemv_rows.argtypes = [ctypes.c_long]
        _shim.mlx_mtp_shim_gemv_rows.restype = ctypes.c_long
        _shim.mlx_mtp_shim_gemv_calls.restype = ctypes.c_long
        _shim.mlx_mtp_shim_set_gemv_rows(gemv_rows())
        _shim.mlx_mtp_shim_set_gemv_shape.argtypes = [ctypes.c_long] * 3
        _shim.mlx_mtp_shim_gemv_limit.argtypes = [ctypes.c_long] * 2
        _shim.mlx_mtp_shim_gemv_limit.restype = ctypes.c_long
        _shim.mlx_mtp_shim_set_thin.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long]
        _shim.mlx_mtp_shim_set_thin_shape.argtypes = [ctypes.c_long] * 3
        _shim.mlx_mtp_shim_thin_calls.restype = ctypes.c_long
        _shim.mlx_mtp_shim_set_thin(int(thin_on()), 0, LARGE_ELEMS)
    except Exception as e:  # a platform nicety must never stop the import
        _shim, _reason = None, f"loading the OpenBLAS shim failed: {e}"
    return _shim is not None


def active() -> bool:
    """True if the shim is loaded *and* routes multi-row GEMMs to OpenBLAS."""
    return _shim is not None and bool(_shim.mlx_mtp_shim_uses_openblas())


def set_row_padding(on: bool):
    """Pad OpenBLAS products of 2..64 rows to a multiple of four (the default; see the shim)."""
    if _shim is not None:
        _shim.mlx_mtp_shim_set_padding(int(on))


def padded_calls() -> int:
    """Products the shim has run padded so far (0 without the shim)."""
    return int(_shim.mlx_mtp_shim_padded_calls()) if _shim is not None else 0


def routing() -> str:
    """Which path float32 products take here, in a few words (step costs are stored per routing:
    the sgemv route alone makes a plain decode step several times cheaper)."""
    if not active():
        return "reference"
    return (f"openblas, sgemv up to {int(_shim.mlx_mtp_shim_gemv_rows())} rows "
            f"or a shape's measured limit{', thin kernel' if thin_on() else ''}")


def gemv_calls() -> int:
    """Products the shim has run as sgemv so far (0 without the shim)."""
    return int(_shim.mlx_mtp_shim_gemv_calls()) if _shim is not None else 0


def thin_calls() -> int:
    """Products the shim has run on its thin kernel so far (0 without the shim)."""
    return int(_shim.mlx_mtp_shim_thin_calls()) if _shim is not None else 0


ROUTES = ("reference", "sgemm", "sgemv", "kernel")


def route(path: Optional[str]):
    """Send every float32 product down one path (for timing them against each other in one
    process: "reference", "sgemm": OpenBLAS's, even for one row, "sgemv": one per row, for up to
    8 rows, "kernel": the shim's thin kernel, for up to 8 rows), or back to the configured
    routing (None)."""
    if _shim is None:
        return
    if path is None:
        _apply(_openblas_on)
        return
    _shim.mlx_mtp_shim_configure(int(path != "reference"), 1, 0)
    _shim.mlx_mtp_shim_set_gemv_rows(8 if path == "sgemv" else 0)
    _shim.mlx_mtp_shim_use_shape_limits(0)
    _shim.mlx_mtp_shim_set_thin(int(path == "kernel"), 1, LARGE_ELEMS)


def set_gemv_limit(k: int, n: int, rows: int):
    """Products with ``k`` inputs and ``n`` outputs run as sgemv up to ``rows`` rows (their
    measured limit, ``gemv_limits.py``) instead of :func:`gemv_rows`."""
    if _shim is not None:
        _shim.mlx_mtp_shim_set_gemv_shape(k, n, rows)


def set_thin_rows(k: int, n: int, rows):
    """Products with ``k`` inputs and ``n`` outputs run on the thin kernel at these row counts
    (measured, ``gemv_limits.py``; after :func:`set_gemv_limit` for the same shape)."""
    if _shim is not None:
        _shim.mlx_mtp_shim_set_thin_shape(k, n, sum(1 << (m - 1) for m in rows))


def gemv_limit(k: int, n: int) -> int:
    """Rows up to which a product with ``k`` inputs and ``n`` outputs runs as sgemv (0: none,
    or no shim)."""
    return int(_shim.mlx_mtp_shim_gemv_limit(k, n)) if _shim is not None else 0


def _apply(openblas: bool):
    """The configured routing, on the shim (see :func:`configure`)."""
    global _openblas_on
    _openblas_on = openblas
    if openblas:
        _shim.mlx_mtp_shim_configure(1, min_rows(), small_elems())
        _shim.mlx_mtp_shim_set_gemv_rows(gemv_rows())
        _shim.mlx_mtp_shim_use_shape_limits(1)
        _shim.mlx_mtp_shim_set_thin(int(thin_on()), 0, LARGE_ELEMS)
    else:
        _shim.mlx_mtp_shim_configure(0, min_rows(), small_elems())


def _use_reference(why: str):
    global _reason
    _reason = why
    if _shim is not None:
        _apply(False)


def configure(mode: Optional[str] = None, rtol: float = 1e-4):
    """Apply ``mode`` ("auto", "openblas", "reference"; default $MLX_MTP_BLAS or auto) and,
    when OpenBLAS is in use, check a few MLX matmuls against numpy (~10 ms); on a mismatch
    everything goes back to the reference BLAS ("openblas": BlasError)."""
    global _configured, _reason
    mode = mode or default_mode()
    if mode not in MODES:
        raise BlasError(f"--blas / ${ENV_MODE} must be one of {', '.join(MODES)} (got {mode!r})")
    _configured = True
    if mode == "reference":
        _use_reference("requested with --blas reference")
        return
    if _shim is not None:
        _apply(True)
    if not active():
        if _shim is not None:
            _reason = f"the shim could not use ${ENV_OPENBLAS} ({os.environ.get(ENV_OPENBLAS)})"
        if mode == "openblas":
            raise BlasError(f"--blas openblas is not possible: {_reason}. Fix that, or use "
                            "--blas reference (or auto) to run on the reference BLAS.")
        log.info("CPU matmuls stay on the reference BLAS: %s", _reason)
        return
    bad = _mismatch(rtol) or (_kernel_mismatch(rtol) if thin_on() else None)
    if bad is not None:
        if mode == "openblas":
            raise BlasError(f"--blas openblas: OpenBLAS results failed the check ({bad}); "
                            "use --blas reference")
        log.warning("OpenBLAS matmul check failed (%s); using the reference BLAS", bad)
        _use_reference("OpenBLAS results disagreed with the reference check")


def ensure_configured():
    """For the Python API (``load``): configure once with the default mode."""
    if not _configured:
        configure()


def _check_cases():
    import numpy as np

    def r(*shape, dtype=np.float32, phase=0.0):  # cheap deterministic data (no numpy.random)
        n = int(np.prod(shape))
        return np.sin(np.arange(n) * 0.7315 + n + phase).reshape(shape).astype(dtype)

    def c(*shape):
        return (r(*shape) + 1j * r(*shape, phase=1.0)).astype(np.complex64)

    return [  # (a, b, transpose a, transpose b): M = 1, 2, 3, 64, N = 2, transposes, batched,
        # f64, c64; a (64, 1) A transposed is a single row with lda 1
        (r(1, 256), r(256, 192), False, False), (r(3, 256), r(256, 192), False, False),
        (r(2, 256), r(192, 256), False, True), (r(64, 1), r(192, 64), True, True),
        (r(64, 96), r(96, 2), False, False), (r(96, 64), r(2, 96), True, True),
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


def _kernel_mismatch(rtol: float) -> Optional[str]:
    """The check again with every product of 1..8 rows on the thin kernel (the configured
    routing sends only measured and large weights there)."""
    route("kernel")
    try:
        bad = _mismatch(rtol)
        return bad and f"thin kernel: {bad}"
    finally:
        route(None)


def add_argument(parser):
    parser.add_argument(
        "--blas", choices=MODES, default=default_mode(),
        help="CPU matmul library on Linux: auto = numpy's OpenBLAS through a small compiled "
             "shim when possible, else MLX's reference BLAS; openblas = fail if that is "
             "impossible (default: $MLX_MTP_BLAS or auto)")


def setup(args):
    """The CLI's platform step: apply ``--blas``, verify, report which BLAS runs."""
    if getattr(args, "server", None):  # bench --server: a client, it runs no model
        return
    configure(args.blas)
    if args.command == "serve":  # the server's basicConfig is then a no-op: keep its format
        logging.basicConfig(level=args.log_level,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        log.info(describe())
    elif args.command != "generate" and not getattr(args, "quiet", False):
        print(describe(), file=sys.stderr)  # generate prints it with its stats


def describe() -> str:
    """One line for logs: which BLAS runs MLX's CPU matmuls, and why."""
    if active():
        lib = f"mlx-mtp shim, numpy's {Path(os.environ.get(ENV_OPENBLAS, '?')).name}"
        rows = int(_shim.mlx_mtp_shim_gemv_rows())
        thin = ("; 1-8 rows on the thin kernel where measured fastest, or for weights "
                f"of {LARGE_ELEMS >> 20}M+ elements" if thin_on() else "")
        if rows:
            return (f"CPU matmuls: OpenBLAS, float32 products of up to {rows} "
                    f"row{'s' * (rows > 1)} as sgemv or a weight shape's measured limit"
                    f"{thin} ({lib})")
        return (f"CPU matmuls: OpenBLAS except single rows times large x @ W weights "
                f"(reference BLAS; {lib})")
    if not reference_blas_in_use():
        return "CPU matmuls: MLX's built-in BLAS"
    return f"CPU matmuls: reference BLAS ({_reason})"

