"""This machine's measured costs behind ``--dtype auto`` on the CPU: float32 or as stored.

A decode step streams every weight through a few rows: a plain step one row, a K = 3
verify pass four. Whether float32 (BLAS) beats the checkpoint's bf16/fp16 (MLX's own CPU
kernels) there depends on the machine, so it is measured once per machine and shape
class: a 1-row and a 4-row product with a weight of the model's width (``hidden`` inputs;
``outputs`` rows holding the model's float32 bytes up to ``MAX_BYTES``, past the caches),
in both dtypes, interleaved, the fastest of a few repetitions (other load only adds
time): a few tenths of a second. The figures are stored beside the step costs
(``platform/machine.py``) and every later start reads them, so the choice never depends
on the load at start (the load average when they were taken is stored with them; deleting
the file measures again). A corrupt file or one of another format is ignored (measured
again). ``MLX_MTP_MEASURE_DTYPE=0`` forbids measuring: stored figures are still read, and
without them the loader's static rule decides (``loader.choose_dtype``).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx

from ...platform import machine

FORMAT = "mlx-mtp-dtype-timing-1"
ROWS = (1, 4)  # a plain step's row, a K = 3 verify pass's
MAX_BYTES = 16 << 20  # float32 bytes of the measured weight: past the caches, quick to time
REPS = 5
BUDGET_S = 0.25  # measuring stops after this (at least two timed rounds)
FLOAT32_MARGIN = 0.95  # float32 doubles the weights' memory: it must be 5 % faster to pay
ENV_MEASURE = "MLX_MTP_MEASURE_DTYPE"  # "0": never measure (tests, read-only setups)
CONSULT = ("rule", "stored", "measure")  # what decides ``auto`` (loader.choose_dtype)
_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


@dataclass(frozen=True)
class ShapeClass:
    """The product a decode step repeats, at a model's shape: ``half`` is its dtype."""

    half: str
    hidden: int
    outputs: int

    @classmethod
    def of(cls, floats: list, half: str) -> "ShapeClass":
        """Of a model's float weights: the input width holding most of their bytes, and
        as many output rows as their float32 copy fills (up to ``MAX_BYTES``, rounded up
        to a power of two, so nearby sizes share one class)."""
        by_width: Dict[int, int] = {}
        for v in floats:
            if v.ndim >= 2:
                by_width[v.shape[-1]] = by_width.get(v.shape[-1], 0) + v.size
        hidden = max(by_width, key=lambda w: (by_width[w], w)) if by_width else 1
        size = max(4 * sum(v.size for v in floats), 1)
        size = min(1 << (size - 1).bit_length(), MAX_BYTES)
        return cls(half, hidden, max(1, size // (4 * hidden)))

    def key(self) -> str:
        text = f"{FORMAT}|{machine.describe()}|{self.half}|{self.hidden}|{self.outputs}"
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def describe(self) -> str:
        return f"{self.hidden}-wide rows x {self.outputs} outputs"


@dataclass(frozen=True)
class DtypeTiming:
    """Seconds of the product (the fastest repetition) per dtype name and row count."""

    shape: ShapeClass
    seconds: Dict[str, Dict[int, float]]
    load: Optional[float] = None  # the load average while measuring

    def total(self, dtype: str) -> float:
        return sum(self.seconds[dtype].values())

    @property
    def float32_pays(self) -> bool:
        return self.total("float32") <= FLOAT32_MARGIN * self.total(self.shape.half)

    def describe(self) -> str:
        """The figures in one phrase (the loader's reason, doctor's line)."""
        rows = ", ".join(f"{r} row{'s' if r > 1 else ''} {1e3 * self.seconds['float32'][r]:.2f} "
                         f"vs {1e3 * self.seconds[self.shape.half][r]:.2f} ms" for r in ROWS)
        return f"{self.shape.describe()}: float32 vs {self.shape.half}, {rows}"


def timing_file(shape: ShapeClass) -> Path:
    return machine.cache_dir() / f"dtype-{shape.key()}.json"


def stored(shape: ShapeClass) -> Optional[DtypeTiming]:
    """The stored figures for ``shape`` on this machine; None without a usable file (none,
    unreadable, of another format or shape, or figures missing or not positive)."""
    try:
        data = json.loads(timing_file(shape).read_text())
        if data["format"] != FORMAT or data["shape"] != asdict(shape):
            return None
        seconds = {d: {r: float(data["seconds"][d][str(r)]) for r in ROWS}
                   for d in ("float32", shape.half)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not all(0 < s < float("inf") for by_rows in seconds.values() for s in by_rows.values()):
        return None
    load = data.get("load")
    return DtypeTiming(shape, seconds, float(load) if isinstance(load, (int, float)) else None)


def save(timing: DtypeTiming) -> bool:
    """Write ``timing`` atomically (readers never see half a file); False if it cannot."""
    path = timing_file(timing.shape)
    seconds = {d: {str(r): s for r, s in by_rows.items()} for d, by_rows in timing.seconds.items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({"format": FORMAT, "machine": machine.describe(),
                       "shape": asdict(timing.shape), "seconds": seconds, "load": timing.load},
                      f)
        os.replace(tmp, path)
    except OSError:
        return False
    return True


def measure(shape: ShapeClass, reps: int = REPS, budget: float = BUDGET_S) -> DtypeTiming:
    """Time the products (see the module doc); explicit keys leave MLX's global seed alone."""
    w = mx.random.uniform(-0.05, 0.05, (shape.outputs, shape.hidden), key=mx.random.key(0))
    x = mx.random.uniform(-1, 1, (max(ROWS), shape.hidden), key=mx.random.key(1))
    cases = {(d, r): (x[:r].astype(_DTYPES[d]), w.astype(_DTYPES[d]))
             for d in ("float32", shape.half) for r in ROWS}
    mx.eval(cases)
    times: Dict[tuple, list] = {case: [] for case in cases}
    start = time.perf_counter()
    for i in range(reps + 1):  # round 0 warms
        for case, (rows, weight) in cases.items():
            tic = time.perf_counter()
            mx.eval(rows @ weight.T)  # as nn.Linear multiplies
            if i:
                times[case].append(time.perf_counter() - tic)
        if i >= 2 and time.perf_counter() - start > budget:
            break
    seconds: Dict[str, Dict[int, float]] = {}
    for (d, r), ts in times.items():
        seconds.setdefault(d, {})[r] = min(ts)
    return DtypeTiming(shape, seconds, _load_average())


def _load_average() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def measuring_allowed() -> bool:
    """Not forbidden by ``MLX_MTP_MEASURE_DTYPE=0``, and the figures can be stored (else
    every start would measure again)."""
    if os.environ.get(ENV_MEASURE, "1") == "0":
        return False
    try:
        machine.cache_dir().mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(machine.cache_dir(), os.W_OK)


def timing_for(shape: ShapeClass, consult: str) -> Optional[DtypeTiming]:
    """The figures that decide ``auto`` (``consult``: one of ``CONSULT``): None for "rule";
    the stored ones; for "measure" without stored ones, measured now and stored (when
    measuring is allowed)."""
    if consult not in CONSULT:
        raise ValueError(f"consult must be one of {CONSULT} (got {consult!r})")
    if consult == "rule":
        return None
    timing = stored(shape)
    if timing is None and consult == "measure" and measuring_allowed():
        timing = measure(shape)
        save(timing)
    return timing
