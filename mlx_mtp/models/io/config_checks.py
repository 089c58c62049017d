"""What a config.json must say before anything is built from it.

``check_config``: the shape of the JSON (``text_config`` an object, ``model_type`` a string,
the counts and sizes the families read whole numbers in range). ``check_fits_weights``: the
layer, vocabulary and expert counts no larger than the weight files can hold, so a damaged
count (``num_hidden_layers: 10**12``) is refused at once instead of building for minutes.
Both raise ``ModelLoadError`` (CLI: one line, exit 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from ...errors import ModelLoadError
from .layout import MTP_LAYER_COUNT_KEYS, config_mtp_layers, text_config

# Whole-number fields the families read -> least allowed value. MLX array dimensions are
# int32, so every one is at most MAX_DIMENSION. ``head_dim`` may be 0: GLM-5.3-Flash's config
# (NoPE MLA) writes its RoPE width there.
COUNT_FIELDS = {
    "vocab_size": 1, "hidden_size": 1, "num_hidden_layers": 1, "num_attention_heads": 1,
    "num_key_value_heads": 1, "head_dim": 0, "intermediate_size": 0,
    "moe_intermediate_size": 0, "shared_expert_intermediate_size": 0, "num_experts": 0,
    "n_routed_experts": 0, "num_experts_per_tok": 0, "linear_num_value_heads": 1,
    "linear_num_key_heads": 1, "linear_key_head_dim": 1, "linear_value_head_dim": 1,
    "linear_conv_kernel_dim": 1, **{k: 0 for k in MTP_LAYER_COUNT_KEYS},
}
MAX_DIMENSION = 2**31 - 1


def _check_counts(section: dict, where) -> None:
    for key, least in COUNT_FIELDS.items():
        value = section.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise ModelLoadError(f"{where}: {key} must be a whole number (got {value!r}).")
        if not least <= value <= MAX_DIMENSION:
            raise ModelLoadError(f"{where}: {key} must be between {least} and {MAX_DIMENSION} "
                                 f"(got {value}); the config is damaged.")


def check_config(config: dict, where) -> None:
    """Refuse a config whose fields have the wrong JSON types or impossible values."""
    if "text_config" in config and not isinstance(config["text_config"], dict):
        raise ModelLoadError(f"{where}: text_config must be a JSON object (got "
                             f"{type(config['text_config']).__name__}); the config is damaged.")
    text = text_config(config)
    for section in (config, text):
        model_type = section.get("model_type")
        if model_type is not None and not isinstance(model_type, str):
            raise ModelLoadError(f"{where}: model_type must be a string (got {model_type!r}).")
        if not isinstance(section.get("layer_types", []), list):
            raise ModelLoadError(f"{where}: layer_types must be a list.")
        _check_counts(section, where)


def check_fits_weights(config: dict, files: Iterable[Path], where) -> None:
    """Refuse counts the weight files cannot hold: every layer (trunk and MTP) and expert
    stores at least ``hidden_size`` values, the embedding ``vocab_size`` rows of them, at
    no less than one bit each (the most compact quantization stores more)."""
    text = text_config(config)
    hidden = text.get("hidden_size") or 1
    stored_bits = 8 * sum(f.stat().st_size for f in files)
    experts = max(text.get("num_experts") or 0, text.get("n_routed_experts") or 0)
    for what, count in (("layers", (text.get("num_hidden_layers") or 0)
                         + config_mtp_layers(config)),
                        ("vocabulary entries", text.get("vocab_size") or 0),
                        ("experts per layer", experts)):
        if count * hidden > stored_bits:
            raise ModelLoadError(
                f"{where} declares {count} {what} of hidden size {hidden}, more than the "
                f"weight files ({stored_bits / 8e6:.1f} MB) can hold: the config is damaged "
                "or belongs to another checkpoint.")
