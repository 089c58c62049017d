"""Decoding speed with each head draft started as soon as it is drawn (``mx.async_eval`` in
``drafters/mtp_head.py``, the current code) against the step's graph started only once it
is complete (the same calls made no-ops), on a family's oracle checkpoint
(``families_oracle.build``). Plain decoding, then both settings, interleaved in one process
(order reversed every other round) so machine load shifts them alike; every run's tokens must
equal plain decoding's. Not a test: timings depend on the machine.

    python benchmarks/early_drafts.py [--family glm4_moe --k 3 --rounds 14 --tokens 64]
    python benchmarks/early_drafts.py --model DIR     # any checkpoint (``demo``: the demo model)
"""

from __future__ import annotations

import argparse
import statistics as st
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import mlx_mtp  # noqa: F401  (first: it routes MLX's CPU matmuls to OpenBLAS)
import mlx.core as mx

import mlx_mtp.decode.step as step_module
import mlx_mtp.drafters.mtp_head as head_module
from families_oracle import build
from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.decode.speculative import MTPDecoder
from mlx_mtp.models.io.loader import load, load_model

PROMPT = list(range(100, 164))


class _LateDrafts:
    """``mx`` as the head chain sees it, with ``async_eval`` a no-op: the head's work waits
    for the step's one ``async_eval`` at the end of ``launch`` (the code before this change)."""

    def __getattr__(self, name):
        return (lambda *a, **k: None) if name == "async_eval" else getattr(mx, name)


def late_drafts(on: bool):
    """Make ``_draft_head`` start nothing early (``on``) or restore it."""
    cls = step_module.DecodeBatch
    if not hasattr(cls, "_early_draft_head"):
        cls._early_draft_head = cls._draft_head

        def draft_head(self, *a, **k):
            if not cls._late:
                return cls._early_draft_head(self, *a, **k)
            head_module.mx = _LateDrafts()
            try:
                return cls._early_draft_head(self, *a, **k)
            finally:
                head_module.mx = mx

        cls._draft_head = draft_head
    cls._late = on


def run(model, k: int, tokens: int):
    """(tok/s after the first step, tokens)."""
    dec = MTPDecoder(model, k, SamplingParams(), adaptive=False)
    dec.prefill(PROMPT)
    out = list(dec.step().tokens)
    start, n = time.perf_counter(), 0
    while n < tokens:
        got = dec.step().tokens
        out += got
        n += len(got)
    dec.finish_pending()
    mx.synchronize()
    return n / (time.perf_counter() - start), out[:tokens]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="glm4_moe")
    p.add_argument("--model", help="a checkpoint directory instead of a family's oracle "
                                   "fixture ('demo': the embedded demo model)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--rounds", type=int, default=14)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model = load(None if args.model == "demo" else args.model)[0]
        else:
            path = build(Path(tmp) / args.family, args.family,
                         SimpleNamespace(hidden=args.hidden, layers=args.layers))
            model = load_model(path)[0]
        settings = {"plain": (0, False), "late drafts (before)": (args.k, True),
                    "early drafts (now)": (args.k, False)}
        tps = {name: [] for name in settings}
        reference = None
        for r in range(args.rounds):
            names = list(settings) if r % 2 == 0 else list(settings)[::-1]
            for name in names:
                k, late = settings[name]
                late_drafts(late)
                rate, out = run(model, k, args.tokens)
                reference = reference or out
                if out[:len(reference)] != reference[:len(out)]:
                    raise SystemExit(f"{name}: output differs from plain decoding")
                tps[name].append(rate)
        late_drafts(False)
    plain = st.median(tps["plain"])
    print(f"{args.model or args.family}, K={args.k}, {args.rounds} rounds of {args.tokens} tokens:")
    for name, v in tps.items():
        print(f"  {name:22s} median {st.median(v):6.1f} tok/s  {st.median(v) / plain:.3f}x plain"
              f"  (runs {min(v):.1f}-{max(v):.1f})")


if __name__ == "__main__":
    main()
