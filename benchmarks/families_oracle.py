"""Speed of MTP per attention-trunk family on an oracle checkpoint (issue 22's benchmark).

For each family, builds a checkpoint in its released Hugging Face layout whose trunk and MTP
head follow the cycle t -> t+1 (``testing/tiny_attention.py``: acceptance 100 % at every
depth), a few hundred MB at the default shape, and runs ``mlx-mtp bench`` on it (plain, K=1..3,
adaptive). Prints speedup and realised / ideal per K and writes the table to
``benchmarks/results/families_oracle.json``. Not a test: timings depend on the machine.

    python benchmarks/families_oracle.py [--families glm4_moe,mimo] [--hidden 1024 --layers 8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

from mlx_mtp.testing.tiny_attention import FAMILIES, make_tiny

RESULTS = Path(__file__).parent / "results" / "families_oracle.json"


def bench(path: Path, out: Path, args) -> dict:
    cmd = [sys.executable, "-m", "mlx_mtp.cli", "bench", "--model", str(path),
           "--num-draft-tokens", "0,1,2,3", "--max-tokens", str(args.max_tokens),
           "--repeats", str(args.repeats), "--ignore-eos", "--no-plots", "--quiet",
           "--draft-source", "mtp", "-o", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "inprocess.json").read_text())


def rows(report: dict) -> list:
    """Per setting: tok/s, speedup over plain, mean acceptance length, realised / ideal."""
    keys = ("setting", "gen_tps_median", "speedup", "mean_acceptance_length", "c_verify",
            "c_draft", "realised_over_ideal", "outputs_match_plain")
    return [{k: s.get(k) for k in keys} for s in report["settings"]]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            path = make_tiny(Path(tmp) / family, family, "oracle", vocab_size=4096,
                             hidden=args.hidden, num_layers=args.layers, dtype=mx.bfloat16)
            size = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e6
            report = bench(path, Path(tmp) / f"{family}-bench", args)
            results[family] = {"checkpoint_mb": round(size), "machine": report["machine"],
                               "settings": rows(report)}
            print(f"{family} ({size:.0f} MB):")
            for r in rows(report):
                print("  ", r)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"hidden": args.hidden, "layers": args.layers,
                                   "max_tokens": args.max_tokens, "results": results},
                                  indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
