"""Eight long requests under a memory budget that holds three (issue 38's budget target).

    python benchmarks/memory_budget_long.py [--tokens 16384] [--requests 8] [--fit 3]
        [--kv-bits 4|8] [--kv-group-size 64]

The engine in-process (the server's scheduler, no HTTP) on the demo model (or ``--model``):
``--requests`` prompts of ``--tokens`` tokens cut from the package's own sources, each asking
for ``--max-tokens``, under ``MemoryBudget(fit x one request's footprint)``, the footprint
measured with the caches ``--kv-bits`` quantizes (as ``serve --kv-bits`` does). Checked at every
step: the budget's account (reservations plus the prefix cache) stays within 1.05x the limit,
and the bytes the caches hold, counted from the caches themselves, stay within the account.
Reported: whether every request finished (none lost), the most rows running at once, the
peak held and accounted bytes against the limit, and the wall time. Not timing: run it on
any machine load, with ``--max-wait`` past the run's length (a queued request waits while
three 16k requests run, on a loaded machine longer than serve's default 300 s).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from mlx_mtp.bench.long_context import long_prompts
from mlx_mtp.models.cache.quantized import KVQuantization
from mlx_mtp.models.io.loader import load
from mlx_mtp.server.engine import Engine
from mlx_mtp.server.events import Done, EngineRequest, Failed
from mlx_mtp.server.memory_budget import MAX_WAIT_SECONDS, Footprint, MemoryBudget


class Sink:
    def __init__(self):
        self.done, self.tokens = None, 0

    def __call__(self, ev):
        if isinstance(ev, (Done, Failed)):
            self.done = ev
        self.tokens += len(getattr(ev, "token_ids", ()) or ())


def held(engine) -> int:
    """Cache bytes the engine holds now, counted from the caches (not from the account)."""
    caches = list(engine.batch.cache or []) + list(engine.batch.mtp_cache or [])
    caches += [c for s in engine.running if s.prefilling
               for c in s.dec.cache + (s.dec.mtp_cache or [])]
    return sum(c.nbytes for c in caches) + engine.prefix_cache.nbytes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: the demo model)")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--fit", type=int, default=3, help="the budget holds this many requests")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-wait", type=float, default=MAX_WAIT_SECONDS,
                   help="seconds a request may wait for room (serve --memory-budget-wait)")
    p.add_argument("--kv-bits", type=int, choices=[4, 8], default=None,
                   help="quantized KV caches (serve --kv-bits); default: full precision")
    p.add_argument("--kv-group-size", type=int, choices=[32, 64, 128], default=64)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    model, tok = load(args.model)
    if args.kv_bits is not None:
        try:
            model.use_kv_quantization(KVQuantization(args.kv_bits, args.kv_group_size))
        except ValueError as e:
            p.error(str(e))
    base = long_prompts(tok, [args.tokens])[0]
    # distinct prompts of equal length: each a rotation of the same source text
    cuts = [i * 997 % len(base) for i in range(args.requests)]
    prompts = [base[c:] + base[:c] for c in cuts]
    fp = Footprint.measure(model)
    limit = args.fit * fp.row_bytes(args.tokens + args.max_tokens + 8 + 256)
    budget = MemoryBudget(limit, max_wait=args.max_wait, footprint=fp)
    engine = Engine(model, tok, max_concurrency=args.requests, memory=budget, log_interval=0)
    sinks = [Sink() for _ in prompts]
    for ids, sink in zip(prompts, sinks):
        engine.submit(EngineRequest(prompt=list(ids), max_tokens=args.max_tokens, on_event=sink))
    t0, rows, peak_held, peak_account, violations = time.perf_counter(), 0, 0, 0, 0
    reported = 0
    while not all(s.done is not None for s in sinks):
        engine.step()
        ended = sum(s.done is not None for s in sinks)
        if ended > reported:  # progress, for a run that takes long on a loaded machine
            reported = ended
            print(f"{ended}/{len(sinks)} ended after {time.perf_counter() - t0:.0f} s, "
                  f"{engine.num_running} running", file=sys.stderr, flush=True)
        account = budget.reserved + engine.prefix_cache.nbytes
        now = held(engine)
        rows, peak_held, peak_account = (max(rows, engine.num_running), max(peak_held, now),
                                         max(peak_account, account))
        violations += (now > account) + (account > 1.05 * limit)
    result = {
        "tokens": args.tokens, "requests": args.requests, "max_tokens": args.max_tokens,
        "kv_bits": args.kv_bits, "kv_group_size": args.kv_group_size if args.kv_bits else None,
        "fit": args.fit, "limit_bytes": limit, "footprint": repr(fp),
        "max_wait_seconds": args.max_wait, "load_average": os.getloadavg(),
        "finished": sum(isinstance(s.done, Done) for s in sinks),
        "failed": [str(s.done) for s in sinks if not isinstance(s.done, Done)],
        "max_rows_running": rows, "peak_held_bytes": peak_held,
        "peak_accounted_bytes": peak_account, "peak_accounted_over_limit": peak_account / limit,
        "steps_violating_the_account": violations,
        "wall_seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["finished"] == args.requests and not violations else 1


if __name__ == "__main__":
    raise SystemExit(main())
