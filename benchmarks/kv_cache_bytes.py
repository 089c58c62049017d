"""KV cache bytes per 1k tokens, 16-bit against ``--kv-bits 4`` (group 64), for every family
that takes ``--kv-bits`` (issue 38's target: 4-bit <= 0.3x of 16-bit). Counts, not timing.

Each family's tiny checkpoint (``mlx_mtp.testing.kv_widths``: every cached width 64), random
float32 weights: the trunk's and MTP head's caches are measured by their own ``nbytes`` after
1024 and after 2048 prompt tokens, and the difference is what 1k tokens add (windows and
recurrent states, bounded, drop out). The float32 model's caches are counted as a 16-bit
model's would be (floats halved, packed values as they are: MLX's CPU gather_mm runs float32
only). Beside it, ``inspect --kv-bits 4``'s figures (``models/cache_growth.py``: the same
caches, on shapes alone; ``tests/test_inspect_cache_bytes.py`` checks they are equal).

    python benchmarks/kv_cache_bytes.py [FAMILY ...]
"""

import sys

import mlx_mtp  # noqa: F401  (first: loads the OpenBLAS shim before MLX, as the CLI does)
import mlx.core as mx

from mlx_mtp.models.cache.quantized import KVQuantization
from mlx_mtp.models.io.loader import build_model
from mlx_mtp.testing import tiny_attention
from mlx_mtp.testing.kv_widths import width_64_configs
from mlx_mtp.tools.inspect_model import memory_estimate


def held_bytes(model, n: int) -> int:
    """The trunk's and the MTP head's caches' bytes after an ``n``-token prompt (the head
    reads each hidden with the token after it, as a prefill does), counted at 16 bits."""
    cache, head = model.make_cache(), model.make_mtp_cache()
    ids = mx.array([[i % 100 + 1 for i in range(n + 1)]], mx.uint32)
    for s in range(0, n, 256):
        h = model.trunk(ids[:, s:s + 256], cache)[1]
        if head:
            model.mtp_forward(h, ids[:, s + 1:s + 257], head)
        mx.eval([a for c in cache + head for a in c.arrays()])
    return sum(a.nbytes if a.dtype == mx.uint32 else a.nbytes // 2
               for c in cache + head for a in c.arrays())


def per_1k_tokens(model, quant) -> int:
    model.use_kv_quantization(quant)
    return held_bytes(model, 2048) - held_bytes(model, 1024)


def main(families):
    print("| family | 16-bit | 4-bit | ratio | inspect 16-bit | inspect 4-bit |")
    print("|---|---|---|---|---|---|")
    for family, config in width_64_configs().items():
        if families and family not in families:
            continue
        model = tiny_attention.build_model(config, seed=0)
        full, q4 = per_1k_tokens(model, None), per_1k_tokens(model, KVQuantization(4, 64))
        est = memory_estimate({}, build_model(dict(config)), 4, 64)
        shown = [est["kv_bytes_per_1k_tokens"], est["kv_bytes_per_1k_tokens_quantized"]]
        shown = ["-" if x is None else x for x in shown]
        print(f"| {family} | {full} | {q4} | {q4 / full:.3f} | {shown[0]} | {shown[1]} |",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
