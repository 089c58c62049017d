"""Speed of MTP per family on an oracle checkpoint (issues 22 and 27's benchmark).

For each family, builds a checkpoint in its released Hugging Face layout whose trunk and MTP
head follow the cycle t -> t+1 (``testing/tiny_attention.py``, ``testing/tiny_special.py``:
acceptance 100 % at every depth), a few hundred MB at the default shape, and runs ``mlx-mtp
bench`` on it (plain, K=1..3, adaptive). Prints speedup and realised / ideal per K and writes
the table to ``benchmarks/results/families_oracle.json`` (``--out`` to change). Not a test:
timings depend on the machine.

realised / ideal is ``mlx-mtp bench``'s: ideal = E[tokens/step] / (c_verify(K) + K * c_draft),
with c_verify(K) one trunk pass over K+1 tokens and c_draft one one-token MTP call, both
measured in isolation relative to a plain step; realised = the measured speedup. The
remainder is everything else a step runs (the head's catch-up over the accepted pairs,
sampling, rollback, Python, the host sync).

Issue 27's families use a sliding window of 32 (``step3p5``, ``mimo_v2_flash``: it wraps
within a run) and ``index_topk`` 32 (``deepseek_v32``, ``glm_moe_dsa``: sparse attention is
active past 32 tokens). ``nemotron_h`` repeats its pattern ``M*M-ME`` ``--layers // 2`` times
(6 blocks each) and ``longcat_flash`` has ``--layers // 2`` layers of two sublayers, so every
fixture is a few hundred MB at the default shape.

Issue 37's families (``testing/tiny_next.py``, ``tiny_streams.py``, ``tiny_bailing.py``): the
same window and budgets where they have them: ``qwen4_exp``'s indexed attention keeps 32 keys
(16 blocks of 2), ``glm5_next``'s indexer 32 keys (8 pools of 4), ``deepseek_v4``'s
compressed-sparse layers 8 entries of 4 tokens beside a window of 32; ``bailing_hybrid`` (KDA
and MLA) has neither. ``minimax_m3_vl`` is not here: its MTP head is refused (no published
layout), so there is no head to make an oracle of.

    python benchmarks/families_oracle.py [--families glm4_moe,mimo] [--hidden 1024 --layers 8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx_mtp  # noqa: F401  (before MLX: it routes CPU matmuls to OpenBLAS)
import mlx.core as mx

from mlx_mtp.testing import tiny_next
from mlx_mtp.testing import tiny_special as special
from mlx_mtp.testing import tiny_streams as streams
from mlx_mtp.testing.tiny_bailing import make_tiny_bailing_hybrid
from mlx_mtp.testing.tiny_attention import FAMILIES as ATTENTION_FAMILIES
from mlx_mtp.testing.tiny_attention import make_tiny

RESULTS = Path(__file__).parent / "results" / "families_oracle.json"
WINDOW, INDEX_TOPK = 32, 32
SPECIAL = {  # issue 27's families: builder, config keywords
    "step3p5": (special.make_tiny_step3p5, lambda a: dict(num_layers=a.layers, window=WINDOW)),
    "mimo_v2_flash": (special.make_tiny_mimo_v2_flash,
                      lambda a: dict(num_layers=a.layers, window=WINDOW)),
    # Layers come in fixed groups: Nemotron-H's pattern M*M-ME, LongCat's two sublayers.
    # Nemotron-H's 24 blocks at the default trunk scale (0.1) add enough to the residual that
    # plain greedy leaves the cycle every few tokens (first-draft acceptance 83 %): not an
    # oracle. At 0.05 it follows the cycle; the trunk's compute is the same.
    "nemotron_h": (special.make_tiny_nemotron_h,
                   lambda a: dict(repeats=max(1, a.layers // 2), trunk_scale=0.05)),
    "longcat_flash": (special.make_tiny_longcat_flash,
                      lambda a: dict(num_layers=max(2, a.layers // 2))),
    "deepseek_v32": (lambda path, head, **kw: special.make_tiny_dsa(path, "deepseek_v32", head,
                                                                     **kw),
                     lambda a: dict(num_layers=a.layers, index_topk=INDEX_TOPK)),
    "glm_moe_dsa": (lambda path, head, **kw: special.make_tiny_dsa(path, "glm_moe_dsa", head,
                                                                    **kw),
                    lambda a: dict(num_layers=a.layers, index_topk=INDEX_TOPK)),
    # Issue 37's families whose trunk mlx-lm has (Step-3.7: three MTP layers).
    "step3p7": (tiny_next.make_tiny_step3p7, lambda a: dict(num_layers=a.layers, window=WINDOW)),
    "mellum": (tiny_next.make_tiny_mellum, lambda a: dict(num_layers=a.layers, window=WINDOW)),
    # Issue 37's families whose trunk mlx-lm lacks (streams), and Ling-3.0.
    "qwen4_exp": (streams.make_tiny_qwen4_exp,
                  lambda a: dict(num_layers=a.layers, index_budget=INDEX_TOPK)),
    "glm5_next": (streams.make_tiny_glm5_next,
                  lambda a: dict(num_layers=a.layers, index_topk=INDEX_TOPK)),
    "deepseek_v4": (streams.make_tiny_deepseek_v4,  # entries of 4 tokens: INDEX_TOPK tokens
                    lambda a: dict(num_layers=a.layers, window=WINDOW, index_topk=INDEX_TOPK // 4)),
    "bailing_hybrid": (make_tiny_bailing_hybrid, lambda a: dict(num_layers=a.layers)),
}
FAMILIES = ATTENTION_FAMILIES + tuple(SPECIAL)


def build(path: Path, family: str, args) -> Path:
    """The family's oracle checkpoint (bf16, as released checkpoints are stored)."""
    if family in SPECIAL:
        make, kwargs = SPECIAL[family]
        return make(path, "oracle", vocab_size=4096, hidden=args.hidden, dtype=mx.bfloat16,
                    **kwargs(args))
    return make_tiny(path, family, "oracle", vocab_size=4096, hidden=args.hidden,
                     num_layers=args.layers, dtype=mx.bfloat16)


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
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    results = {}
    args.out.parent.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            path = build(Path(tmp) / family, family, args)
            size = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e6
            report = bench(path, Path(tmp) / f"{family}-bench", args)
            results[family] = {"checkpoint_mb": round(size), "machine": report["machine"],
                               "settings": rows(report)}
            print(f"{family} ({size:.0f} MB):", flush=True)
            fixed = [r for r in rows(report) if r["setting"].startswith("K=")]
            if any(r["mean_acceptance_length"] != int(r["setting"][2:]) + 1 for r in fixed):
                print("   not an oracle: some drafts were rejected (see mean_acceptance_length)",
                      flush=True)
            for r in rows(report):
                print("  ", r, flush=True)
            # Written after every family: a long run keeps what it measured.
            args.out.write_text(json.dumps({"hidden": args.hidden, "layers": args.layers,
                                            "max_tokens": args.max_tokens,
                                            "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
