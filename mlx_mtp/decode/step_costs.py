"""Measured step costs kept across processes, so a fresh process decides K from its
first steps instead of learning what a step costs while it decodes.

Costs depend on the model's shapes and dtypes (not its values), the machine, MLX and
the matmul route, and whether decode steps are compiled: that is the file's key. When
no file exists, ``calibrate`` times a few plain and draft steps of a dummy sequence
within a time budget. ``mlx-mtp generate`` loads (or calibrates) before decoding and
saves what it measured after; ``mlx-mtp serve`` loads them, times only the batch
sizes the file lacks and saves what it measured when it shuts down. The file holds the
one step-cost table (``costs.StepCosts``): head steps and context drafts alike (the
latter only live steps measure). A file of an older format is ignored (its key differs
too: the format is part of it).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

from ..platform import blas, machine
from ..platform.machine import cache_dir
from .costs import StepCosts
from .policy import DraftPolicy

FORMAT = "mlx-mtp-step-costs-2"  # cells (B, k, head passes): one table


def cost_key(model) -> str:
    """What a step's cost depends on (see the module doc), as a short digest."""
    from mlx.utils import tree_flatten

    h = hashlib.sha256(f"{FORMAT}|{machine.describe()}|compiled {model.compiled}".encode())
    for name, p in tree_flatten(model.parameters()):
        h.update(f"|{name}:{p.dtype}:{tuple(p.shape)}".encode())
        if p.ndim == 2:  # how many verify rows its products run as sgemv
            h.update(f"|sgemv {blas.gemv_limit(p.shape[1], p.shape[0])}".encode())
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


def load(model, costs: StepCosts) -> bool:
    """Feed the stored cells to ``costs``; False when there are none (no file, an
    unreadable one, or one of another format)."""
    data = _stored(model)
    if data.get("format") != FORMAT:
        return False
    try:
        cells = [(int(B), int(k), int(head), [float(s) for s in secs])
                 for B, k, head, secs in data["cells"]]
    except (ValueError, KeyError, TypeError):
        return False
    for B, k, head, secs in cells:
        for s in secs:
            costs.observe(B, k, head, s)
    return bool(cells)


def save(model, costs: StepCosts):
    """Write the measured cells (with nothing measured, the stored file stays). Atomic:
    readers never see half a file."""
    cells = [[B, k, head, list(secs)] for (B, k, head), secs in sorted(costs.cells.items())
             if secs]
    if not cells:
        return
    path = cost_file(model)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({"format": FORMAT, "cells": cells}, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache directory costs a calibration next time, nothing more


def uncalibrated(model, costs: StepCosts, max_batch: int, K: int) -> list:
    """Load stored costs into ``costs``; of the batch sizes a server times at start
    (1, 4, ``max_batch``), those still lacking a plain or a K-draft cost."""
    load(model, costs)
    sizes = sorted({1, min(4, max_batch), max_batch})
    return [B for B in sizes if not (costs.count(B, 0) and costs.count(B, K))]


def calibrate(model, policy: DraftPolicy, max_k: int, budget: float = 0.5) -> float:
    """Time plain and draft steps of a dummy sequence until ``budget`` seconds are spent
    (each K's first step pays one-off costs and is not counted); returns the seconds."""
    from .batch import BatchDecoder

    batch = BatchDecoder(model, adaptive=True, policy=policy)
    return batch.calibrate(max_k, batch_sizes=(1,), steps=3, prompt_len=8, budget=budget)


def policy_for(model, max_k: int, adaptive: bool = True, budget: float = 0.5) -> DraftPolicy:
    """A policy that knows this machine's step costs from the start: the stored ones,
    else (adaptive, drafting from the head) a short calibration."""
    policy = DraftPolicy(adaptive)
    if not load(model, policy.costs) and adaptive and max_k and model.num_mtp_layers:
        tic = time.perf_counter()
        calibrate(model, policy, max_k, budget)
        policy.calibration_seconds = time.perf_counter() - tic
    return policy
