"""Model families. One module per Hugging Face ``model_type``."""

import importlib

from .cache import recurrent, window  # noqa: F401  (register their caches' kinds for loading)

# model_type -> module name. The ``*_text`` names are the text configs of the
# multimodal Qwen3.5/3.6 checkpoints (flat ``*ForCausalLM`` exports); ``*_mtp`` are
# vLLM's draft-model types, which some re-exports keep (dense or MoE by the config).
MODEL_TYPES = {
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_mtp": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_next": "qwen3_next",
    "qwen3_next_mtp": "qwen3_next",
    "glm4_moe": "glm4_moe",
    "glm4_moe_lite": "glm4_moe_lite",
    "deepseek_v3": "deepseek_v3",
    "mimo": "mimo",
    "step3p5": "step3p5",
    "mimo_v2_flash": "mimo_v2_flash",
    "nemotron_h": "nemotron_h",
    "longcat_flash": "longcat_flash",
    "deepseek_v32": "deepseek_v32",
    "glm_moe_dsa": "glm_moe_dsa",
    "step3p7": "step3p7",
    "mellum": "mellum",
}


class UnsupportedModelError(ValueError):
    pass


def get_model_module(model_type: str):
    name = MODEL_TYPES.get(model_type)
    if name is None:
        supported = ", ".join(sorted(MODEL_TYPES))
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported by mlx-mtp. "
            f"Supported model types: {supported}. Run other models with mlx-lm "
            "(`mlx_lm.generate`, `mlx_lm.server`); see docs/model-families.md."
        )
    return importlib.import_module(f"{__name__}.families.{name}")
