"""Measured step costs kept across processes, so a fresh process decides K from its
first steps instead of learning what a step costs while it decodes.

Costs depend on the model's shapes and dtypes (not its values), the machine, MLX and
the matmul route, and whether decode steps are compiled: that is the file's key. When
no file exists, ``calibrate`` times a few plain and draft steps of a dummy sequence
within a time budget. ``mlx-mtp generate`` loads (or calibrates) before decoding and
saves what it measured after; ``mlx-mtp serve`` loads them and times only the batch
sizes the file lacks. The step costs of context drafts (``draft_source.StepCosts``), which
only live steps measure, are kept in the same file: ``generate`` saves them after its run,
``serve`` when it shuts down.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Optional

import mlx.core as mx

from .policy import DraftPolicy

FORMAT = "mlx-mtp-step-costs-1"


def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "mlx-mtp" / "step-costs"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def cost_key(model) -> str:
    """What a step's cost depends on (see the module doc), as a short digest."""
    from mlx.utils import tree_flatten

    from ..platform import blas

    h = hashlib.sha256(f"{FORMAT}|{platform.machine()}|{_cpu_name()}|{os.cpu_count()}|"
                       f"{mx.default_device()}|mlx {mx.__version__}|"
                       f"openblas {blas.active()}|compiled {getattr(model, 'compiled', False)}"
                       .encode())
    for name, p in tree_flatten(model.parameters()):
        h.update(f"|{name}:{p.dtype}:{tuple(p.shape)}".encode())
    return h.hexdigest()[:32]


def cost_file(model) -> Path:
    return cache_dir() / f"{cost_key(model)}.json"


def _stored(model) -> dict:
    """The file's content ({} when there is none, or an unreadable one)."""
    try:
        data = json.loads(cost_file(model).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def load(model, policy: Optional[DraftPolicy], sources=None) -> bool:
    """Feed stored costs to ``policy`` and, with ``sources`` (``draft_source.DraftSources``),
    the step costs of context drafts (8-32 positions deep, measured live) to its
    ``costs``; False when there are no policy costs (or unreadable ones)."""
    data = _stored(model)
    try:
        cells = [(int(B), int(k), [float(s) for s in secs]) for B, k, secs in data["cells"]]
        context = [(int(B), int(k), int(head), [float(s) for s in secs])
                   for B, k, head, secs in data.get("context_cells", [])]
    except (ValueError, KeyError, TypeError):
        return False
    for B, k, secs in cells if policy is not None else ():
        for s in secs:
            policy.costs.observe(B, k, s)
    for B, k, head, secs in context if sources is not None else ():
        for s in secs:
            sources.costs.observe(B, k, head, s)
    return bool(cells)


def save(model, policy: Optional[DraftPolicy], sources=None):
    """Write the policy's measured costs and ``sources``' context-draft step costs; a kind
    not given, or with nothing measured, keeps its stored value. Atomic: readers never see
    half a file."""
    measured = ([[B, k, list(secs)] for (B, k), secs in sorted(policy.costs.cells.items()) if secs]
                if policy is not None else [])
    context = ([[B, k, head, list(secs)]
                for (B, k, head), secs in sorted(sources.costs.cells.items()) if secs]
               if sources is not None else [])
    if not measured and not context:
        return
    old = _stored(model)
    cells = measured or old.get("cells", [])
    context = context or old.get("context_cells", [])
    path = cost_file(model)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({"format": FORMAT, "cells": cells, "context_cells": context}, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache directory costs a calibration next time, nothing more


def uncalibrated(model, policy: DraftPolicy, max_batch: int, K: int) -> list:
    """Load stored costs into ``policy``; of the batch sizes a server times at start
    (1, 4, ``max_batch``), those still lacking a plain or a K-draft cost."""
    load(model, policy)
    sizes = sorted({1, min(4, max_batch), max_batch})
    return [B for B in sizes if not (policy.costs.count(B, 0) and policy.costs.count(B, K))]


def calibrate(model, policy: DraftPolicy, max_k: int, budget: float = 0.5) -> float:
    """Time plain and draft steps of a dummy sequence until ``budget`` seconds are spent
    (each K's first step pays one-off costs and is not counted); returns the seconds."""
    from .batch import BatchDecoder

    batch = BatchDecoder(model, adaptive=True, policy=policy)
    return batch.calibrate(max_k, batch_sizes=(1,), steps=3, prompt_len=8, budget=budget)


def policy_for(model, max_k: int, budget: float = 0.5) -> DraftPolicy:
    """An adaptive policy that knows this machine's step costs from the start."""
    policy = DraftPolicy(adaptive=True)
    if max_k and model.num_mtp_layers and not load(model, policy):
        tic = time.perf_counter()
        calibrate(model, policy, max_k, budget)
        policy.calibration_seconds = time.perf_counter() - tic
    return policy
