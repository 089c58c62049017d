"""Issue-2 speed checks, one interleaved run on one machine.

1. MTP off: our decode tok/s vs mlx-lm's own stream_generate on the same checkpoint.
2. 100% acceptance (oracle head): realised speedup vs the ideal implied by the measured
   cost of one verify pass and one draft pass.
3. 0% acceptance (random head): adaptive MTP vs MTP off.

    python benchmarks/speed_vs_mlx_lm.py [--hidden 512] [--layers 8] [--tokens 128] [--repeats 3]
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import stream_generate as lm_stream_generate
from mlx_lm.utils import load as lm_load

from mlx_mtp.models.loader import load
from mlx_mtp.decode.speculative import MTPDecoder
from mlx_mtp.testing.tiny import make_tiny

PROMPT = "def fibonacci(n):\n    "


def ours_tps(model, ids, n, k, adaptive):
    dec = MTPDecoder(model, k, adaptive=adaptive)
    dec.prefill(ids)
    dec.step()  # first token belongs to prompt processing (as in mlx-lm)
    got, tic = 0, time.perf_counter()
    while got < n:
        got += len(dec.step().tokens)
    return got / (time.perf_counter() - tic), dec


def mlx_lm_tps(model, tok, n):
    last = None
    for last in lm_stream_generate(model, tok, PROMPT, max_tokens=n + 1):
        pass
    return last.generation_tps


def timed(fn, reps=20):
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def pass_costs(model, ids, k):
    """Seconds for a plain step, a verify pass over k+1 tokens, one draft call."""
    dec = MTPDecoder(model, k, adaptive=False)
    dec.prefill(ids)
    cache = dec.cache

    def run(tokens, capture):
        h, _ = model.trunk(mx.array([tokens]), cache, capture=capture)
        mx.eval(model.logits(h))
        for c in cache:
            if hasattr(c, "trim"):
                c.trim(len(tokens))
            else:
                c.clear_captured()

    # Recurrent caches are overwritten, not trimmed: keep a copy to restore.
    saved = [c.copy() for c in cache]

    def plain():
        run([5], False)
        dec.cache[:] = [c.copy() for c in saved]
        cache[:] = dec.cache

    def verify():
        run([5] * (k + 1), True)
        cache[:] = [c.copy() for c in saved]

    mcache = model.make_mtp_cache()
    h = mx.zeros((1, 1, model.text.args.hidden_size))

    def draft():
        out = model.mtp_forward(h, mx.array([[5]]), mcache)
        mx.eval(model.logits(out))
        for c in mcache:
            c.trim(1)

    return timed(plain), timed(verify), timed(draft)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    kw = dict(vocab_size=4096, hidden=a.hidden, num_layers=a.layers)
    oracle = make_tiny(tmp / "oracle", "qwen3_5", "oracle", trunk_scale=0.1, **kw)
    rand = make_tiny(tmp / "random", "qwen3_5", "random", **kw)

    lm_model, lm_tok = lm_load(str(oracle))
    model, tok = load(str(oracle))
    rmodel, _ = load(str(rand))
    ids = tok.encode(PROMPT)
    n = a.tokens
    res = {k: [] for k in ["mlx_lm", "ours_k0", "oracle_k1", "oracle_k2", "oracle_k3",
                           "oracle_auto", "rand_k0", "rand_auto"]}
    for _ in range(a.repeats):  # interleaved
        res["mlx_lm"].append(mlx_lm_tps(lm_model, lm_tok, n))
        res["ours_k0"].append(ours_tps(model, ids, n, 0, False)[0])
        for k in (1, 2, 3):
            res[f"oracle_k{k}"].append(ours_tps(model, ids, n, k, False)[0])
        res["oracle_auto"].append(ours_tps(model, ids, n, 3, True)[0])
        res["rand_k0"].append(ours_tps(rmodel, ids, n, 0, False)[0])
        res["rand_auto"].append(ours_tps(rmodel, ids, n, 3, True)[0])
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"model: qwen3_5 hidden={a.hidden} layers={a.layers} vocab=4096 fp32, "
          f"{n} tokens, {a.repeats} interleaved repeats (median tok/s)")
    for k, v in med.items():
        print(f"  {k:12s} {v:8.1f} tok/s")
    print(f"MTP off vs mlx-lm stream_generate: {med['ours_k0'] / med['mlx_lm']:.3f}x")
    for k in (1, 2, 3):
        t_plain, t_verify, t_draft = pass_costs(model, ids, k)
        ideal = (k + 1) / ((t_verify + k * t_draft) / t_plain)
        real = med[f"oracle_k{k}"] / med["ours_k0"]
        print(f"K={k}: verify {t_verify / t_plain:.2f} plain steps, draft {t_draft / t_plain:.2f}; "
              f"ideal {ideal:.2f}x, realised {real:.2f}x, efficiency {real / ideal:.0%}")
    print(f"100% acceptance, adaptive K<=3: {med['oracle_auto'] / med['ours_k0']:.2f}x")
    print(f"0% acceptance, adaptive K<=3 vs MTP off: {med['rand_auto'] / med['rand_k0']:.3f}x")


if __name__ == "__main__":
    main()
