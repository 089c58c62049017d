"""Which route each row count (1..8) of a float32 product takes, per weight shape: the shim's
thin kernel, sgemv or sgemm, measured once per machine and stored.

Why: the shim runs a product of a few rows as one OpenBLAS sgemv per row (``blas.gemv_rows``,
3 by default) because sgemm's packing costs more than the product for one row. Where the next row
stops paying depends on the weight: one that stays in the caches is re-read cheaply by each row
(384x768: eight sgemv beat one 8-row sgemm), one that streams from memory is read once per row
(1024x4096: sgemm wins from four rows on). A verify pass of K drafts is K + 1 rows, so a single
limit makes a deep draft's verify cost jump on small models and the K policy stop short of it.
The shim's thin kernel reads the weight once for all rows (``blas.thin_on``), which wins on
most shapes at every row count; where it does not, the other two routes take those rows.

How: for each distinct float32 matrix of a loaded model (up to ``MAX_ELEMS`` elements: larger ones
stream from memory, where the kernel runs every row count, and are slow to time), 1..``MAX_ROWS``
rows are timed on each route, interleaved, the fastest of a few repetitions (other load only adds
time); the kernel takes the row counts where it is fastest (``thin_rows``, ties to the kernel so
plain and verify rows round alike), and of the others sgemv runs those up to the limit past which
sgemm makes the products cheapest (``best_limit``). The routes
are stored per machine (``machine.cache_dir``) and every later load reads them, so routing never
depends on the load at start; deleting the file measures again. ``MLX_MTP_MEASURE_DTYPE=0`` (the test suite) forbids
measuring, as it does for the dtype's figures: stored limits still apply.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterable, List, Tuple

from . import blas, machine

FORMAT = "mlx-mtp-gemv-limits-2"
MAX_ROWS = blas.THIN_MAX_ROWS  # a K = 7 verify; deeper drafts and batches run as sgemm
MAX_ELEMS = blas.LARGE_ELEMS  # 16 MB of float32: larger weights run 1..8 rows on the kernel
THIN_SLACK = 1.05  # the kernel keeps a row count it is this close to the best route on
MAX_SHAPES = 24
REPS = 4
BUDGET_S = 0.5  # per load: shapes not timed by then keep the default (timed next time)
ENV_MEASURE = "MLX_MTP_MEASURE_DTYPE"  # "0": never measure (shared with models/io/dtype_timing)

Shape = Tuple[int, int]  # (inputs k, outputs n) of x @ W.T with W stored (n, k)
Routes = Tuple[int, Tuple[int, ...]]  # (sgemv limit, row counts on the thin kernel)


def shapes_of(named_params: Iterable) -> List[Shape]:
    """The distinct float32 matrices of a model (``tree_flatten`` of its parameters) as
    (inputs, outputs), largest first, up to ``MAX_SHAPES`` of at most ``MAX_ELEMS``."""
    import mlx.core as mx

    seen = {(int(v.shape[1]), int(v.shape[0])) for _, v in named_params
            if v.ndim == 2 and v.dtype == mx.float32 and min(v.shape) > MAX_ROWS
            and v.size <= MAX_ELEMS}
    return sorted(seen, key=lambda s: (-s[0] * s[1], s))[:MAX_SHAPES]


def _key() -> str:
    """This machine and BLAS, without the routing (which these limits are part of)."""
    import mlx.core as mx

    lib = Path(os.environ.get(blas.ENV_OPENBLAS, "?")).name
    text = (f"{FORMAT}|{platform.machine()}|{machine.cpu_name()}|{os.cpu_count()}|"
            f"mlx {mx.__version__}|{lib}|default {blas.gemv_rows()}|thin {blas.thin_on()}")
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def limits_file() -> Path:
    return machine.cache_dir() / f"gemv-{_key()}.json"


def stored() -> Dict[Shape, Routes]:
    """The stored routes ({} without a usable file)."""
    try:
        data = json.loads(limits_file().read_text())
        if data["format"] != FORMAT:
            return {}
        out = {}
        for name, entry in data["shapes"].items():
            k, n = (int(d) for d in name.split("x"))
            rows, thin = int(entry["rows"]), tuple(int(m) for m in entry["thin"])
            if 0 <= rows <= MAX_ROWS and all(1 <= m <= MAX_ROWS for m in thin):
                out[(k, n)] = (rows, thin)
        return out
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _save(measured: Dict[Shape, dict]):
    """Add ``measured`` to the file, atomically (readers never see half a file)."""
    path = limits_file()
    try:
        data = json.loads(path.read_text())
        shapes = data["shapes"] if data.get("format") == FORMAT else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        shapes = {}
    shapes.update({f"{k}x{n}": entry for (k, n), entry in measured.items()})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({"format": FORMAT, "machine": machine.cpu_name(), "shapes": shapes}, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache: measured again next time, nothing worse


def measure(shape: Shape, reps: int = REPS) -> dict:
    """Time 1..MAX_ROWS rows of ``x @ W.T`` on each route; {"rows": sgemv limit, "thin": [row
    counts on the kernel], "sgemv": [ms..], "sgemm": [ms..], "kernel": [ms..]} (index i: i + 1
    rows; no kernel with ``$MLX_MTP_BLAS_THIN=0``)."""
    import mlx.core as mx

    k, n = shape
    w = mx.random.uniform(-0.05, 0.05, (n, k), key=mx.random.key(0))
    x = mx.random.uniform(-1, 1, (MAX_ROWS, k), key=mx.random.key(1))
    rows = [x[:m] for m in range(1, MAX_ROWS + 1)]
    mx.eval(w, rows)
    paths = ("sgemv", "sgemm", "kernel") if blas.thin_on() else ("sgemv", "sgemm")
    best = {p: [float("inf")] * MAX_ROWS for p in paths}
    try:
        for rep in range(reps + 1):  # round 0 warms
            for path in paths if rep % 2 else paths[::-1]:
                blas.route(path)
                for i, r in enumerate(rows):
                    tic = time.perf_counter()
                    mx.eval(r @ w.T)
                    if rep:
                        best[path][i] = min(best[path][i], time.perf_counter() - tic)
    finally:
        blas.route(None)
    thin = thin_rows(best["kernel"], best["sgemv"], best["sgemm"]) if "kernel" in best else []
    others = [[0.0 if m + 1 in thin else t for m, t in enumerate(best[p])]
              for p in ("sgemv", "sgemm")]  # the kernel's rows weigh on neither side
    return {"rows": best_limit(*others), "thin": thin,
            **{p: [round(1e3 * t, 4) for t in ts] for p, ts in best.items()}}


def thin_rows(kernel: List[float], sgemv: List[float], sgemm: List[float]) -> List[int]:
    """The row counts the kernel runs: from the first to the last where it is within
    ``THIN_SLACK`` of the faster of the other routes (rows it shares with plain steps round
    alike, so near-ties go to it, and a spike of load between two wins does not split them)."""
    wins = [m + 1 for m, t in enumerate(kernel) if t <= THIN_SLACK * min(sgemv[m], sgemm[m])]
    return list(range(wins[0], wins[-1] + 1)) if wins else []


def best_limit(sgemv: List[float], sgemm: List[float]) -> int:
    """The limit L that makes products of 1..MAX_ROWS rows cheapest in total (sgemv up to L
    rows, sgemm past it); ties go to more sgemv."""
    totals = [sum(sgemv[:L]) + sum(sgemm[L:]) for L in range(len(sgemv) + 1)]
    return min(range(len(totals)), key=lambda L: (totals[L], -L))


def measuring_allowed() -> bool:
    return os.environ.get(ENV_MEASURE, "1") != "0"


def apply(named_params: Iterable, budget: float = BUDGET_S) -> Dict[Shape, Routes]:
    """Give the shim this model's routes (stored, else measured now within ``budget``
    seconds and stored); {shape: (sgemv limit, kernel rows)} of what applies. Nothing
    happens unless the sgemv route is on."""
    if not blas.active() or blas.gemv_rows() == 0:
        return {}
    shapes = shapes_of(named_params)
    known = stored()
    missing = [s for s in shapes if s not in known]
    if missing and measuring_allowed():
        start, measured = time.perf_counter(), {}
        for shape in missing:
            if time.perf_counter() - start > budget:
                break
            measured[shape] = measure(shape)
        if measured:
            _save(measured)
            known.update({s: (e["rows"], tuple(e["thin"])) for s, e in measured.items()})
    limits = {s: known[s] for s in shapes if s in known}
    for (k, n), (rows, thin) in limits.items():
        blas.set_gemv_limit(k, n, rows)
        blas.set_thin_rows(k, n, thin)
    return limits


def _rows_text(rows: Iterable[int]) -> str:
    rows = sorted(rows)
    if rows and rows == list(range(rows[0], rows[-1] + 1)) and len(rows) > 1:
        return f"{rows[0]}-{rows[-1]}"
    return ",".join(map(str, rows)) or "none"


def describe() -> str:
    """The stored routes in one line (doctor, ``python -m mlx_mtp.platform``)."""
    limits = stored()
    if not limits:
        return "none measured yet (a model's first load measures its shapes)"
    shown = ", ".join(f"{k}x{n}: {r} (kernel {_rows_text(thin)})"
                      for (k, n), (r, thin) in sorted(limits.items()))
    return (f"rows run as sgemv (and on the thin kernel), per measured shape (inputs x outputs): "
            f"{shown} ({limits_file()})")
