"""Measurements of the demo model (MODEL_CARD.md): repetition of greedy samples, and
``generate`` with MTP (defaults) against ``--no-mtp`` on held-out code.

    python benchmarks/demo_model.py repetition [--model DIR] [--heldout DIR|stdlib] [-o OUT.json]
    python benchmarks/demo_model.py speed      [--model DIR] [--heldout DIR|stdlib] [-o OUT.json]

Prompts: ``mlx_mtp.train.export.heldout_prompts`` (128 tokens cut at a random point of a
different held-out file each, seed 0), 20 of them; the default held-out set is the standard
library's held-out split (the files no demo model was trained on), or pass the corpus
builder's held-out directory (``python -m mlx_mtp.train.corpus``).

Both decode greedily with the model's penalty defaults (generation_config.json: the demo
model's repetition_penalty 1.3) unless ``--repetition-penalty`` etc. override them, and
``--chat-template`` makes each prompt a user turn, as ``generate`` builds it by default.

repetition: 256 greedy tokens per prompt (plain decoding; MTP output is identical), then
  distinct-4 = distinct token 4-grams / 4-grams per sample; "one line repeated" = the complete
  non-empty lines of the sample's second half are all the same line (at least 4 of them);
  "looping tail" = the last 128 tokens repeat with some period p <= 64 at >= 90% of positions.
speed: per prompt, in one process, what ``mlx-mtp generate --ignore-chat-template`` does with
  its defaults (greedy, up to ``--num-draft-tokens`` drafts, adaptive unless ``--fixed-k``)
  and with ``--no-mtp`` (the model loaded
  without its head), in ABBA order (or AB / BA alternating between prompts with --abba 0);
  256 new tokens. Reported:
  decode tok/s as ``generate`` prints it (first token excluded), total wall time per arm,
  and whether every MTP output is token-identical to plain decoding.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

from mlx_mtp.decode.generation import stream_generate
from mlx_mtp.decode.prompt import build_prompt, encode_prompt
from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.models.io.loader import generation_defaults, load
from mlx_mtp.options import PENALTIES, apply_model_options, sampling_from_args
from mlx_mtp.train.data import corpus_file_list
from mlx_mtp.train.export import heldout_prompts

EOS = {4087, 4089}


def prompts_for(args, tok):
    """Held-out token prompts; with ``--chat-template`` each one's text is the user turn of
    the chat template, as ``mlx-mtp generate --prompt TEXT`` builds it by default."""
    files = None if args.heldout == "stdlib" else corpus_file_list(args.heldout, "heldout")
    prompts = heldout_prompts(args.n_prompts, args.prompt_tokens, files=files, seed=args.seed)
    if args.chat_template:
        prompts = [encode_prompt(tok, build_prompt(tok, tok.decode(p))) for p in prompts]
    return prompts


def generate_ids(model, tok, prompt, n, k, sampling=None, adaptive=True):
    ids, last = [], None
    t0 = time.perf_counter()
    for r in stream_generate(model, tok, prompt, max_tokens=n, sampling=sampling or SamplingParams(),
                             num_draft_tokens=k, adaptive=adaptive):
        ids.append(r.token)
        last = r
    return ids, last, time.perf_counter() - t0


def rep_stats(ids, text):
    grams = [tuple(ids[i:i + 4]) for i in range(len(ids) - 3)]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    full = lines if text.endswith("\n") else lines[:-1]  # the last line may be cut
    half = full[len(full) // 2:]
    period = None
    if len(ids) >= 192:
        tail = range(len(ids) - 128, len(ids))
        for p in range(1, 65):
            if sum(ids[i] == ids[i - p] for i in tail) >= 0.9 * len(tail):
                period = p
                break
    top = Counter(lines).most_common(1)
    return {"distinct4": len(set(grams)) / max(1, len(grams)),
            "one_line_repeated": len(half) >= 4 and len(set(half)) == 1,
            "loop_period": period,
            "top_line_fraction": top[0][1] / len(lines) if lines else 0.0,
            "tokens": len(ids)}


def repetition(args):
    model, tok = load(args.model, mtp=False)
    sampling = sampling_of(args)
    rows = []
    for p in prompts_for(args, tok):
        ids, _, _ = generate_ids(model, tok, p, args.max_tokens, 0, sampling)
        text = tok.decode(ids)
        rows.append(dict(rep_stats(ids, text), text=text))
    n = len(rows)
    agg = {"samples": n,
           "mean_distinct4": sum(r["distinct4"] for r in rows) / n,
           "min_distinct4": min(r["distinct4"] for r in rows),
           "one_line_repeated": sum(r["one_line_repeated"] for r in rows),
           "looping_tail": sum(r["loop_period"] is not None for r in rows),
           "stopped_early": sum(r["tokens"] < args.max_tokens for r in rows)}
    return agg, rows


def sampling_of(args):
    """Greedy with the model's generation_config.json defaults (penalties included) and
    the penalty flags over them, as ``generate`` builds its sampling."""
    s = sampling_from_args(args, generation_defaults(args.model))
    return SamplingParams(temperature=0.0, **{k: getattr(s, k) for k in PENALTIES})


def speed(args):
    dtype = None if args.dtype == "stored" else args.dtype
    mtp_model, tok = load(args.model, mtp=True, dtype=dtype)
    plain_model, _ = load(args.model, mtp=False, dtype=dtype)
    apply_model_options(mtp_model, args)
    apply_model_options(plain_model, args)
    sampling = sampling_of(args)
    k = args.num_draft_tokens
    arms = {"mtp": (mtp_model, k), "no_mtp": (plain_model, 0)}
    prompts = prompts_for(args, tok)
    generate_ids(mtp_model, tok, prompts[0], 32, k, sampling)  # warm-up (kernel compilation)
    generate_ids(plain_model, tok, prompts[0], 32, 0, sampling)
    rows = []
    for i, p in enumerate(prompts):
        order = ["mtp", "no_mtp"] if i % 2 == 0 else ["no_mtp", "mtp"]
        row = {}
        for arm in (order + order[::-1] if args.abba else order):  # ABBA or AB/BA
            model, k = arms[arm]
            ids, last, wall = generate_ids(model, tok, p, args.max_tokens, k, sampling,
                                           adaptive=not args.fixed_k)
            row.setdefault(arm, []).append({"ids": ids, "tps": last.generation_tps,
                                            "wall": wall,
                                            "accept": last.spec.acceptance_rate,
                                            "drafts": last.spec.num_drafts})
        rows.append(row)
    same = all(a["ids"] == b["ids"] for r in rows for a in r["mtp"] for b in r["no_mtp"])
    agg = {"prompts": len(rows), "identical_output": same}
    for arm in arms:
        runs = [x for r in rows for x in r[arm]]
        agg[arm] = {"mean_tps": sum(x["tps"] for x in runs) / len(runs),
                    "total_wall_s": sum(x["wall"] for x in runs),
                    "tokens": sum(len(x["ids"]) for x in runs)}
    agg["mtp"]["drafts"] = sum(x["drafts"] for r in rows for x in r["mtp"])
    agg["speedup_mean_tps"] = agg["mtp"]["mean_tps"] / agg["no_mtp"]["mean_tps"]
    agg["speedup_wall"] = agg["no_mtp"]["total_wall_s"] / agg["mtp"]["total_wall_s"]
    for r in rows:
        for arm in arms:
            for x in r[arm]:
                x.pop("ids")
    return agg, rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["repetition", "speed"])
    p.add_argument("--model", default=None, help="model directory (default: the demo model)")
    p.add_argument("--heldout", default="stdlib",
                   help="'stdlib' (default) or a directory of held-out files")
    p.add_argument("--n-prompts", type=int, default=20)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "stored"], default="auto",
                   help="(speed) weights at load, as generate's --dtype (default auto: float32 "
                        "on the CPU); stored: as in the file")
    p.add_argument("--abba", type=int, default=1,
                   help="(speed) 1: ABBA per prompt (4 runs); 0: AB/BA alternating (2 runs)")
    for name in PENALTIES:
        p.add_argument("--" + name.replace("_", "-"), type=float, default=None,
                       help="(default: the model's generation_config.json, else off)")
    p.add_argument("--num-draft-tokens", type=int, default=3, help="(speed) K, as generate's")
    p.add_argument("--fixed-k", action="store_true", help="(speed) always draft K, as generate's")
    p.add_argument("--chat-template", action="store_true",
                   help="each prompt as a user turn of the chat template (generate's default)")
    p.add_argument("--compile-steps", action="store_true", help="(speed) as generate's flag")
    p.add_argument("--draft-vocab", default="auto", help="(speed) as generate's flag")
    p.add_argument("-o", "--output", default=None, help="write the results (JSON) here")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    agg, rows = (repetition if args.what == "repetition" else speed)(args)
    agg["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(agg, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), "summary": agg,
                                                 "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
