"""``inspect``'s KV figures are what the caches hold, for every family that takes ``--kv-bits``
(issue 38): its bytes per 1k tokens at 16 bits and at ``--kv-bits 4`` equal what a 16-bit
model's own caches (trunk and MTP head), prefilled and evaluated, grow by per token (twice
what they hold after 1024 prompt tokens less after 512, inspect's being 2048 less 1024:
the caches that grow do so linearly; windows, recurrent states and pending rows are bounded
and drop out). Exact: no tolerance. ``inspect`` computes its figures on shapes alone, from a model built
lazily from the config: nothing is evaluated (peak memory stays under what one layer's
cache would take).

Each family's tiny config has every cached width 64 (``mlx_mtp.testing.kv_widths``, the
configs ``benchmarks/kv_cache_bytes.py`` measures for docs/quantized-kv.md's table).
"""

import mlx_mtp  # noqa: F401  (first: loads the OpenBLAS shim before MLX, as the CLI does)
import mlx.core as mx
import pytest

from mlx_mtp.models.cache.quantized import KVQuantization
from mlx_mtp.models.io.loader import build_model
from mlx_mtp.testing import tiny_attention
from mlx_mtp.testing.kv_widths import width_64_configs
from mlx_mtp.tools.inspect_model import memory_estimate

CONFIGS = width_64_configs()
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
    memory = memory_estimate(config, {}, build_model(dict(config)), 4, 64)
    assert mx.get_peak_memory() - held < 1 << 18  # shapes only: no weight, no cache evaluated
    assert memory["kv_bytes_per_1k_tokens"] == measured_per_1k_tokens(config, None)
    assert memory["kv_bytes_per_1k_tokens_quantized"] == measured_per_1k_tokens(
        config, KVQuantization(4, 64))


def test_deepseek_v4_at_4_bits_is_under_0_3_of_16_bits():
    """Every cache of DeepSeek-V4 that grows is quantized: the issue's target holds there."""
    config = CONFIGS["deepseek_v4"]
    memory = memory_estimate(config, {}, build_model(dict(config)), 4, 64)
    assert memory["kv_bytes_per_1k_tokens_quantized"] / memory["kv_bytes_per_1k_tokens"] <= 0.3
    assert memory["state_caches"] == ["DeepSeek-V4 windows and compressors' pending rows"]
