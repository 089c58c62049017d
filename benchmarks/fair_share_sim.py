"""The streams' gaps and the prompts' share beside long prompts, simulated with injected
costs (``mlx_mtp/testing/fair_share_sim.py``: the engine's loop, the real policy and fair
share, costs from the idle 8k + 30k trace of round 15): K beside prompts as before the cap,
the prompts' turn sized by a plain step (direction (a) of issue 43), and caps on a step
beside prompts (direction (b)). No model, seconds to minutes of CPU:

    python benchmarks/fair_share_sim.py --prompt-tokens 8000,30000
"""

from __future__ import annotations

import argparse

from mlx_mtp.testing.fair_share_sim import p99, run

VARIANTS = [("before (the rows' K)", dict(cap=None)),
            ("(a) prompts' turn: 1.5 plain steps", dict(cap=None, plain_allowance=True))] + [
    (f"(b) a step beside prompts <= {c} plain", dict(cap=c)) for c in (1.25, 1.5, 2.0, 2.5)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-tokens", default="8000,30000")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    prompts = [int(n) for n in args.prompt_tokens.split(",")]
    print("| variant | p99 gap / solo p99 | prompts' share | streams' tokens/s a row | "
          "prefill s | steps at K=0 |\n|---|---:|---:|---:|---:|---:|")
    for name, kw in VARIANTS:
        r = run(prompts, args.seed, **kw)
        wall = sum(r.during)
        print(f"| {name} | {p99(r.during) / p99(r.solo):.2f} | {r.fair.share():.2f} | "
              f"{r.tokens / 4 / wall:.1f} | {wall:,.0f} | "
              f"{sum(k == 0 for k in r.ks) / len(r.ks):.0%} |", flush=True)


if __name__ == "__main__":
    main()
