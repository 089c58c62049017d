"""Context drafts on a model that copies by construction (issue 26's targets).

    python benchmarks/lookup_oracle.py [--hidden 1024] [--layers 8] [--vocab 16384]
        [--tokens 256] [--repeats 3] [--dtype auto] [--out benchmarks/results/lookup_oracle.json]

Fixtures: Qwen3.5-shaped checkpoints saved in bf16 whose trunk predicts succ(t) on the
cycle t -> t+1 (``testing/tiny.py``, the "oracle" of pitfalls-measured.md) with two heads:
``noisy`` (noise on ``mtp.fc``: partial first-position acceptance, reported as measured)
and ``never`` (so much noise the head is never right).

Prompts (token ids, greedy): ``copy`` holds a stretch of the cycle longer than the answer
and then restarts it, so the whole answer is a copy of the context; ``fresh`` is random
ids, so the answer (the cycle from the last id on) repeats nothing.

Settings, interleaved per repeat (A B C D, then reversed): plain (``--no-mtp``), mtp
(adaptive K up to 3), lookup (context alone, adaptive), both (adaptive). Decode tok/s
after the first step; every setting's tokens are checked equal to plain's.
Targets: on copy, both >= 2.0x mtp and >= 3.0x plain with the noisy head; lookup >= 3.0x
plain with the never-right head; on fresh, both within 3 % of mtp.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import mlx_mtp  # noqa: F401  (BLAS shim before MLX)
import mlx.core as mx
from mlx_mtp.decode.draft_source import DraftSources
from mlx_mtp.decode.policy import DraftPolicy
from mlx_mtp.decode.speculative import MTPDecoder
from mlx_mtp.models.io.loader import load
from mlx_mtp.testing.tiny import make_tiny

SETTINGS = {"plain": (0, None), "mtp": (3, None), "lookup": (0, "lookup"), "both": (3, "both")}
HEAD_NOISE = {"noisy": 5.5, "never": 60.0}  # fc_noise of mtp.fc (5.5: ~60 % at hidden 1024)


def prompts(vocab: int, tokens: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    start = int(rng.integers(0, vocab // 2))
    stretch = [(start + i) % vocab for i in range(tokens + 64)]
    copy = stretch + [int(t) for t in rng.integers(0, vocab, 8)] + stretch[:16]
    fresh = [int(t) for t in rng.integers(0, vocab, len(copy))]
    return {"copy": copy, "fresh": fresh}


def run(model, prompt, n, setting, sources, policies):
    k, source = SETTINGS[setting]
    drafter = None if source is None else sources[setting].drafter()
    dec = MTPDecoder(model, k, adaptive=True, drafter=drafter, policy=policies.get(setting))
    dec.prefill(prompt)
    out = dec.step().tokens
    t0 = time.perf_counter()
    while len(out) < n:
        out += dec.step().tokens
    mx.synchronize()
    dt = time.perf_counter() - t0
    s = dec.stats
    first = s.acceptance_per_pos[0] if s.drafted_per_pos else None
    return out[:n], {"tok_s": (len(out) - 1) / dt, "drafted": s.num_draft_tokens,
                     "accepted": s.num_accepted_tokens, "lookup_drafted": s.lookup_draft_tokens,
                     "lookup_accepted": s.lookup_accepted_tokens, "first_pos": first,
                     "mean_acceptance_length": s.mean_acceptance_length}


def bench_head(a, head, tmp):
    path = make_tiny(tmp / head, "qwen3_5", "noisy", vocab_size=a.vocab, hidden=a.hidden,
                     num_layers=a.layers, trunk_scale=0.1, fc_noise=HEAD_NOISE[head],
                     dtype=mx.bfloat16)
    model, _ = load(str(path), dtype=a.dtype)
    # One policy and one cost table per setting over its runs, as a server keeps them.
    sources = {s: DraftSources(SETTINGS[s][1]) for s in SETTINGS if SETTINGS[s][1]}
    policies = {s: DraftPolicy() for s in SETTINGS if SETTINGS[s][0]}
    result = {}
    for name, prompt in prompts(a.vocab, a.tokens).items():
        for s in SETTINGS:  # warm-up: shapes, allocations, first cost measurements
            run(model, prompt, 32, s, sources, policies)
        runs = {s: [] for s in SETTINGS}
        ref = None
        for r in range(a.repeats):
            order = list(SETTINGS) if r % 2 == 0 else list(SETTINGS)[::-1]
            for s in order:
                toks, fig = run(model, prompt, a.tokens, s, sources, policies)
                if s == "plain":
                    ref = ref or toks
                runs[s].append((toks, fig))
        rows = {}
        for s, rs in runs.items():
            tps = statistics.median(f["tok_s"] for _, f in rs)
            rows[s] = {**rs[-1][1], "tok_s": tps, "same_as_plain": all(t == ref for t, _ in rs)}
        for s in rows:
            rows[s]["vs_plain"] = rows[s]["tok_s"] / rows["plain"]["tok_s"]
            rows[s]["vs_mtp"] = rows[s]["tok_s"] / rows["mtp"]["tok_s"]
        result[name] = rows
        print(f"\n{head} head, {name} prompt ({len(prompt)} tokens, {a.tokens} generated)")
        print("setting  tok/s   x plain  x mtp   first-pos  context acc/drafted  same")
        for s, row in rows.items():
            fp = "-" if row["first_pos"] is None else f"{row['first_pos']:.2f}"
            print(f"{s:7s} {row['tok_s']:7.1f}  {row['vs_plain']:6.2f}  {row['vs_mtp']:5.2f}  "
                  f"{fp:>9s}  {row['lookup_accepted']:>8d}/{row['lookup_drafted']:<8d}  "
                  f"{row['same_as_plain']}")
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="auto", help="load dtype (auto: as the CLI)")
    p.add_argument("--heads", default="noisy,never")
    p.add_argument("--out", default="benchmarks/results/lookup_oracle.json")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = {h: bench_head(a, h, Path(tmp)) for h in a.heads.split(",")}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "results": out}, indent=1))
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
