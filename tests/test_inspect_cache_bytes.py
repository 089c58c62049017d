"""``inspect``'s KV figures are what the caches hold, for every family (issue 38): its bytes
per 1k tokens at 16 bits and at ``--kv-bits 4`` equal what a 16-bit model's own caches (trunk
and MTP head), prefilled and evaluated, grow by: twice what they hold after 1024 prompt
tokens less after 512 (inspect's: 2048 less 1024; the caches that grow do so linearly, and
windows, recurrent states and pending rows are bounded and drop out). Exact: no tolerance.
``inspect`` computes its figures on shapes alone, from a model built lazily from the config:
nothing is evaluated (peak memory stays under what one layer's cache would take).

The families that take ``--kv-bits`` have every cached width 64 (``mlx_mtp.testing.kv_widths``,
the configs ``benchmarks/kv_cache_bytes.py`` measures for docs/quantized-kv.md's table); the
others are at their test shapes.
"""

import mlx_mtp  # noqa: F401  (first: loads the OpenBLAS shim before MLX, as the CLI does)
import mlx.core as mx
import pytest

from mlx_mtp.models.cache.quantized import KVQuantization
from mlx_mtp.models.io.loader import build_model
from mlx_mtp.testing import tiny, tiny_attention, tiny_bailing, tiny_minimax, tiny_next
from mlx_mtp.testing import tiny_special
from mlx_mtp.testing.kv_widths import width_64_configs
from mlx_mtp.tools.inspect_model import memory_estimate

# The families without a row in docs/quantized-kv.md's table, at their test shapes (cached
# widths under 64: --kv-bits 4 at group 64 is refused, and inspect gives no 4-bit figure).
OTHER_CONFIGS = {
    "qwen3_5_moe": dict(tiny.tiny_text_config("qwen3_5_moe"), model_type="qwen3_5_moe"),
    "qwen3_next": dict(tiny.tiny_text_config("qwen3_next"), model_type="qwen3_next"),
    "glm4_moe_lite": tiny_attention.tiny_config("glm4_moe_lite"),
    "mimo": tiny_attention.tiny_config("mimo"),
    "step3p7": tiny_next.step3p7_config(),
    "mellum": tiny_next.mellum_config(),
    "minimax_m3_vl": tiny_minimax.minimax_m3_vl_config(),
    "bailing_hybrid": tiny_bailing.bailing_hybrid_config(),
    "glm_moe_dsa": tiny_special.dsa_config("glm_moe_dsa"),
}
CONFIGS = {**width_64_configs(), **OTHER_CONFIGS}
CHUNK = 128  # not inspect's 256: the growth does not depend on how a prompt is chunked


def measured_per_1k_tokens(config: dict, quant) -> int:
    """Twice what the caches of an evaluated model grow by from 512 to 1024 tokens, a float32
    model's floats counted at 16 bits (MLX's CPU gather_mm, which the MoE families run, takes
    float32 only), packed values as they are."""
    model = tiny_attention.build_model(config, seed=0)
    model.use_kv_quantization(quant)
    cache, head = model.make_cache(), model.make_mtp_cache()
    ids = mx.array([[i % 100 + 1 for i in range(1025)]], mx.uint32)
    held = {}
    for start in range(0, 1024, CHUNK):
        h = model.trunk(ids[:, start:start + CHUNK], cache)[1]
        if head:  # the head reads each hidden with the token after it, as a prefill does
            model.mtp_forward(h, ids[:, start + 1:start + 1 + CHUNK], head)
        mx.eval([c.state for c in cache + head])
        held[start + CHUNK] = sum(a.nbytes if a.dtype == mx.uint32 else a.nbytes // 2
                                  for c in cache + head for a in c.arrays())
    return 2 * (held[1024] - held[512])


@pytest.mark.parametrize("family", list(CONFIGS))
def test_inspect_bytes_per_1k_tokens_equal_the_caches_growth(family):
    config = CONFIGS[family]
    held, _ = mx.get_active_memory(), mx.reset_peak_memory()
    memory = memory_estimate({}, build_model(dict(config)), 4, 64)
    assert mx.get_peak_memory() - held < 1 << 18  # shapes only: no weight, no cache evaluated
    assert memory["kv_bytes_per_1k_tokens"] == measured_per_1k_tokens(config, None)
    try:
        quantized = measured_per_1k_tokens(config, KVQuantization(4, 64))
    except ValueError:  # the model refuses it (use_kv_quantization): no figure
        quantized = None
    assert memory["kv_bytes_per_1k_tokens_quantized"] == quantized
    assert quantized is not None or family in OTHER_CONFIGS


def test_deepseek_v4_at_4_bits_is_under_0_3_of_16_bits():
    """Every cache of DeepSeek-V4 that grows is quantized: the issue's target holds there."""
    config = CONFIGS["deepseek_v4"]
    memory = memory_estimate({}, build_model(dict(config)), 4, 64)
    assert memory["kv_bytes_per_1k_tokens_quantized"] / memory["kv_bytes_per_1k_tokens"] <= 0.3
    assert memory["state_caches"] == ["DeepSeek-V4 windows and compressors' pending rows"]
