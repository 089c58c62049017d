"""Cost of a step's first MTP call (the catch-up over the K+1 committed pairs) with the
head's MLP on every row vs on the last row only (``mtp_forward(last_only=True)``), on an
MoE family's oracle checkpoint (``families_oracle.build``). Interleaved A B B A in one
process, so machine load shifts both alike. Not a test: timings depend on the machine.

    python benchmarks/mtp_last_row.py [--family glm4_moe --hidden 1024 --rows 4]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import mlx_mtp  # noqa: F401  (before MLX: it routes CPU matmuls to OpenBLAS)
import mlx.core as mx
import numpy as np

from families_oracle import build
from mlx_mtp.models.io.loader import load_model


def time_call(model, cache, hidden, tokens, last_only: bool) -> float:
    start = time.perf_counter()
    out = model.mtp_forward(hidden, tokens, cache, last_only=last_only)
    logits = model.draft_logits(out[:, -1:])
    mx.eval(logits, [c.state for c in cache])
    took = time.perf_counter() - start
    for c in cache:
        c.trim(hidden.shape[1])  # back to the history, for the next call
    return took


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="glm4_moe")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--history", type=int, default=64)
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = build(Path(tmp) / a.family, a.family, SimpleNamespace(hidden=a.hidden, layers=2))
        model = load_model(path)[0]
    H, n = a.hidden, a.history + a.rows
    rng = np.random.default_rng(0)
    hidden = mx.array(rng.standard_normal((1, n, H)), mx.bfloat16)
    tokens = mx.array(rng.integers(0, 4096, (1, n)), mx.uint32)
    cache = model.make_mtp_cache()
    model.mtp_forward(hidden[:, : a.history], tokens[:, : a.history], cache)
    mx.eval([c.state for c in cache])
    h, t = hidden[:, a.history :], tokens[:, a.history :]
    times = {False: [], True: []}
    for _ in range(3):  # warm-up
        time_call(model, cache, h, t, False), time_call(model, cache, h, t, True)
    for i in range(a.repeats):
        for last_only in ((False, True, True, False) if i % 2 == 0 else (True, False, False, True)):
            times[last_only].append(time_call(model, cache, h, t, last_only))
    full, cut = (1e3 * np.median(times[k]) for k in (False, True))
    print(f"{a.family} hidden={H} rows={a.rows} history={a.history} "
          f"load={os.getloadavg()[0]:.1f}: all rows {full:.2f} ms, last row {cut:.2f} ms "
          f"(median of {2 * a.repeats} each, x{full / cut:.2f})")


if __name__ == "__main__":
    main()
