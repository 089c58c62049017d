"""Tiny Ling-3.0 (``bailing_hybrid``) checkpoints in the released Hugging Face layout, for
tests: KDA layers with their three ``{q,k,v}_conv1d`` kernels as (C, 1, K), MLA layers with
the fused ``kv_b_proj`` and ``dense``, per-expert experts, ``mlp.gate.expert_bias``,
``model.word_embeddings``; the MTP layer at ``model.layers.{N}.*`` (``enorm``, ``hnorm``,
``eh_proj``, ``final_layernorm`` around an MLA + MoE block, with a ``word_embeddings`` copy).

Heads as in ``tiny_attention``: ``random``, ``oracle`` (acceptance 100 %), ``noisy``.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .tiny_attention import _unsplit, make_oracle, write_tiny


def bailing_hybrid_config(vocab_size: int = 128, hidden: int = 64, num_layers: int = 4,
                          mtp_layers: int = 1) -> dict:
    """Groups of two layers (KDA, then MLA); a dense first layer, MoE after it."""
    return {"model_type": "bailing_hybrid", "architectures": ["BailingMoeV3ForCausalLM"],
            "vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "moe_intermediate_size": hidden // 2, "moe_shared_expert_intermediate_size": hidden // 2,
            "num_hidden_layers": num_layers, "num_attention_heads": 4, "num_key_value_heads": 4,
            "num_experts": 4, "num_experts_per_tok": 2, "num_shared_experts": 1,
            "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
            "routed_scaling_factor": 2.5, "norm_topk_prob": True, "layer_group_size": 2,
            "head_dim": 16, "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8, "v_head_dim": 16, "short_conv_kernel_size": 4,
            "kda_lower_bound": -5.0, "kda_safe_gate": True, "no_kda_lora": True,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_interleave": True,
            "max_position_embeddings": 4096, "hidden_act": "silu", "tie_word_embeddings": False,
            "num_nextn_predict_layers": mtp_layers,
            # transformers' defaults are the released vocabulary's ids.
            "pad_token_id": 0, "eos_token_id": 1}


def _released(weights: dict, prefix: str) -> None:
    """mlx-lm's stacked experts, split MLA and (C, K, 1) convs under ``prefix`` -> released."""
    _unsplit(weights, prefix, None, attention="attention")
    for c in ("q", "k", "v"):
        key = f"{prefix}attention.{c}_conv1d.weight"
        if key in weights:
            weights[key] = weights[key].moveaxis(2, 1)


def bailing_hybrid_to_hf(model, drop_mtp: bool = False) -> dict:
    flat = dict(tree_flatten(model.parameters()))
    out = {k: v for k, v in flat.items() if not k.startswith("mtp.")}
    for i in range(model.args.num_hidden_layers):
        _released(out, f"model.layers.{i}.")
    if model.num_mtp_layers and not drop_mtp:
        mtp = model.checkpoint_mtp_names({k: v for k, v in flat.items() if k.startswith("mtp.")})
        prefix = model.family.mtp_prefix(model.args, 0)
        _released(mtp, prefix)
        mtp[prefix + "word_embeddings.weight"] = flat["model.word_embeddings.weight"]
        out.update(mtp)
    return out


def bailing_oracle(model, trunk_scale: float, proj_noise: float, seed: int):
    """``make_oracle`` for Bailing's names: MLA's ``dense`` and KDA's ``o_proj`` scaled too."""
    scaled = [(k, v * trunk_scale) for k, v in tree_flatten(model.parameters())
              if k.startswith("model.") and k.endswith("attention.dense.weight")]
    model.load_weights(scaled, strict=False)
    return make_oracle(model, trunk_scale, proj_noise, seed)


def _prepare(model):
    """Routers, router biases and KDA's decay parameters away from mlx-lm's zeros."""
    rng = np.random.default_rng(7)
    updates = []
    for k, v in tree_flatten(model.parameters()):
        if k.endswith(("mlp.gate.weight", "dt_bias")):
            updates.append((k, rng.standard_normal(v.shape)))
        elif k.endswith("expert_bias"):
            updates.append((k, 0.1 * rng.standard_normal(v.shape)))
        elif k.endswith("A_log"):
            updates.append((k, np.log(rng.uniform(1.0, 16.0, v.shape))))
    model.load_weights([(k, mx.array(v, mx.float32)) for k, v in updates], strict=False)


def make_tiny_bailing_hybrid(path, head: str = "random", **kw) -> Path:
    return write_tiny(path, bailing_hybrid_config, bailing_hybrid_to_hf, head, prepare=_prepare,
                      oracle=bailing_oracle, **kw)
