"""Verify cost at long context (issue 38): verify(K) / plain step, and the MTP head's
catch-up pass over K+1 rows / one draft call, on the caches left by an 8k and a 32k
prompt, on checkpoints built by ``mlx_mtp.testing`` (random weights, hidden 1024):
Qwen3.5 (Gated DeltaNet + gated full attention) and DeepSeek-V3 (MLA). Pass costs are
``bench.inprocess.measure_costs``'s (medians, each pass undone before the next), as
``mlx-mtp bench`` reports them; peak memory is reset before each length.

Target (issue 38): verify(3) / plain <= 1.3 at 32k on hidden 1024. Run it on an idle
machine:

    python benchmarks/long_context.py                        # 8k, 32k; hidden 1024
    python benchmarks/long_context.py --lengths 256,512 --hidden 64 --reps 2   # smoke run
    python benchmarks/long_context.py --kv-bits 4 -o long_context.json
"""

import argparse
import json
import time

import mlx_mtp  # noqa: F401  (first: loads the OpenBLAS shim before MLX, as the CLI does)
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlx_mtp.bench.inprocess import measure_costs
from mlx_mtp.bench.long_context import parse_lengths
from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.decode.speculative import MTPDecoder
from mlx_mtp.models.cache.kv import restore_caches, snapshot_caches
from mlx_mtp.models.cache.quantized import KVQuantization
from mlx_mtp.platform import gemv_limits
from mlx_mtp.testing import tiny, tiny_attention


# Attention shapes of the released models (the builders' are tiny whatever the hidden size):
# attention over a long cache costs by heads x head size, not by hidden size.
HEADS = {
    "qwen3_5": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                    linear_num_value_heads=16, linear_num_key_heads=8,
                    linear_key_head_dim=128, linear_value_head_dim=128),
    "deepseek_v3": dict(num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
                        q_lora_rank=768, qk_rope_head_dim=64, qk_nope_head_dim=128,
                        v_head_dim=128),
}


def build(family: str, hidden: int, layers: int, vocab: int, dtype):
    """A model of ``family`` with random weights in ``dtype``, from the test builders, with
    the released models' attention shapes (``HEADS``)."""
    if family == "qwen3_5":
        model = tiny.build_model(family, dict(tiny.tiny_text_config(
            family, vocab_size=vocab, hidden=hidden, num_layers=layers), **HEADS[family]))
    else:
        model = tiny_attention.build_model(dict(tiny_attention.tiny_config(
            family, vocab_size=vocab, hidden=hidden, num_layers=layers), **HEADS[family]))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    # products routed per weight shape as a load routes them (measured once, stored)
    gemv_limits.apply(tree_flatten(model.parameters()), budget=60.0)
    return model


def catch_up_cost(model, ids, k: int, H: int, dtype, reps: int, prefill_step_size: int) -> dict:
    """Seconds of the head's first pass of a step over k+1 owed rows (after k accepted
    drafts) and over one row, on the head's cache after ``ids``; undone after each."""
    dec = MTPDecoder(model, k, SamplingParams(), adaptive=False,
                     prefill_step_size=prefill_step_size)
    dec.prefill(ids)
    dec.sync_mtp_cache()
    hidden = mx.random.normal((1, k + 1, H)).astype(dtype)
    tokens = mx.array(np.arange(k + 1)[None], mx.uint32)
    out = {}
    for rows in (1, k + 1):
        saved, times = snapshot_caches(dec.mtp_cache), []
        for i in range(reps + 1):
            tic = time.perf_counter()
            mx.eval(model.mtp_forward(hidden[:, :rows], tokens[:, :rows], dec.mtp_cache,
                                      last_only=True))
            if i:
                times.append(time.perf_counter() - tic)
            restore_caches(saved)
        out[rows] = float(np.median(times))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="8k,32k")
    ap.add_argument("--families", default="qwen3_5,deepseek_v3")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--ks", default="1,2,3")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="float32: MLX's CPU MoE kernel (gather_mm) takes no other")
    ap.add_argument("--kv-bits", type=int, choices=[4, 8], default=None)
    ap.add_argument("--kv-group-size", type=int, choices=[32, 64, 128], default=64)
    ap.add_argument("--prefill-step-size", type=int, default=2048)
    ap.add_argument("-o", "--output", help="write the figures as JSON here")
    a = ap.parse_args()
    ks = [int(k) for k in a.ks.split(",")]
    rng = np.random.default_rng(0)
    results = []
    for family in a.families.split(","):
        model = build(family, a.hidden, a.layers, a.vocab, getattr(mx, a.dtype))
        if a.kv_bits:
            model.use_kv_quantization(KVQuantization(a.kv_bits, a.kv_group_size))
        for n in parse_lengths(a.lengths):
            ids = [int(t) for t in rng.integers(0, a.vocab, n)]
            mx.reset_peak_memory()
            c = measure_costs(model, ids, ks, a.reps, a.prefill_step_size)
            head = catch_up_cost(model, ids, max(ks), a.hidden, getattr(mx, a.dtype), a.reps, a.prefill_step_size)
            row = {"family": family, "context_tokens": n, "plain_step_ms": c["plain_s"] * 1e3,
                   "verify_over_plain": {k: v / c["plain_s"] for k, v in c["verify_s"].items()},
                   "head_catch_up_over_one_row": head[max(ks) + 1] / head[1],
                   "peak_memory_gb": mx.get_peak_memory() / 1e9}
            results.append(row)
            ratios = " ".join(f"K={k}: {v:.2f}" for k, v in row["verify_over_plain"].items())
            print(f"{family:12s} {n:>7,} tokens: plain {row['plain_step_ms']:.1f} ms; "
                  f"verify/plain {ratios}; head {max(ks) + 1} rows / 1 row "
                  f"{row['head_catch_up_over_one_row']:.2f}; peak {row['peak_memory_gb']:.2f} GB",
                  flush=True)
    if a.output:
        with open(a.output, "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
