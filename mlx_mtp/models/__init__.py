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
    "bailing_hybrid": "bailing_hybrid",
    "minimax_m3_vl": "minimax_m3_vl",
    "step3p7": "step3p7",
    "mellum": "mellum",
    "qwen4_exp": "qwen4_exp",
    "qwen4_exp_text": "qwen4_exp",
    "deepseek_v4": "deepseek_v4",
    "glm5_next": "glm5_next",
    "glm5_next_text": "glm5_next",
}


# Model types whose checkpoints ship an MTP head that mlx-mtp cannot run yet, and what is
# missing (docs/model-families.md, "Not yet supported").
_NO_TRUNK = "needs a trunk mlx-lm 0.32 lacks"
NOT_YET = {
    "inkling": f"{_NO_TRUNK} (relative-bias attention with short convolutions)",
    "mistral_large4": f"{_NO_TRUNK}, and its mtp_dspark head has no reference implementation",
    "hy_v3": _NO_TRUNK,
    "hy_v4": _NO_TRUNK,
    "exaone4_5": _NO_TRUNK,
    "dots3_note": _NO_TRUNK,
    "ernie4_5_moe": "no reference defines its MTP head (transformers ignores the keys)",
    "exaone_moe": "no reference defines its MTP head (transformers ignores the keys)",
    "olmo_hybrid": "no reference defines its MTP head (transformers ignores the keys)",
}


class UnsupportedModelError(ValueError):
    pass


def refuse_not_yet(model_type: str) -> None:
    """Refuse, in one line, a model type in ``NOT_YET`` (or its ``*_text`` config)."""
    reason = NOT_YET.get(str(model_type).removesuffix("_text"))
    if reason is not None and model_type not in MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported by mlx-mtp yet: it {reason}. "
            "See docs/model-families.md.")


def get_model_module(model_type: str):
    refuse_not_yet(model_type)
    name = MODEL_TYPES.get(model_type)
    if name is None:
        supported = ", ".join(sorted(MODEL_TYPES))
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported by mlx-mtp. "
            f"Supported model types: {supported}. Run other models with mlx-lm "
            "(`mlx_lm.generate`, `mlx_lm.server`); see docs/model-families.md."
        )
    return importlib.import_module(f"{__name__}.families.{name}")
