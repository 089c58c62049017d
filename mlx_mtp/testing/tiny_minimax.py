"""Tiny MiniMax-M3 (``minimax_m3_vl``) checkpoints in the released Hugging Face layout, for
tests: the VLM wrapper config (``text_config`` with the published ``sparse_attention_config``
and ``moe_layer_freq`` spellings), the text model under ``language_model.{model,lm_head}.*``
with per-expert ``block_sparse_moe.experts.{e}.w{1,2,3}``, a few vision and projector
tensors, and (``mtp_tensors=True``) ``mtp.*`` tensors of no published layout. Index blocks
of 4 tokens, 2 kept per query, so short prompts select blocks.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .tiny_attention import write_tiny

EXPERT_NAMES = (("gate_proj", "w1"), ("down_proj", "w2"), ("up_proj", "w3"))
VISION = ("vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
          "multi_modal_projector.linear_1.weight", "patch_merge_mlp.linear_1.weight")
MTP = ("mtp.eh_proj.weight", "mtp.norm.weight")  # placeholders: the release's layout is unknown


def minimax_m3_vl_config(vocab_size: int = 128, hidden: int = 64, num_layers: int = 3) -> dict:
    """Layer 0 dense with full attention, the others MoE with the block-sparse indexer."""
    text = {"model_type": "minimax_m3_vl_text", "vocab_size": vocab_size, "hidden_size": hidden,
            "intermediate_size": hidden // 2, "dense_intermediate_size": 2 * hidden,
            "shared_intermediate_size": hidden // 2, "num_hidden_layers": num_layers,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "rotary_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
            "routed_scaling_factor": 2.0, "rms_norm_eps": 1e-6, "use_qk_norm": True,
            "use_gemma_norm": True, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "partial_rotary_factor": 0.5},
            "max_position_embeddings": 4096, "tie_word_embeddings": False,
            "moe_layer_freq": [0] + [1] * (num_layers - 1),
            "sparse_attention_config": {"sparse_attention_freq": [0] + [1] * (num_layers - 1),
                                        "sparse_num_index_heads": 2, "sparse_index_dim": 16,
                                        "sparse_block_size": 4, "sparse_topk_blocks": 2,
                                        "sparse_local_block": 1}}
    return {"model_type": "minimax_m3_vl",
            "architectures": ["MiniMaxM3SparseForConditionalGeneration"], "text_config": text,
            "vision_config": {"hidden_size": 16, "num_hidden_layers": 1},
            "tie_word_embeddings": False}


def minimax_to_hf(model, mtp_tensors: bool = True) -> dict:
    out = {}
    for k, v in tree_flatten(model.parameters()):
        k = "language_model." + k
        if ".switch_mlp." in k:
            for ours, theirs in EXPERT_NAMES:
                if f".switch_mlp.{ours}." in k:
                    for e in range(v.shape[0]):
                        out[k.replace(f"switch_mlp.{ours}.", f"experts.{e}.{theirs}.")] = v[e]
        else:
            out[k] = v
    rng = np.random.default_rng(5)
    for k in VISION + (MTP if mtp_tensors else ()):
        out[k] = mx.array(rng.standard_normal((8, 8)), mx.float32)
    return out


def _prepare(model):
    """Routers and their biases away from mlx-lm's zeros."""
    rng = np.random.default_rng(7)
    updates = [(k, rng.standard_normal(v.shape) * (0.1 if k.endswith("bias") else 1.0))
               for k, v in tree_flatten(model.parameters())
               if k.endswith(("block_sparse_moe.gate.weight", "e_score_correction_bias"))]
    model.load_weights([(k, mx.array(v, mx.float32)) for k, v in updates], strict=False)


def make_tiny_minimax_m3_vl(path, head: str = "random", *, mtp_tensors: bool = True,
                            **kw) -> Path:
    """``head`` must be ``random``: there is no head to make agree (see the module doc)."""
    return write_tiny(path, minimax_m3_vl_config,
                      lambda model, drop_mtp: minimax_to_hf(model, mtp_tensors and not drop_mtp),
                      head, prepare=_prepare, **kw)
