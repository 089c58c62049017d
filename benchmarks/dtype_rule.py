"""Where upcasting bf16 weights to float32 stops paying on MLX's CPU backend.

    python benchmarks/dtype_rule.py [--reps 6] [-o docs/dtype-rule.json]

Qwen3.5-shaped models (hidden 1024, published head layout; random weights, in memory) of
growing size: for each, the median seconds of a plain decode step (1 token) and of a
verify pass (4 tokens, K = 3) in bf16 and in float32, interleaved (A B B A), on the same
cache state. ``loader.AUTO_FLOAT32_MAX_BYTES`` (the static rule of ``--dtype auto``, used
when no figures of this machine are stored) comes from where float32 stops beating bf16 on
the plain step (recorded in docs/real-shape.md); ``models/io/dtype_timing.py`` measures the
same comparison on one product per machine and model width.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

import mlx_mtp  # noqa: F401  (BLAS shim before MLX)
import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_mtp.models.cache.kv import cache_state_arrays, restore_caches, snapshot_caches

from real_shape import random_model, real_text_config

# (layers, vocabulary): float32 sizes from ~0.25 GB to ~2.6 GB
SHAPES = [(2, 32768), (6, 32768), (12, 32768), (6, 151936), (12, 248320)]


def castable_bytes(model, dtype_size=4) -> int:
    return sum(v.size * dtype_size for k, v in tree_flatten(model.parameters())
               if mx.issubdtype(v.dtype, mx.floating) and not k.endswith("A_log"))


def cast(model, dtype):
    """As the loader casts: every float weight but the DeltaNet A_log (kept float32)."""
    model.load_weights([(k, v.astype(dtype)) for k, v in tree_flatten(model.parameters())
                        if mx.issubdtype(v.dtype, mx.floating) and not k.endswith("A_log")],
                       strict=False)
    mx.eval(model.parameters())


def step_times(model, reps):
    """Median seconds of a 1-token and a 4-token trunk pass + logits, same context each time."""
    cache = model.make_cache()
    h, _ = model.trunk(mx.array([list(range(1, 33))]), cache)
    mx.eval(h, [c.state for c in cache])
    saved = snapshot_caches(cache)

    def run(T):
        h, _ = model.trunk(mx.ones((1, T), mx.int32), cache, capture=T > 1)
        mx.eval(mx.argmax(model.logits(h), axis=-1), *cache_state_arrays(cache))
        restore_caches(saved)

    out = {1: [], 4: []}
    run(1), run(4)  # warm
    for _ in range(reps):
        for T in (1, 4):
            t = time.perf_counter()
            run(T)
            out[T].append(time.perf_counter() - t)
    return {T: statistics.median(v) for T, v in out.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("-o", "--output")
    a = ap.parse_args()
    rows = []
    for layers, vocab in SHAPES:
        model = random_model(real_text_config(layers=layers, vocab=vocab))
        f32_bytes = castable_bytes(model)
        times = {"bf16": [], "f32": []}
        for order in (("bf16", "f32"), ("f32", "bf16")):  # A B B A
            for name in order:
                cast(model, mx.bfloat16 if name == "bf16" else mx.float32)
                times[name].append(step_times(model, a.reps))
        med = {n: {T: statistics.median(t[T] for t in ts) for T in (1, 4)}
               for n, ts in times.items()}
        row = {"layers": layers, "vocab": vocab, "float32_gb": f32_bytes / 1e9,
               "plain_ms": {n: 1e3 * m[1] for n, m in med.items()},
               "verify4_ms": {n: 1e3 * m[4] for n, m in med.items()},
               "f32_speedup_plain": med["bf16"][1] / med["f32"][1],
               "f32_speedup_verify4": med["bf16"][4] / med["f32"][4],
               "load": os.getloadavg()[0]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del model
        gc.collect()
        mx.clear_cache()
    if a.output:
        Path(a.output).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
