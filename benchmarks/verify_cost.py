"""Why a verify pass over K+1 positions costs what it does on the demo model (or any
checkpoint): c_verify(K) = verify seconds / plain-step seconds as ``mlx-mtp bench``
measures them (``bench.inprocess.measure_costs``), with the Gated DeltaNet decode steps
lazy and compiled, interleaved A B B A in one process, plus the graph's primitive count
per pass by kind (``mx.export_to_dot``).

    python benchmarks/verify_cost.py [MODEL] [--rounds 4] [--reps 7]
"""

import argparse
import collections
import os
import re
import statistics
import tempfile
from pathlib import Path

import mlx.core as mx

from mlx_mtp.bench.inprocess import measure_costs
from mlx_mtp.models.cache import restore_caches, snapshot_caches
from mlx_mtp.models.loader import load

DEMO = Path(__file__).resolve().parents[1] / "mlx_mtp" / "assets" / "demo-model"
PROMPT = "def fibonacci(n):\n    "


def primitives(model, T: int) -> collections.Counter:
    """Primitive kinds in the lazy graph of one trunk pass over T positions (+ logits)."""
    cache = model.make_cache()
    mx.eval(model.trunk(mx.array([[1, 2, 3, 4]]), cache)[0])
    h, _ = model.trunk(mx.array([[5] * T]), cache, capture=T > 1)
    path = tempfile.mktemp(suffix=".dot")
    mx.export_to_dot(path, model.logits(h))
    kinds = collections.Counter(re.findall(r'label ="?([A-Za-z]+)', Path(path).read_text()))
    os.unlink(path)
    return kinds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=str(DEMO))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    model, tok = load(a.model, dtype="auto")  # what the CLI runs
    ids = tok.encode(PROMPT)
    runs = {False: [], True: []}
    load_before = os.getloadavg()[0]
    for r in range(a.rounds + 1):
        for compiled in ((False, True) if r % 2 else (True, False)):
            model.set_compiled(compiled)
            costs = measure_costs(model, ids, [1, 2, 3], reps=a.reps)
            if r:  # round 0 warms up both (and traces the compiled graphs)
                runs[compiled].append(costs)
    print(f"{a.model}: {a.rounds} rounds A B B A x {a.reps} reps; load average "
          f"{load_before:.1f} -> {os.getloadavg()[0]:.1f}")
    print("| decode steps | plain ms | c_verify(1) | c_verify(2) | c_verify(3) |")
    print("|---|---:|---:|---:|---:|")
    for compiled, rs in runs.items():
        plain = statistics.median(c["plain_s"] for c in rs) * 1e3
        cv = [statistics.median(c["verify_s"][k] / c["plain_s"] for c in rs) for k in (1, 2, 3)]
        print(f"| {'compiled' if compiled else 'lazy'} | {plain:.2f} | "
              + " | ".join(f"{v:.2f}" for v in cv) + " |")
    model.set_compiled(False)
    print("\nprimitives per trunk pass (lazy graph), by kind:")
    counts = {T: primitives(model, T) for T in (1, 2, 3, 4)}
    kinds = sorted(set().union(*counts.values()), key=lambda k: -counts[4][k])
    print("| kind | " + " | ".join(f"T={T}" for T in counts) + " |")
    print("|---|" + "---:|" * len(counts))
    print(f"| total | " + " | ".join(str(sum(c.values())) for c in counts.values()) + " |")
    for k in kinds[:14]:
        print(f"| {k} | " + " | ".join(str(c[k]) for c in counts.values()) + " |")


if __name__ == "__main__":
    main()
