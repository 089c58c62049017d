"""Issue-2 speed checks, one interleaved run on one machine.

1. MTP off: our decode tok/s vs mlx-lm's own stream_generate on the same checkpoint.
2. 100% acceptance (oracle head): realised speedup vs the ideal implied by the measured
   cost of one verify pass and one draft pass.
3. 0% acceptance (random head): adaptive MTP vs MTP off.

    python benchmarks/speed_vs_mlx_lm.py [--hidden 1024] [--layers 8] [--vocab 8192] [--dtype bf16]
        [--tokens 128] [--repeats 3]

Pass costs come from ``mlx_mtp.bench.inprocess.measure_costs`` (the numbers ``mlx-mtp bench``
reports).
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import stream_generate as lm_stream_generate
from mlx_lm.utils import load as lm_load

from mlx_mtp.bench.inprocess import measure_costs
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    kw = dict(vocab_size=a.vocab, hidden=a.hidden, num_layers=a.layers,
              dtype={"bf16": mx.bfloat16, "f32": mx.float32}[a.dtype])
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
    print(f"model: qwen3_5 hidden={a.hidden} layers={a.layers} vocab={a.vocab} {a.dtype}, "
          f"{n} tokens, {a.repeats} interleaved repeats (median tok/s)")
    for k, v in med.items():
        print(f"  {k:12s} {v:8.1f} tok/s")
    print(f"MTP off vs mlx-lm stream_generate: {med['ours_k0'] / med['mlx_lm']:.3f}x")
    costs = measure_costs(model, ids, [1, 2, 3], reps=20)
    t_plain, t_draft = costs["plain_s"], costs["draft_s"]
    for k in (1, 2, 3):
        t_verify = costs["verify_s"][k]
        ideal = (k + 1) / ((t_verify + k * t_draft) / t_plain)
        real = med[f"oracle_k{k}"] / med["ours_k0"]
        print(f"K={k}: verify {t_verify / t_plain:.2f} plain steps, draft {t_draft / t_plain:.2f}; "
              f"ideal {ideal:.2f}x, realised {real:.2f}x, efficiency {real / ideal:.0%}")
    print(f"100% acceptance, adaptive K<=3: {med['oracle_auto'] / med['ours_k0']:.2f}x")
    print(f"0% acceptance, adaptive K<=3 vs MTP off: {med['rand_auto'] / med['rand_k0']:.3f}x")


if __name__ == "__main__":
    main()
