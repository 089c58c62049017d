"""Model families. One module per Hugging Face ``model_type``."""

import importlib

# model_type -> module name. The ``*_text`` names are the nested text configs of
# the multimodal Qwen3.5/3.6 checkpoints, seen when a config is flattened.
MODEL_TYPES = {
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_next": "qwen3_next",
}


class UnsupportedModelError(ValueError):
    pass


def get_model_module(model_type: str):
    name = MODEL_TYPES.get(model_type)
    if name is None:
        supported = ", ".join(sorted(MODEL_TYPES))
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported by mlx-mtp. "
            f"Supported model types: {supported}."
        )
    return importlib.import_module(f"{__name__}.{name}")
