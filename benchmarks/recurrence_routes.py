"""The Gated DeltaNet recurrence over L positions by each route a prompt chunk can take:
one compiled graph per shape, mlx-lm's per-position op loop, the chunked (matmul-form)
kernel, and L split into compiled pieces of 8 or 16 positions. For each: the primitives
in the lazy graph (``mx.export_to_dot``; the dispatches a GPU would pay) and the best-of
CPU milliseconds, interleaved (only a direction on a shared machine).

    python benchmarks/recurrence_routes.py [--lengths 8 16 32 64] [--reps 7]
        [--heads 2 4 --dims 64 64]   # demo model's GDN shapes (Hk Hv, Dk Dv)

``--model [PATH]`` (default the demo model) instead times a whole trunk pass over L prompt
tokens after ``--context`` tokens, with the decode steps compiled as the server has them,
on the route each length takes now and on the per-position loop before (ms per token; the
fair share's estimate is a per-token cost learnt from 8-token chunks).
"""

import argparse
import collections
import os
import re
import tempfile
import time
from pathlib import Path

import mlx_mtp  # noqa: F401  (first: loads the OpenBLAS shim before MLX, as the CLI does)
import mlx.core as mx
from mlx_lm.models.gated_delta import compute_g, gated_delta_update

from mlx_mtp.models.blocks import hybrid
from mlx_mtp.models.blocks.hybrid import _compiled_recurrence
from mlx_mtp.models.io.loader import load
from mlx_mtp.models.kernels.gated_delta_chunked import gated_delta_chunked

DEMO = Path(__file__).resolve().parents[1] / "mlx_mtp" / "assets" / "demo-model"


def compiled_pieces(q, k, v, a, b, A_log, dt_bias, state, piece: int):
    """The recurrence as compiled pieces of ``piece`` positions, the state handed on."""
    outs = []
    for i in range(0, q.shape[1], piece):
        cut = slice(i, i + piece)
        out, state = _compiled_recurrence(q[:, cut], k[:, cut], v[:, cut], a[:, cut],
                                          b[:, cut], A_log, dt_bias, state)
        outs.append(out)
    return mx.concatenate(outs, axis=1), state


def routes():
    def loop(q, k, v, a, b, A, dt, s):
        return gated_delta_update(q, k, v, a, b, A, dt, s, use_kernel=False)

    def chunked(q, k, v, a, b, A, dt, s):
        return gated_delta_chunked(q, k, v, compute_g(A, a, dt), mx.sigmoid(b), s)

    def pieces(size):
        return lambda *args: compiled_pieces(*args, piece=size)

    return {"compiled whole": _compiled_recurrence, "op loop": loop, "chunked": chunked,
            "pieces of 8": pieces(8), "pieces of 16": pieces(16)}


def inputs(L, Hk, Hv, Dk, Dv, seed=0):
    ks = mx.random.split(mx.random.key(seed), 6)
    q = mx.random.normal((1, L, Hk, Dk), key=ks[0])
    k = mx.random.normal((1, L, Hk, Dk), key=ks[1])
    q = q / mx.linalg.norm(q, axis=-1, keepdims=True) * Dk**-0.5
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((1, L, Hv, Dv), key=ks[2])
    a = mx.random.normal((1, L, Hv), key=ks[3])
    b = mx.random.normal((1, L, Hv), key=ks[4])
    state = 0.1 * mx.random.normal((1, Hv, Dv, Dk), key=ks[5])
    A_log, dt_bias = mx.zeros(Hv), mx.ones(Hv)
    args = (q, k, v, a, b, A_log, dt_bias, state)
    mx.eval(args)
    return args


# Primitives that make a view (no kernel of their own on a GPU).
VIEWS = {"Broadcast", "ExpandDims", "Reshape", "Slice", "Squeeze", "StopGradient", "Transpose"}


def primitive_count(arrays) -> tuple:
    """(all primitives, those that compute) in the lazy graph of ``arrays``."""
    fd, path = tempfile.mkstemp(suffix=".dot")
    os.close(fd)
    mx.export_to_dot(path, *arrays)
    kinds = re.findall(r'label ="?([A-Za-z]+)', Path(path).read_text())
    os.unlink(path)
    return len(kinds), sum(kind not in VIEWS for kind in kinds)


def trunk_passes(path, lengths, context: int, reps: int):
    """Best-of ms per token of a trunk pass over L tokens after ``context`` tokens, on the
    route each L takes now and with every L under 64 on the per-position loop."""
    model = load(str(path))[0]
    model.set_compiled(True, 8)
    prefix = mx.array([[(7 * i) % 1000 + 5 for i in range(context)]])
    routes = {"now": hybrid.CPU_CHUNKED_MIN_TOKENS, "loop": hybrid.CHUNKED_MIN_TOKENS}
    best, counts = collections.defaultdict(lambda: float("inf")), {}
    for rep in range(reps + 1):  # the first round traces and warms up
        for L in lengths:
            for name, least in routes.items():
                hybrid.CPU_CHUNKED_MIN_TOKENS = least
                cache = model.make_cache()
                mx.eval(model.trunk(prefix, cache)[0])
                t0 = time.perf_counter()
                h = model.trunk(mx.array([[11] * L]), cache)[0]
                if not rep:
                    counts[L, name] = primitive_count([h])[1]
                mx.eval(h)
                if rep:
                    best[L, name] = min(best[L, name], time.perf_counter() - t0)
    hybrid.CPU_CHUNKED_MIN_TOKENS = routes["now"]
    print(f"{'L':>4} " + " ".join(f"{name + ' computing':>16} {name + ' ms/token':>15}"
                                  for name in routes))
    for L in lengths:
        print(f"{L:4d} " + " ".join(f"{counts[L, name]:16d} {best[L, name] * 1e3 / L:15.3f}"
                                    for name in routes))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--heads", type=int, nargs=2, default=[2, 4], metavar=("Hk", "Hv"))
    p.add_argument("--dims", type=int, nargs=2, default=[64, 64], metavar=("Dk", "Dv"))
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--model", nargs="?", const=DEMO, default=None)
    p.add_argument("--context", type=int, default=512)
    opts = p.parse_args()
    mx.set_default_device(mx.cpu)
    if opts.model is not None:
        return trunk_passes(opts.model, opts.lengths, opts.context, opts.reps)
    fns = routes()
    cases = {L: inputs(L, *opts.heads, *opts.dims) for L in opts.lengths}
    for L, args in cases.items():
        for fn in fns.values():
            mx.eval(fn(*args))  # warm-up: traces each compiled shape once
    best = collections.defaultdict(lambda: float("inf"))
    for _ in range(opts.reps):  # interleaved, so drifting load hits every route alike
        for L, args in cases.items():
            for name, fn in fns.items():
                t0 = time.perf_counter()
                mx.eval(fn(*args))
                best[L, name] = min(best[L, name], time.perf_counter() - t0)
    print(f"{'L':>4} {'route':16} {'primitives':>10} {'computing':>9} {'ms':>8} {'ms/token':>9}")
    for L, args in cases.items():
        for name, fn in fns.items():
            ms = best[L, name] * 1e3
            total, computing = primitive_count(fn(*args))
            print(f"{L:4d} {name:16} {total:10d} {computing:9d} {ms:8.3f} {ms / L:9.4f}")


if __name__ == "__main__":
    main()
