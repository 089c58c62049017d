"""Tiny checkpoints of the newer families whose trunk mlx-lm has, in the released layout, for
tests. ``step3p7``: Step-3.5's text model nested under ``text_config`` of a vision-language
config (StepFun's legacy field names), three MTP layers stored flat at
``model.layers.{N..N+2}.*`` (sliding attention, ``attention_other_setting``'s head count),
a small vision tower and projector under their released names. ``mellum``: sliding and full
attention layers, per-expert MoE, the MTP layer under ``mtp.*`` (``fc``, ``pre_fc_norm_*``,
``norm``, the block at ``mtp.layers.0.*``).

Heads as in ``tiny_attention``: ``random``, ``oracle`` (acceptance 100 % at every depth),
``noisy`` (partial acceptance).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .tiny_attention import _unsplit, write_tiny
from .tiny_special import WINDOW, chained_oracle, step3p5_config, step3p5_to_hf

# The vision side as released: dropped on load, its names only matter.
VISION_SHAPES = {"vision_model.conv1.weight": (16, 3, 14, 14),
                 "vision_model.transformer.resblocks.0.attn.in_proj_weight": (48, 16),
                 "vit_large_projector.weight": (64, 64)}


def step3p7_config(vocab_size: int = 128, hidden: int = 64, num_layers: int = 3,
                   window: int = WINDOW) -> dict:
    """Sliding layers with more query heads than full ones (the same key/value groups, as
    released), the MTP layers' entries after the trunk's in every per-layer list."""
    text = step3p5_config(vocab_size, hidden, num_layers, mtp_layers=3, window=window)
    text.pop("architectures")
    text["attention_other_setting"] = {"num_attention_heads": 6, "num_attention_groups": 2}
    text["partial_rotary_factors"] = [0.5, 1.0] * num_layers + [1.0] * 3
    text["moe_layers_enum"] = ",".join(str(i) for i in range(1, num_layers))  # MTP: dense
    return {"model_type": "step3p7", "architectures": ["Step3p7ForConditionalGeneration"],
            "text_config": text, "tie_word_embeddings": False,
            "vision_config": {"width": 16, "layers": 1, "heads": 2, "image_size": 56,
                              "patch_size": 14}}


def step3p7_to_hf(model, drop_mtp: bool = False) -> dict:
    out = step3p5_to_hf(model, drop_mtp)
    out.update({k: mx.random.normal(shape) for k, shape in VISION_SHAPES.items()})
    return out


def make_tiny_step3p7(path, head: str = "random", *, broken: tuple = (), **kw) -> Path:
    return write_tiny(path, step3p7_config, step3p7_to_hf, head, oracle=chained_oracle(broken),
                      **kw)


def mellum_config(vocab_size: int = 128, hidden: int = 64, num_layers: int = 3,
                  window: int = WINDOW) -> dict:
    return {"model_type": "mellum", "architectures": ["MellumForCausalLM"],
            "vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "num_hidden_layers": num_layers, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 4096, "sliding_window": window,
            "layer_types": (["sliding_attention", "full_attention"] * num_layers)[:num_layers],
            "mlp_layer_types": ["sparse"] * num_layers,
            "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 20000.0},
                                "sliding_attention": {"rope_type": "default",
                                                      "rope_theta": 10000.0}},
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": hidden // 2,
            "norm_topk_prob": True, "num_nextn_predict_layers": 1,
            "mtp_layer_types": ["sliding_attention"], "mtp_mlp_layer_types": ["sparse"],
            "tie_word_embeddings": False}


def mellum_to_hf(model, drop_mtp: bool = False) -> dict:
    """Per-expert experts in the trunk and in the MTP block, the head under ``mtp.*``."""
    flat = dict(tree_flatten(model.parameters()))
    out = {k: v for k, v in flat.items() if not k.startswith("mtp.")}
    for i in range(model.args.num_hidden_layers):
        _unsplit(out, f"model.layers.{i}.", model.args)
    if model.num_mtp_layers and not drop_mtp:
        mtp = model.checkpoint_mtp_names({k: v for k, v in flat.items() if k.startswith("mtp.")})
        _unsplit(mtp, "mtp.layers.0.", model.args)
        out.update(mtp)
    return out


def make_tiny_mellum(path, head: str = "random", **kw) -> Path:
    return write_tiny(path, mellum_config, mellum_to_hf, head, **kw)
