"""Draft vocabulary (``--draft-vocab``): what it saves per draft and what it costs in acceptance.

    python benchmarks/draft_vocab.py cost [--vocab 248320] [--hidden 1024] [--layers 8]
        [--dtype f32|bf16] [--sizes 16384,32768,65536] [--reps 40]
    python benchmarks/draft_vocab.py acceptance [--model DIR] [--sizes 512,1024,2048] [--k 1]
        [--n-prompts 20]

cost: a Qwen3.5-shaped model with a real-sized vocabulary (random weights; the ranking is by
  token id, which does not matter for cost): median milliseconds of one draft (one MTP call,
  draft logits, log-softmax, argmax; one row) and of one plain decode step, for the whole
  output layer and each subset size, interleaved.
acceptance: a trained model with its draft_vocab.json (default: the demo model, ranked on the
  standard library's training split if it has no file): greedy fixed-K decoding of 20
  held-out prompts (chat template, the model's penalty defaults, 256 tokens) at each subset
  size, interleaved per prompt; first-position acceptance and decode tok/s; outputs are
  checked identical to the whole-vocabulary run.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import mlx_mtp  # noqa: F401  (BLAS shim before MLX)
import mlx.core as mx
from mlx_mtp.decode.prompt import build_prompt, encode_prompt
from mlx_mtp.decode.sampling import SamplingParams, log_softmax
from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.models.draft import vocab as draft_vocab
from mlx_mtp.models.cache.kv import KVCache
from mlx_mtp.models.io.loader import DEFAULT_MODEL, generation_defaults, load
from mlx_mtp.options import PENALTIES
from mlx_mtp.train.export import heldout_prompts


def _sizes(text):
    return [int(s) for s in text.split(",")]


def cost(a):
    from mlx_mtp.testing.tiny import make_tiny

    tmp = Path(tempfile.mkdtemp())
    try:
        dtype = {"bf16": mx.bfloat16, "f32": mx.float32}[a.dtype]
        path = make_tiny(tmp / "m", "qwen3_5", "oracle", vocab_size=a.vocab, hidden=a.hidden,
                         num_layers=a.layers, trunk_scale=0.1, dtype=dtype)
        model, _ = load(str(path))
        cache, mtp_cache = model.make_cache(), model.make_mtp_cache()
        prompt = mx.array([list(range(1, 65))])
        h, _ = model.trunk(prompt, cache)
        model.mtp_forward(h[:, :-1], prompt[:, 1:], mtp_cache)
        mx.eval([c.state for c in cache + mtp_cache])
        y = prompt[:, -1:]
        last = h[:, -1:]

        def plain():  # one decode step; the attention caches are trimmed back after it
            hh, _ = model.trunk(y, cache)
            return mx.argmax(log_softmax(model.logits(hh)[:, -1]), axis=-1)

        def draft():
            out = model.mtp_forward(last, y, mtp_cache)
            for c in mtp_cache:
                c.trim(1)
            return mx.argmax(log_softmax(model.draft_logits(out)[:, -1]), axis=-1)

        heads = {"whole": None, **{str(n): np.arange(n) for n in a.sizes}}
        times = {name: [] for name in ["plain", *heads]}
        for r in range(a.reps):
            order = list(heads) if r % 2 == 0 else list(heads)[::-1]
            for name in order:
                model.set_draft_head(vocab=heads[name])
                mx.eval(draft())  # warm (the head's arrays)
                t = time.perf_counter()
                mx.eval(draft())
                times[name].append(time.perf_counter() - t)
            t = time.perf_counter()
            mx.eval(plain())
            times["plain"].append(time.perf_counter() - t)
            for c in cache:
                if isinstance(c, KVCache):
                    c.trim(1)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"qwen3_5 hidden {a.hidden}, {a.layers} layers, vocabulary {a.vocab}, {a.dtype}; "
              f"medians of {a.reps} interleaved repetitions")
        print("| draft vocabulary | draft ms | c_draft (draft / plain step) | vs whole |")
        print("|---|---:|---:|---:|")
        for name in heads:
            print(f"| {name} | {med[name]:.2f} | {med[name] / med['plain']:.3f} | "
                  f"{med[name] / med['whole']:.2f}× |")
        print(f"plain step: {med['plain']:.2f} ms")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def acceptance(a):
    src = Path(a.model) if a.model else DEFAULT_MODEL
    tmp = None
    if not (src / draft_vocab.FILE).exists():  # rank a copy on the stdlib training split
        import subprocess
        import sys

        tmp = Path(tempfile.mkdtemp())
        shutil.copytree(src, tmp / "m")
        src = tmp / "m"
        subprocess.run([sys.executable, "-m", "mlx_mtp.cli", "draft-vocab", "--model", str(src)],
                       check=True)
    try:
        model, tok = load(str(src), dtype="auto")
        defaults = generation_defaults(str(src))
        sampling = SamplingParams(**{k: defaults[k] for k in PENALTIES if k in defaults})
        prompts = [encode_prompt(tok, build_prompt(tok, tok.decode(p)))
                   for p in heldout_prompts(a.n_prompts, 128, seed=0)]
        V = model.text.args.vocab_size
        sizes = [None, *a.sizes]
        heads = {n: (None if n is None else draft_vocab.select(src, n, V)) for n in sizes}
        res = {n: {"acc": 0, "drafted": 0, "t": 0.0, "tok": 0} for n in sizes}
        eos = set(tok.eos_token_ids)
        outputs = {}
        for i, p in enumerate(prompts):
            for n in (sizes if i % 2 == 0 else sizes[::-1]):
                model.set_draft_head(vocab=heads[n])
                dec = MTPDecoder(model, a.k, sampling, adaptive=False)
                toks, t = [], None
                for tkn, _, _ in generate_step(p, model, decoder=dec, max_tokens=256):
                    if t is None:
                        t = time.perf_counter()  # decode time: after the first token
                    toks.append(tkn)
                    if tkn in eos:
                        break
                dt = time.perf_counter() - t
                assert toks == outputs.setdefault(i, toks), f"prompt {i}, vocabulary {n}"
                r = res[n]
                r["acc"] += dec.stats.num_accepted_tokens
                r["drafted"] += dec.stats.num_draft_tokens
                r["t"] += dt
                r["tok"] += len(toks) - 1
        print(f"{src.name}: {len(prompts)} held-out prompts, greedy, K={a.k} fixed, "
              f"penalties {sampling.repetition_penalty}; outputs identical: yes")
        print("| draft vocabulary | acceptance | decode tok/s |\n|---|---:|---:|")
        for n in sizes:
            r = res[n]
            print(f"| {'whole' if n is None else n} | {r['acc'] / max(r['drafted'], 1):.1%} | "
                  f"{r['tok'] / r['t']:.1f} |")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["cost", "acceptance"])
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--model", default=None)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--n-prompts", type=int, default=20)
    ap.add_argument("--sizes", type=_sizes, default=None)
    a = ap.parse_args()
    if a.sizes is None:
        a.sizes = [16384, 32768, 65536] if a.what == "cost" else [512, 1024, 2048]
    cost(a) if a.what == "cost" else acceptance(a)


if __name__ == "__main__":
    main()
