"""What one decode step launches, counted without evaluating it.

* ``count_nodes``: primitives in a lazy graph (``mx.export_to_dot``; nothing runs).
* ``step_graphs``: the real ``DecodeBatch`` step at each K on a prefilled sequence,
  split into draft, verify and (on rejection) replay, with the nodes of the
  Gated DeltaNet recurrence call counted apart (mlx-lm's ``gated_delta_update``:
  one fused kernel on Metal, a loop of small ops on this CPU) and the bytes of
  recurrent state each part writes. The caches are put back afterwards.
* ``count_host_syncs``: reads that make the host wait for the device.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Dict, List, Sequence

import mlx.core as mx

from ..models.cache.kv import cache_state_arrays, restore_caches, snapshot_caches
from ..models.blocks.hybrid import GatedDeltaNetBase


def count_nodes(arrays: Sequence[mx.array]) -> int:
    """Primitives in the lazy graph behind ``arrays`` (shared nodes once)."""
    arrays = [a for a in arrays if a is not None]
    if not arrays:
        return 0
    fd, path = tempfile.mkstemp(suffix=".dot")
    os.close(fd)
    try:
        mx.export_to_dot(path, *arrays)
        with open(path) as f:
            return sum("shape=rectangle" in line for line in f)
    finally:
        os.unlink(path)


class _RecurrenceNodes:
    """Counts the nodes each recurrence call adds, on evaluated stand-ins of its inputs
    (the same shapes and dtypes build the same graph)."""

    def __init__(self):
        self.calls = 0
        self.nodes = 0

    @contextlib.contextmanager
    def patch(self):
        real = GatedDeltaNetBase.recurrence

        def counted(layer, q, k, v, a, b, state, mask=None):
            stand_in = [mx.zeros(x.shape, x.dtype) for x in (q, k, v, a, b)]
            s = None if state is None else mx.zeros(state.shape, state.dtype)
            m = None if mask is None else mx.zeros(mask.shape, mask.dtype)
            mx.eval(*stand_in, *(x for x in (s, m) if x is not None))
            self.calls += 1
            self.nodes += count_nodes(list(real(layer, *stand_in, s, m)))
            return real(layer, q, k, v, a, b, state, mask)

        GatedDeltaNetBase.recurrence = counted
        try:
            yield self
        finally:
            GatedDeltaNetBase.recurrence = real


def _state_bytes(caches) -> int:
    return sum(c.nbytes for c in caches if not c.is_trimmable())  # recurrent state


@contextlib.contextmanager
def _no_async_eval():
    real = mx.async_eval
    mx.async_eval = lambda *a, **k: None
    try:
        yield
    finally:
        mx.async_eval = real


def _snapshot(dec):
    caches = list(dec.cache) + list(dec.mtp_cache or [])
    owed = dec.row.owed.copy() if dec.row.owed is not None else None
    return caches, snapshot_caches(caches), owed, dec.row.y, dec.row.n_out


def _restore(dec, snap):
    caches, saved, owed, y, n_out = snap
    restore_caches(saved)
    # KV writes are slice assignments into the buffer object: evaluate what the probe
    # wrote there, so the next probe's graph does not count it.
    mx.eval(cache_state_arrays(caches))
    dec.row.owed, dec.row.y, dec.row.n_out = owed, y, n_out


def _part(rec: _RecurrenceNodes, before: int, calls_before: int, total: int, base: int) -> dict:
    nodes = total - base
    rec_nodes = rec.nodes - before
    return {"nodes": nodes, "recurrence_calls": rec.calls - calls_before,
            "recurrence_nodes": rec_nodes, "own_nodes": nodes - rec_nodes}


def step_graphs(dec, ks: Sequence[int]) -> dict:
    """Graph sizes and state writes of one step at K = 0 (plain) and each K in ``ks``.

    ``dec``: an ``MTPDecoder`` after ``prefill`` (its caches and owed pairs are
    restored after each probe). Per K: ``draft`` (the K-token chain: MTP head, draft
    logits, sampling), ``verify`` (trunk over K+1 tokens, logits, acceptance and
    the caches' new state), ``replay`` (what rolling back to one kept position adds)
    and ``state_bytes_verify`` / ``state_bytes_replay`` (recurrent state written).
    """
    from ..decode.costs import StepCosts
    from ..decode.step import DecodeBatch

    out: Dict[object, dict] = {}
    core = DecodeBatch(dec.model, [dec.row], dec.cache, dec.mtp_cache)
    compiled = dec.model.compiled
    if compiled:  # count the lazy graph (a compiled step cannot be probed while traced)
        dec.model.set_compiled(False)
    for k in [0] + sorted(k for k in set(ks) if k > 0):
        snap = _snapshot(dec)
        rec = _RecurrenceNodes()
        try:
            with rec.patch(), _no_async_eval():
                p = core.launch([k], StepCosts())  # head drafts only: no costs read
                outputs = [p.tokens, p.logprobs] + cache_state_arrays(dec.cache)
                if k == 0:
                    total = count_nodes(outputs)
                    out["plain"] = {**_part(rec, 0, 0, total, 0),
                                    "state_bytes": _state_bytes(dec.cache)}
                    continue
                outputs += [p.n_accepted, p.drafts, p.h_mtp]
                draft = count_nodes([p.drafts])  # the MTP head has no recurrence
                total = count_nodes(outputs)
                verify_bytes = _state_bytes(dec.cache)
                verify = _part(rec, 0, 0, total, draft)
                calls0, nodes0 = rec.calls, rec.nodes
                for c in dec.cache:
                    c.accept([1])
                replayed = cache_state_arrays(c for c in dec.cache if not c.is_trimmable())
                with_replay = count_nodes(outputs + replayed)
                row = {"draft": {"nodes": draft, "recurrence_calls": 0, "recurrence_nodes": 0,
                                 "own_nodes": draft},
                       "verify": verify,
                       "replay": _part(rec, nodes0, calls0, with_replay, total),
                       "state_bytes_verify": verify_bytes,
                       "state_bytes_replay": _state_bytes(dec.cache) if rec.calls > calls0
                       else 0}
                out[k] = row
        finally:
            _restore(dec, snap)
    if compiled:
        dec.model.set_compiled(True)
    return out


_SYNC_METHODS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def count_host_syncs():
    """Count calls that wait for results on the host: ``array.tolist/item`` and
    conversions, ``mx.eval``, ``mx.synchronize``. Yields a one-element list."""
    count = [0]
    patched = []

    def wrap(owner, name):
        real = getattr(owner, name, None)
        if real is None:
            return

        def counted(*a, **k):
            count[0] += 1
            return real(*a, **k)

        setattr(owner, name, counted)
        patched.append((owner, name, real))

    for name in _SYNC_METHODS:
        wrap(mx.array, name)
    wrap(mx, "eval")
    wrap(mx, "synchronize")
    try:
        yield count
    finally:
        for owner, name, real in reversed(patched):
            setattr(owner, name, real)


def summarize_graphs(graphs: List[dict]) -> dict:
    """Median of each figure over prompts (graphs are the same size at any context)."""
    from .stats import median

    if not graphs:
        return {}
    out = {"plain": {key: median(g["plain"][key] for g in graphs) for key in graphs[0]["plain"]}}
    for k in (k for k in graphs[0] if k != "plain"):
        row = {}
        for part, v in graphs[0][k].items():
            if isinstance(v, dict):
                row[part] = {key: median(g[k][part][key] for g in graphs) for key in v}
            else:
                row[part] = median(g[k][part] for g in graphs)
        out[k] = row
    return out
