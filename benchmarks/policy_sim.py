"""The K policy on a fake clock (``mlx_mtp/testing/policy_sim.py``): a fresh policy against
every fixed K, for three heads over the stored step costs of three machines (the real 0.8B
shape on a 2-core Xeon and on an EPYC, the hidden-1024 tiny model). Throughput is tokens
per plain step of simulated time (1.00 = plain decoding); no model, under a second:

    python benchmarks/policy_sim.py --tokens 64,128
"""

from __future__ import annotations

import argparse
from collections import Counter

from mlx_mtp.testing.policy_sim import HEADS, MACHINES, bernoulli, compare


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="64,128", help="comma-separated lengths")
    ap.add_argument("--seed", type=int, default=0, help="the ~65 %% head's stream")
    args = ap.parse_args()
    try:
        lengths = [int(n) for n in args.tokens.split(",")]
        if min(lengths) < 1:
            raise ValueError
    except ValueError:
        ap.exit(2, f"--tokens: positive integers separated by commas (got {args.tokens!r})\n")
    HEADS["~65 %"] = lambda: bernoulli(0.65, args.seed)
    print("| machine | head | tokens | auto | K=0 | K=1 | K=2 | K=3 | auto / best | steps by K |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for machine in MACHINES.values():
        for head in HEADS:
            for n in lengths:
                auto, fixed = compare(machine, head, n)
                best = max(r.throughput for r in fixed.values())
                steps = " ".join(f"{k}:{c}" for k, c in sorted(Counter(auto.ks).items()))
                print(f"| {machine.name} | {head} | {n} | {auto.throughput:.3f} | "
                      + " | ".join(f"{fixed[k].throughput:.3f}" for k in range(4))
                      + f" | {auto.throughput / best:.3f} | {steps} |")


if __name__ == "__main__":
    main()
