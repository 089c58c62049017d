"""What both halves of ``mlx-mtp bench`` (in-process, server) share: list flags, the
machine description stored with every result, the progress bar, the plots switch."""

from __future__ import annotations

import datetime as _dt
import os
import platform
from typing import List


def int_list(flag: str, value: str, lo: int, hi: int = 1 << 30) -> List[int]:
    """``--flag 0,1,2``: distinct integers in [lo, hi], in order; else a UserError."""
    from ..options import UserError

    try:
        out = [int(x) for x in str(value).split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} takes comma-separated integers, e.g. 0,1,2,3 (got {value!r})")
    if not out:
        raise UserError(f"{flag} is empty")
    bad = [x for x in out if not lo <= x <= hi]
    if bad:
        raise UserError(f"{flag}: values must be between {lo} and {hi} (got {bad})")
    return list(dict.fromkeys(out))


def machine_info() -> dict:
    import mlx.core as mx

    from .. import __version__

    info = {"platform": platform.platform(), "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "mlx": getattr(mx, "__version__", "?"), "device": _device_name(mx.default_device()),
            "mlx_mtp": __version__, "date": _dt.datetime.now().isoformat(timespec="seconds")}
    try:
        import mlx_lm

        info["mlx_lm"] = mlx_lm.__version__
    except Exception:  # pragma: no cover - mlx-lm is a dependency
        pass
    from ..platform.blas import describe

    info["blas"] = describe()  # in-process runs: which BLAS ran the CPU matmuls
    if hasattr(os, "getloadavg"):
        info["load_avg_1m"] = round(os.getloadavg()[0], 2)  # other work sharing the CPU
    return info


def _device_name(device) -> str:
    kind = getattr(getattr(device, "type", None), "name", None)
    return kind or str(device)


def progress(quiet: bool):
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    return Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TimeRemainingColumn(),
                    console=Console(stderr=True), transient=True, disable=quiet)


def plots_on(args, console) -> bool:
    """Whether to draw the PNG plots: asked for and matplotlib importable (else say how)."""
    from .. import plots

    if args.no_plots:
        return False
    if plots.pyplot() is None:
        console.print(plots.missing_note("PNG plots"), highlight=False, markup=False)
        return False
    return True


def wrote(console, paths) -> None:
    console.print("wrote " + ", ".join(str(p) for p in paths), highlight=False, markup=False)
