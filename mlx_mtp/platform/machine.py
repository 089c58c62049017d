"""This machine as stored measurements know it: what a measured cost depends on besides
the model (CPU, cores, device, MLX and the matmul route), and where measurements are kept
(step costs, ``decode/step_costs.py``; the load-time dtype's, ``models/io/dtype_timing.py``)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "mlx-mtp" / "step-costs"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def describe() -> str:
    """The machine part of a stored measurement's key (MLX is imported by now)."""
    import mlx.core as mx

    from . import blas

    return (f"{platform.machine()}|{cpu_name()}|{os.cpu_count()}|{mx.default_device()}|"
            f"mlx {mx.__version__}|blas {blas.routing()}")
