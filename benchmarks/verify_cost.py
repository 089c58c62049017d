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

import mlx_mtp  # noqa: F401  (first: loads the OpenBLAS shim before MLX, as the CLI does)
import mlx.core as mx

from mlx_mtp.bench.inprocess import measure_costs
from mlx_mtp.models.blocks import hybrid
from mlx_mtp.models.io.loader import load

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


def parts(model, T: int):
    """Thunks for the parts of a trunk pass over T positions, each run alone: every
    linear layer's matmul (M = T rows), every Gated DeltaNet recurrence, the output layer."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    text = model.text
    linears = [m for _, m in tree_flatten(text.model.leaf_modules(), is_leaf=nn.Module.is_module)
               if isinstance(m, nn.Linear)]
    xs = [mx.random.normal((1, T, m.weight.shape[1])).astype(m.weight.dtype) for m in linears]
    mixers = [layer.linear_attn for layer in text.model.layers if layer.is_linear]
    cache = model.make_cache()
    mx.eval(model.trunk(mx.array([[1, 2, 3, 4]]), cache)[0])
    rec = []
    for mix, c in zip(mixers, (c for c in cache if type(c).__name__ == "RecurrentCache")):
        conv_state, state = c.state
        _, inputs, _ = mix.inputs(mx.random.normal((1, T, text.args.hidden_size)), conv_state)
        mx.eval(inputs)
        rec.append((mix, inputs, state))
    h = mx.random.normal((1, T, text.args.hidden_size))
    mx.eval(xs, h)
    return {
        "linear layers": lambda: [m(x) for m, x in zip(linears, xs)],
        "recurrence, op loop": lambda: recur(rec, False),
        "recurrence, compiled": lambda: recur(rec, True),
        "output layer": lambda: model.logits(h),
    }


def recur(rec, compiled: bool):
    hybrid.COMPILE_RECURRENCE = compiled
    return [mix.recurrence(*inp, st) for mix, inp, st in rec]


def breakdown(model, reps: int):
    """Median ms of each part at T = 1..4, interleaved."""
    import time

    thunks = {T: parts(model, T) for T in (1, 2, 3, 4)}
    times = collections.defaultdict(list)
    for r in range(reps + 1):
        for T, ps in thunks.items():
            for name, fn in ps.items():
                tic = time.perf_counter()
                mx.eval(fn())
                if r:
                    times[(name, T)].append((time.perf_counter() - tic) * 1e3)
    print("\n| part (ms) | T=1 | T=2 | T=3 | T=4 |\n|---|---:|---:|---:|---:|")
    for name in thunks[1]:
        print(f"| {name} | " + " | ".join(f"{statistics.median(times[(name, T)]):.2f}"
                                          for T in thunks) + " |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=str(DEMO))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    model, tok = load(a.model, dtype="auto")  # what the CLI runs
    ids = tok.encode(PROMPT)
    modes = {"op loop (before)": (False, False), "compiled recurrence (after)": (True, False),
             "--compile-steps": (True, True)}
    runs = {m: [] for m in modes}
    load_before = os.getloadavg()[0]
    for r in range(a.rounds + 1):
        for mode in (list(modes) if r % 2 else list(modes)[::-1]):  # A B C, then C B A
            hybrid.COMPILE_RECURRENCE, compiled = modes[mode]
            model.set_compiled(compiled, 3)
            costs = measure_costs(model, ids, [1, 2, 3], reps=a.reps)
            if r:  # round 0 warms every mode up
                runs[mode].append(costs)
    print(f"{a.model}: {a.rounds} rounds, order reversed every round x {a.reps} reps; "
          f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}")
    print("| decode steps | plain ms | c_verify(1) | c_verify(2) | c_verify(3) |")
    print("|---|---:|---:|---:|---:|")
    for mode, rs in runs.items():
        plain = statistics.median(c["plain_s"] for c in rs) * 1e3
        cv = [statistics.median(c["verify_s"][k] / c["plain_s"] for c in rs) for k in (1, 2, 3)]
        print(f"| {mode} | {plain:.2f} | " + " | ".join(f"{v:.2f}" for v in cv) + " |")
    model.set_compiled(False)
    breakdown(model, 3 * a.reps)
    hybrid.COMPILE_RECURRENCE = True
    after = [sum(primitives(model, T).values()) for T in (1, 2, 3, 4)]
    hybrid.COMPILE_RECURRENCE = False
    print("\nprimitives per trunk pass (lazy graph), by kind (op loop; last row: compiled "
          "recurrence):")
    counts = {T: primitives(model, T) for T in (1, 2, 3, 4)}
    kinds = sorted(set().union(*counts.values()), key=lambda k: -counts[4][k])
    print("| kind | " + " | ".join(f"T={T}" for T in counts) + " |")
    print("|---|" + "---:|" * len(counts))
    print(f"| total | " + " | ".join(str(sum(c.values())) for c in counts.values()) + " |")
    for k in kinds[:14]:
        print(f"| {k} | " + " | ".join(str(c[k]) for c in counts.values()) + " |")
    print("| total, compiled recurrence | " + " | ".join(map(str, after)) + " |")


if __name__ == "__main__":
    main()
