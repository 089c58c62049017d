"""Lookup settings by measurement: minimum match length x maximum draft length.

    python benchmarks/lookup_sweep.py [--model demo|oracle] [--source both|lookup]
        [--min-match 2,3,4] [--max-draft 8,16,32] [--tokens 128] [--repeats 2]
        [--repetition-penalty 1.0] [--out benchmarks/results/lookup_sweep_demo.json]

``demo``: the embedded demo model on ``--prompts builtin:copy`` (chat template, greedy).
``oracle``: the issue's Qwen3.5-shaped fixture that copies by construction (noisy head;
``lookup_oracle.py``) on its copy prompt. Every setting runs in one process, interleaved
(plain, then the grid; the order reversed on every other repeat: A B ... B A), each
keeping one policy and one set of draft sources across its runs, as a server does.
Figures are relative to plain decoding in the same repeat, so a loaded machine shifts
them less than absolute tok/s. Every setting's tokens are checked equal to plain's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import mlx_mtp  # noqa: F401  (BLAS shim before MLX)
import mlx.core as mx
from mlx_mtp.bench.inprocess import Setting, run_once
from mlx_mtp.bench.prompts import load_prompts
from mlx_mtp.decode.draft_source import DraftSources
from mlx_mtp.drafters.lookup import LookupSettings
from mlx_mtp.decode.policy import DraftPolicy
from mlx_mtp.decode.prompt import build_prompt, encode_prompt
from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.models.io.loader import load


def _ints(text):
    return [int(x) for x in text.split(",") if x.strip()]


def _model_and_prompts(a, tmp: Path):
    if a.model == "oracle":
        import lookup_oracle
        from mlx_mtp.testing.tiny import make_tiny

        path = make_tiny(tmp / "noisy", "qwen3_5", "noisy", vocab_size=16384, hidden=1024,
                         num_layers=8, trunk_scale=0.1, fc_noise=lookup_oracle.HEAD_NOISE["noisy"],
                         dtype=mx.bfloat16)
        model, _ = load(str(path), dtype="auto")  # as the CLI loads it
        return model, {"copy": lookup_oracle.prompts(16384, a.tokens)["copy"]}, frozenset()
    model, tok = load(a.model_path, dtype="auto")  # None: the embedded demo model
    prompts = {p.name: encode_prompt(tok, build_prompt(tok, p.text))
               for p in load_prompts("builtin:copy")}
    return model, prompts, frozenset(getattr(tok, "eos_token_ids", None) or [])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="demo", choices=("demo", "oracle"))
    p.add_argument("--model-path", default=None, help="another local model for 'demo'")
    p.add_argument("--source", default="both", choices=("both", "lookup"))
    p.add_argument("--min-match", default="2,3,4")
    p.add_argument("--max-draft", default="8,16,32")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    grid = [(m, d) for m in _ints(a.min_match) for d in _ints(a.max_draft)]
    k = 3 if a.source == "both" else 0
    sampling = SamplingParams(repetition_penalty=a.repetition_penalty)
    names = ["plain"] + [f"m{m}/d{d}" for m, d in grid]
    with tempfile.TemporaryDirectory() as tmp:
        model, prompts, eos = _model_and_prompts(a, Path(tmp))
        settings = {"plain": Setting("plain", 0)}
        sources, policies = {}, {}
        for (m, d), name in zip(grid, names[1:]):
            settings[name] = Setting(name, k, adaptive=True, draft_source=a.source)
            sources[name] = DraftSources(a.source, LookupSettings(min_match=m, max_draft=d))
            policies[name] = DraftPolicy() if k else None

        def go(name, ids, n, **kw):
            return run_once(model, ids, settings[name], sampling, n, eos, policy=policies.get(name),
                            sources=sources.get(name), **kw)

        short = min(prompts.values(), key=len)
        for name in names:  # warm-up: shapes, first costs
            go(name, short, 16)
        runs = []
        for rep in range(a.repeats):
            order = names if rep % 2 == 0 else names[::-1]
            for label, ids in prompts.items():
                for name in order:
                    r = go(name, ids, a.tokens, label=label, repeat=rep)
                    runs.append((name, label, rep, r))
                    print(f"r{rep} {label:12s} {name:8s} {r.gen_tps:7.1f} tok/s", flush=True)
    plain = {(lb, rep): r for name, lb, rep, r in runs if name == "plain"}
    rows = {}
    for name in names:
        mine = [(lb, rep, r) for n, lb, rep, r in runs if n == name]
        speedups = [r.gen_tps / plain[(lb, rep)].gen_tps for lb, rep, r in mine]
        drafted = sum(r.spec.lookup_draft_tokens for _, _, r in mine)
        accepted = sum(r.spec.lookup_accepted_tokens for _, _, r in mine)
        rows[name] = {"speedup_median": statistics.median(speedups),
                      "speedup_geomean": statistics.geometric_mean(speedups),
                      "tokens_per_step": sum(len(r.tokens) for _, _, r in mine)
                      / max(1, sum(r.steps + 1 for _, _, r in mine)),
                      "context_drafted": drafted, "context_accepted": accepted,
                      "same_as_plain": all(r.tokens == plain[(lb, rep)].tokens
                                           for lb, rep, r in mine)}
    print(f"\n{a.model}, source {a.source}, repetition penalty {a.repetition_penalty}, "
          f"{len(prompts)} prompts x {a.repeats} repeats, {a.tokens} tokens, greedy")
    print("setting   x plain (median)  (geomean)  tokens/step  context acc/drafted  same")
    for name, row in rows.items():
        print(f"{name:9s} {row['speedup_median']:8.2f}  {row['speedup_geomean']:10.2f}  "
              f"{row['tokens_per_step']:11.2f}  {row['context_accepted']:>8d}/"
              f"{row['context_drafted']:<8d}  {row['same_as_plain']}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"args": vars(a), "results": rows}, indent=1))
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
