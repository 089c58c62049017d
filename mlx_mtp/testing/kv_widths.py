"""Every family that takes ``--kv-bits``, as a tiny config whose cached widths are all 64 (so
any ``--kv-group-size`` divides them): what ``benchmarks/kv_cache_bytes.py`` measures and
``tests/test_inspect_cache_bytes.py`` checks ``inspect`` against. The stream trunks' configs
are their test fixtures' (read from ``tests/fixtures``: a source checkout)."""

import json
from pathlib import Path

from . import tiny, tiny_attention, tiny_special

FIXTURES = Path(__file__).parents[2] / "tests" / "fixtures"


def stream_config(family: str, **widths) -> dict:
    path = FIXTURES / family / ("config.json" if family == "deepseek_v4" else
                                "checkpoint/config.json")
    config = json.loads(path.read_text())
    config.get("text_config", config).update(widths)
    return config


def width_64_configs() -> dict:
    """Every family's config, its cached widths 64."""
    qwen4 = stream_config("qwen4_exp", head_dim=64, indexer_head_dim=64)
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
        "glm5_next": stream_config("glm5_next", kv_lora_rank=64, index_head_dim=64),
        "deepseek_v4": stream_config("deepseek_v4", head_dim=64, index_head_dim=64),
    }
