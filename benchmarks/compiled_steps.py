"""Compiled Gated DeltaNet decode steps (``TextModel.set_compiled``) against the lazy
graph, interleaved A B B A in one process: decode tok/s at fixed K = 0..3 and with
adaptive K (``auto``, K <= 3, the policy ``mlx-mtp generate`` uses: stored or
calibrated step costs for each mode, recalibrated at the start and saved after each
run), greedy, outputs checked equal, no trace while decoding.

    python benchmarks/compiled_steps.py [--model demo|PATH] [--hidden 1024] [--layers 8]
        [--vocab 8192] [--dtype bf16] [--head oracle|noisy] [--tokens 64] [--rounds 4]

Without ``--model`` a qwen3_5 fixture of the given shape is built; ``--model demo`` is
the shipped demo model.
"""

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import mlx_mtp  # noqa: F401  (first: loads the OpenBLAS shim before MLX, as the CLI does)
import mlx.core as mx

from mlx_mtp.decode import step_costs
from mlx_mtp.decode.policy import DraftPolicy
from mlx_mtp.decode.speculative import MTPDecoder
from mlx_mtp.models.blocks import hybrid
from mlx_mtp.models.io.loader import load
from mlx_mtp.testing.tiny import make_tiny

PROMPT = "def fibonacci(n):\n    "
DEMO = Path(__file__).resolve().parents[1] / "mlx_mtp" / "assets" / "demo-model"
SETTINGS = [0, 1, 2, 3, "auto", "auto, same costs"]
SHARED = []  # the lazy mode's stored costs after the warm-up: (B, k, head, seconds)


def decode(model, ids, k, n):
    if k == "auto":  # a fresh process's policy: the costs stored for this mode
        dec = MTPDecoder(model, 3, adaptive=True, policy=step_costs.policy_for(model, 3))
    elif k == "auto, same costs":  # both modes choose K from the same inputs
        policy = DraftPolicy(adaptive=True)
        for B, kk, head, sec in SHARED:
            policy.costs.observe(B, kk, head, sec)
        dec = MTPDecoder(model, 3, adaptive=True, policy=policy)
    else:
        dec = MTPDecoder(model, k, adaptive=False)
    dec.prefill(ids)
    out = list(dec.step().tokens)  # the first token belongs to prompt processing
    drafted0, steps = dec.stats.num_draft_tokens, 0
    tic = time.perf_counter()
    while len(out) < n + 1:
        out += dec.step().tokens
        steps += 1
    dec.finish_pending()
    tps = (len(out) - 1) / (time.perf_counter() - tic)
    if k == "auto":  # as `mlx-mtp generate` does: the next run starts from these costs
        step_costs.save(model, dec.policy.costs)
    return tps, out[: n + 1], (dec.stats.num_draft_tokens - drafted0) / steps


def count_traces():
    """Trace lengths of compiled layer steps (the Python step runs only while tracing)."""
    traced = []
    real = hybrid.DecoderLayer._linear_step

    def spy(self, x, *args):
        traced.append(x.shape[1])
        return real(self, x, *args)

    hybrid.DecoderLayer._linear_step = spy
    return traced


def build(a):
    if a.model:
        # The CLI's default dtype: float32 on the CPU for a small bf16 checkpoint.
        return load(str(DEMO if a.model == "demo" else a.model), dtype="auto"), a.model
    path = make_tiny(Path(tempfile.mkdtemp()) / "m", "qwen3_5", a.head, vocab_size=a.vocab,
                     hidden=a.hidden, num_layers=a.layers, trunk_scale=0.1,
                     dtype={"bf16": mx.bfloat16, "f32": mx.float32}[a.dtype])
    return load(str(path)), (f"qwen3_5 hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}, "
                             f"{a.dtype}, {a.head} head")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    ap.add_argument("--head", choices=["oracle", "noisy"], default="oracle")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    (model, tok), name = build(a)
    ids = tok.encode(PROMPT)
    tps = {(k, c): [] for k in SETTINGS for c in (False, True)}
    mean_k = {(k, c): [] for k in SETTINGS for c in (False, True)}
    outputs = {}
    traced = count_traces()
    for c in (False, True):  # warm up both; the policy's costs are stored per mode
        model.set_compiled(c, 3)
        # Both modes' costs calibrated now, at the same load (a file left by an earlier
        # run at another load steers auto's K by itself; see docs/verify-cost.md).
        step_costs.cost_file(model).unlink(missing_ok=True)
        for k in SETTINGS:
            decode(model, ids, k, a.tokens)
        if not c:
            probe = DraftPolicy(adaptive=True)
            step_costs.load(model, probe.costs)
            SHARED.extend((*cell, t) for cell, secs in probe.costs.cells.items() for t in secs)
    load_before = os.getloadavg()[0]
    for r in range(a.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)  # A B, then B A
        for k in SETTINGS:
            for c in order:
                model.set_compiled(c, 3)  # traced here (kept if on already), not below
                traced.clear()
                v, out, drafted = decode(model, ids, k, a.tokens)
                assert not traced, f"K={k}: traced {traced} while decoding"
                tps[(k, c)].append(v)
                mean_k[(k, c)].append(drafted)
                outputs.setdefault("greedy", out)
                assert out == outputs["greedy"], f"K={k} compiled={c}: output differs"
    print(f"{name}, {a.tokens} tokens, {a.rounds} rounds (ABBA); load average "
          f"{load_before:.1f} -> {os.getloadavg()[0]:.1f}")
    print("| K | lazy tok/s | compiled tok/s | compiled / lazy | mean K lazy / compiled |\n"
          "|---|---:|---:|---:|---|")
    for k in SETTINGS:
        lazy, comp = (statistics.median(tps[(k, c)]) for c in (False, True))
        ks = " / ".join(f"{statistics.mean(mean_k[(k, c)]):.2f}" for c in (False, True))
        print(f"| {k} | {lazy:.1f} | {comp:.1f} | {comp / lazy:.2f}× | {ks} |")
    print("no traces while decoding")
    print("outputs identical: yes")


if __name__ == "__main__":
    main()
