"""The block drafter's width and pause (issue 36, "No harm"), simulated with injected costs
(``mlx_mtp/testing/block_pace_sim.py``: the real chooser and step-cost table, this CPU's demo
model and real shape and a cheap-verify machine; useless, half-right and always-right
drafters): adaptive against plain decoding and the best fixed width, its drafting steps, and
``block+mtp`` against the head alone. No model, a few seconds of CPU:

    python benchmarks/block_pace_sim.py --tokens 128,512 --seeds 3
"""

from __future__ import annotations

import argparse

from mlx_mtp.testing.block_pace_sim import table


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="128,512")
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    for tokens in (int(n) for n in args.tokens.split(",")):
        print(f"\n{tokens} tokens, a fresh chooser per run")
        table(tokens, range(args.seeds))


if __name__ == "__main__":
    main()
