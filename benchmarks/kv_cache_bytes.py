"""KV cache bytes per 1k tokens, 16-bit against ``--kv-bits 4`` (group 64), for every family
that takes ``--kv-bits`` (issue 38's target: 4-bit <= 0.3x of 16-bit). Counts, not timing.

Each family's tiny checkpoint (``mlx_mtp.testing``, or its fixture config for the stream trunks)
with every cached width made 64, random float32 weights: the trunk's caches are measured by
their own ``nbytes`` after 1024 and after 2048 prompt tokens, and the difference is what 1k
tokens add (windows and recurrent states, bounded, drop out). The float32 model's caches are
counted as a 16-bit model's would be (floats halved, packed values as they are). Beside it,
``inspect --kv-bits 4``'s estimate from the config (trunk and MTP layers; "-": none).

    python benchmarks/kv_cache_bytes.py [FAMILY ...]
"""

import json
import sys
from pathlib import Path

import mlx_mtp  # noqa: F401  (first: loads the OpenBLAS shim before MLX, as the CLI does)
import mlx.core as mx

from mlx_mtp.models.cache.quantized import KVQuantization
from mlx_mtp.testing import tiny, tiny_attention, tiny_special
from mlx_mtp.tools.inspect_model import memory_estimate

FIXTURES = Path(__file__).parent.parent / "tests" / "fixtures"


def stream_config(family: str, **widths) -> dict:
    path = FIXTURES / family / ("config.json" if family == "deepseek_v4" else
                                "checkpoint/config.json")
    config = json.loads(path.read_text())
    config.get("text_config", config).update(widths)
    return config


def configs() -> dict:
    """Every family's config, its cached widths 64."""
    qwen4 = stream_config("qwen4_exp", head_dim=64)
    # the same four rotary channels as at head_dim 16 (its mrope sections)
    qwen4["text_config"]["rope_parameters"]["partial_rotary_factor"] = 0.0625
    return {
        "qwen3_5": dict(tiny.tiny_text_config("qwen3_5"), model_type="qwen3_5", head_dim=64),
        "glm4_moe": dict(tiny_attention.tiny_config("glm4_moe"), head_dim=64),
        "deepseek_v3": dict(tiny_attention.tiny_config("deepseek_v3"), qk_rope_head_dim=64,
                            kv_lora_rank=64),
        "longcat_flash": dict(tiny_special.longcat_flash_config(), qk_rope_head_dim=64,
                              kv_lora_rank=64),
        "nemotron_h": dict(tiny_special.nemotron_h_config(), head_dim=64),
        "step3p5": dict(tiny_special.step3p5_config(), head_dim=64),
        "mimo_v2_flash": dict(tiny_special.mimo_v2_flash_config(), head_dim=64, v_head_dim=64,
                              swa_head_dim=64, swa_v_head_dim=64),
        "deepseek_v32": dict(tiny_special.dsa_config("deepseek_v32"), qk_rope_head_dim=64,
                             index_head_dim=64, kv_lora_rank=64),
        "qwen4_exp": qwen4,
        "glm5_next": stream_config("glm5_next", kv_lora_rank=64),
        "deepseek_v4": stream_config("deepseek_v4", head_dim=64, index_head_dim=64),
    }


def held_bytes(model, n: int) -> int:
    """The trunk caches' bytes after an ``n``-token prompt, counted at 16 bits."""
    cache = model.make_cache()
    ids = mx.array([[i % 100 + 1 for i in range(n)]], mx.uint32)
    for s in range(0, n, 256):
        model.trunk(ids[:, s:s + 256], cache)
        mx.eval([a for c in cache for a in c.arrays()])
    return sum(a.nbytes if a.dtype == mx.uint32 else a.nbytes // 2
               for c in cache for a in c.arrays())


def per_1k_tokens(model, quant) -> int:
    model.use_kv_quantization(quant)
    return held_bytes(model, 2048) - held_bytes(model, 1024)


def main(families):
    print("| family | 16-bit | 4-bit | ratio | inspect 16-bit | inspect 4-bit |")
    print("|---|---|---|---|---|---|")
    for family, config in configs().items():
        if families and family not in families:
            continue
        model = tiny_attention.build_model(config, seed=0)
        full, q4 = per_1k_tokens(model, None), per_1k_tokens(model, KVQuantization(4, 64))
        est = memory_estimate(config, {}, 4, 64)
        shown = [est["kv_bytes_per_1k_tokens"], est["kv_bytes_per_1k_tokens_quantized"]]
        shown = ["-" if x is None else x for x in shown]
        print(f"| {family} | {full} | {q4} | {q4 / full:.3f} | {shown[0]} | {shown[1]} |",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
