"""Prompt processing speed: chunked gated delta rule vs the per-token recurrence.

    python benchmarks/prefill_chunked.py [--tokens 1024] [--hidden 256] [--layers 8]
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import mlx_mtp  # noqa: F401  (before MLX: it routes CPU matmuls to OpenBLAS)
import mlx.core as mx

import mlx_mtp.models.blocks.hybrid as hybrid
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.testing.tiny import make_tiny


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    path = make_tiny(Path(tempfile.mkdtemp()) / "m", "qwen3_5", "random", vocab_size=4096,
                     hidden=a.hidden, num_layers=a.layers)
    model, _ = load_model(path, mtp=False)
    tokens = mx.random.randint(0, 4096, (1, a.tokens))
    times = {"recurrent": [], "chunked": []}
    outs = {}
    for _ in range(a.repeats):  # interleaved
        for name, threshold in (("recurrent", 10**9), ("chunked", 64)):
            hybrid.CHUNKED_MIN_TOKENS = hybrid.CPU_CHUNKED_MIN_TOKENS = threshold
            cache = model.make_cache()
            t = time.perf_counter()
            h, _ = model.trunk(tokens, cache)
            mx.eval(h)
            times[name].append(time.perf_counter() - t)
            outs[name] = h
    err = mx.abs(outs["recurrent"] - outs["chunked"]).max().item()
    for name, ts in times.items():
        print(f"{name:10s} {a.tokens / statistics.median(ts):8.0f} prompt tok/s")
    print(f"max |difference| of trunk outputs: {err:.2e}")


if __name__ == "__main__":
    main()
