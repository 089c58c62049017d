"""Distributed MTP vs one process: tokens/s, bytes sent and host syncs per step, MTP on/off.

    python benchmarks/distributed.py                 # builds a tiny model, runs everything
    python benchmarks/distributed.py --model PATH --ranks 2 --tokens 128

The driver runs the single-process decode itself and each mode under
``mlx.launch -n RANKS --backend ring``; every run decodes the same prompt greedily with
a fixed K (K = 0 is MTP off). Rank 0 counts its host syncs (reads of a step, ``mx.eval``
and ``mx.synchronize`` calls while decoding); bytes and messages are summed over ranks
(payloads: hidden states sent down the pipeline, every rank's part of each all_sum;
the all_sums inside tensor-parallel layers are not counted).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

PROMPT = list(range(3, 40))


class SyncCounter:
    """Counts host syncs while decoding: step reads, mx.eval, mx.synchronize."""

    def __init__(self):
        from mlx_mtp.decode import step

        self.count = 0
        self._patched = [(step.DecodeBatch, "finish"), (mx, "eval"), (mx, "synchronize")]
        self._orig = [getattr(o, n) for o, n in self._patched]
        for (owner, name), orig in zip(self._patched, self._orig):
            setattr(owner, name, self._counting(orig))

    def _counting(self, fn):
        def wrapped(*a, **k):
            self.count += 1
            return fn(*a, **k)
        return wrapped


def decode(model, k: int, tokens: int, counter: SyncCounter) -> dict:
    from mlx_mtp.decode.speculative import MTPDecoder

    dec = MTPDecoder(model, k, adaptive=False)
    dec.prefill(PROMPT)
    dec.step()  # warm-up: the first step also writes the prompt's MTP pairs
    dec.finish_pending()
    sent0, msgs0 = getattr(model, "bytes_sent", 0), getattr(model, "messages", 0)
    syncs0, steps, n = counter.count, 0, 0
    tic = time.perf_counter()
    while n < tokens:
        n += len(dec.step().tokens)
        steps += 1
    dec.finish_pending()
    seconds = time.perf_counter() - tic
    return {"k": k, "tokens_per_s": n / seconds, "steps": steps,
            "tokens_per_step": n / steps,
            "bytes_sent_per_step": (getattr(model, "bytes_sent", 0) - sent0) / steps,
            "messages_per_step": (getattr(model, "messages", 0) - msgs0) / steps,
            "host_syncs_per_step": (counter.count - syncs0) / steps}


def run_rank(args):
    """Inside a launch (or alone): decode with each K, repeat, print rank 0's medians."""
    from mlx_mtp.models.loader import load_model

    group = mx.distributed.init() if args.mode != "single" else None
    if group is None:
        model, _ = load_model(Path(args.model))
    else:
        from mlx_mtp.models.distributed import load_distributed

        model, _ = load_distributed(args.model, args.mode, group)
    counter = SyncCounter()
    rows = []
    for k in args.ks:
        runs = [decode(model, k, args.tokens, counter) for _ in range(args.repeats)]
        row = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        if group is not None:  # what all ranks sent, not rank 0's share only
            for key in ("bytes_sent_per_step", "messages_per_step"):
                row[key] = mx.distributed.all_sum(mx.array(row[key]), group=group).item()
        rows.append(row)
    if group is None or group.rank() == 0:
        print(json.dumps({"mode": args.mode, "rows": rows}))


def drive(args):
    from mlx_mtp.testing.tiny import make_tiny

    tmp = None
    if args.model is None:
        tmp = tempfile.TemporaryDirectory()
        args.model = str(make_tiny(Path(tmp.name) / "bench", "qwen3_5", head="noisy",
                                   trunk_scale=0.1, hidden=256, num_layers=8,
                                   vocab_size=4096))
    common = ["--model", args.model, "--tokens", str(args.tokens), "--repeats",
              str(args.repeats), "--ks", *map(str, args.ks)]
    launch = Path(sys.executable).parent / "mlx.launch"
    results = []
    for mode in ["single", "pipeline", "tensor"]:
        cmd = [sys.executable, __file__, "--rank", "--mode", mode, *common]
        if mode != "single":
            cmd = [str(launch), "-n", str(args.ranks), "--backend", "ring", "--", *cmd]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if out.returncode:
            sys.exit(f"{mode} failed:\n{out.stderr[-2000:]}")
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{'mode':9} {'K':>2} {'tok/s':>8} {'tok/step':>8} {'bytes sent/step':>15} "
          f"{'messages/step':>13} {'host syncs/step':>15}  MTP speedup")
    for res in results:
        base = res["rows"][0]["tokens_per_s"] if res["rows"][0]["k"] == 0 else None
        for r in res["rows"]:
            speedup = f"{r['tokens_per_s'] / base:.2f}x" if base else ""
            print(f"{res['mode']:9} {r['k']:>2} {r['tokens_per_s']:8.1f} "
                  f"{r['tokens_per_step']:8.2f} {r['bytes_sent_per_step']:15.0f} "
                  f"{r['messages_per_step']:13.1f} {r['host_syncs_per_step']:15.2f}  {speedup}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint (default: a tiny one is built)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ks", type=int, nargs="+", default=[0, 3])
    p.add_argument("--mode", default="single", choices=["single", "pipeline", "tensor"])
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    run_rank(args) if args.rank else drive(args)


if __name__ == "__main__":
    main()
