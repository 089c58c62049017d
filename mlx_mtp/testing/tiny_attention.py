"""Tiny attention-trunk checkpoints (GLM-4.x, GLM-4.7-Flash, DeepSeek-V3, MiMo-7B) in the
released Hugging Face layout, for tests: the MTP layer under its original prefix
(``model.layers.{N}.*`` with the duplicate ``embed_tokens`` / ``shared_head.head``, or
``model.mtp_layers.0.*``), per-expert experts, MLA's fused ``kv_b_proj``.

Heads as in ``tiny.py``: ``random``; ``oracle`` (trunk and head follow the cycle
t -> t+1 mod V; sub-layer outputs scaled by ``trunk_scale``); ``noisy`` (oracle plus
noise on ``eh_proj``: partial acceptance).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..convert.checkpoint_io import write_checkpoint
from .tiny import TOKENIZER_DIR

FAMILIES = ("glm4_moe", "glm4_moe_lite", "deepseek_v3", "mimo")
MLA_FAMILIES = ("glm4_moe_lite", "deepseek_v3")


def tiny_config(family: str, vocab_size: int = 128, hidden: int = 64, num_layers: int = 2,
                mtp_layers: int = 1) -> dict:
    cfg = {"model_type": family, "vocab_size": vocab_size, "hidden_size": hidden,
           "intermediate_size": 2 * hidden, "num_hidden_layers": num_layers,
           "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
           "max_position_embeddings": 4096, "rope_theta": 10000.0, "rope_scaling": None,
           "tie_word_embeddings": False, "num_nextn_predict_layers": mtp_layers}
    if family == "mimo":
        return dict(cfg, architectures=["MiMoForCausalLM"])
    # MoE from layer 1 on (the MTP layer too), group-limited sigmoid routing.
    cfg.update(moe_intermediate_size=hidden // 2, n_routed_experts=4, n_shared_experts=1,
               num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5,
               norm_topk_prob=True, first_k_dense_replace=1, moe_layer_freq=1,
               topk_method="noaux_tc", scoring_func="sigmoid", attention_bias=False)
    if family == "glm4_moe":
        return dict(cfg, head_dim=16, use_qk_norm=True, attention_bias=True,
                    partial_rotary_factor=0.5, architectures=["Glm4MoeForCausalLM"])
    cfg.update(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
               qk_nope_head_dim=16, v_head_dim=16)
    arch = "DeepseekV3ForCausalLM" if family == "deepseek_v3" else "Glm4MoeLiteForCausalLM"
    return dict(cfg, architectures=[arch])


def build_model(config: dict, seed: int = 0):
    """Our model (float32) with random weights: norms around 1, routers not all-equal."""
    from ..models import get_model_module

    mx.random.seed(seed)
    module = get_model_module(config["model_type"])
    model = module.Model(module.ModelArgs.from_dict(config))
    rng = np.random.default_rng(seed)
    updates = []
    for k, v in tree_flatten(model.parameters()):
        if k.endswith("norm.weight"):
            updates.append((k, 1 + 0.1 * rng.standard_normal(v.shape)))
        elif "embed_tokens" in k or k.endswith("mlp.gate.weight"):
            updates.append((k, rng.standard_normal(v.shape)))
        elif k.endswith("e_score_correction_bias"):
            # Non-negative: every expert's score plus bias stays above mlx-lm's 0.0 for the
            # groups it leaves out, where it routes as the reference does
            # (docs/model-families.md, "Where we differ from mlx-lm").
            updates.append((k, 0.1 * np.abs(rng.standard_normal(v.shape))))
    model.load_weights([(k, mx.array(v, mx.float32)) for k, v in updates], strict=False)
    mx.eval(model.parameters())
    return model


def make_oracle(model, trunk_scale: float = 0.0, proj_noise: float = 0.0, seed: int = 0):
    """Trunk predicts succ(t) on the cycle t -> t+1, the MTP layer succ(t+1)."""
    rng = np.random.default_rng(seed + 1)
    H = model.args.hidden_size
    scaled = [(k, v * trunk_scale) for k, v in tree_flatten(model.parameters())
              if k.endswith(("o_proj.weight", "down_proj.weight"))]
    model.load_weights(scaled, strict=False)
    emb = np.array(model.model.embed_tokens.weight)
    updates = [("lm_head.weight", np.roll(emb, 1, axis=0) * 4.0)]  # row t+1 = emb(t)
    if model.num_mtp_layers:
        proj = np.zeros((H, 2 * H), np.float32)
        half = slice(H, 2 * H) if model.family.hidden_first else slice(0, H)
        proj[:, half] = np.eye(H)  # pass the embedding of t+1 through
        proj += proj_noise * rng.standard_normal(proj.shape) / np.sqrt(H)
        updates.append(("mtp.layers.0.eh_proj.weight", proj))
        updates += [(f"mtp.layers.0.{n}.weight", np.ones(H)) for n in ("enorm", "hnorm", "norm")]
    model.load_weights([(k, mx.array(v, mx.float32)) for k, v in updates], strict=False)
    mx.eval(model.parameters())
    return model


def _unsplit(weights: dict, prefix: str, args, attention: str = "self_attn") -> None:
    """mlx-lm's experts and MLA split -> the released per-expert / ``kv_b_proj`` form
    (``attention``: the attention module's name under ``prefix``)."""
    for p in ("gate_proj", "up_proj", "down_proj"):
        stacked = weights.pop(f"{prefix}mlp.switch_mlp.{p}.weight", None)
        if stacked is not None:
            for e in range(stacked.shape[0]):
                weights[f"{prefix}mlp.experts.{e}.{p}.weight"] = stacked[e]
    wk = weights.pop(f"{prefix}{attention}.embed_q.weight", None)
    if wk is not None:
        wv = weights.pop(f"{prefix}{attention}.unembed_out.weight")
        kv_b = mx.concatenate([wk.swapaxes(-1, -2), wv], axis=1)  # (heads, nope + v, rank)
        weights[f"{prefix}{attention}.kv_b_proj.weight"] = kv_b.reshape(-1, kv_b.shape[-1])


def to_hf(model, drop_mtp: bool = False) -> dict:
    """The model's weights under the names and in the forms the released checkpoints use."""
    flat = dict(tree_flatten(model.parameters()))
    out = {k: v for k, v in flat.items() if not k.startswith("mtp.")}
    for i in range(model.args.num_hidden_layers):
        _unsplit(out, f"model.layers.{i}.", model.args)
    if model.num_mtp_layers and not drop_mtp:
        mtp = model.checkpoint_mtp_names(
            {k: v for k, v in flat.items() if k.startswith("mtp.")})
        prefix = model.family.mtp_prefix(model.args, 0)
        _unsplit(mtp, prefix, model.args)
        if model.family.duplicates:
            mtp[prefix + "embed_tokens.weight"] = flat["model.embed_tokens.weight"]
            mtp[prefix + "shared_head.head.weight"] = flat["lm_head.weight"]
        out.update(mtp)
    return out


FP8_BLOCK = 128
FP8_MAX = 448.0  # largest e4m3 value


def to_fp8(weights: dict) -> dict:
    """DeepSeek's FP8 release form: projections (not ``eh_proj``, routers, embeddings or
    the output layer) as e4m3 bytes with one ``weight_scale_inv`` per 128x128 block."""
    out = {}
    for k, v in weights.items():
        if not (v.ndim == 2 and k.endswith("proj.weight") and "eh_proj" not in k):
            out[k] = v
            continue
        m, n = v.shape
        bm, bn = -(-m // FP8_BLOCK), -(-n // FP8_BLOCK)
        padded = mx.pad(v, ((0, bm * FP8_BLOCK - m), (0, bn * FP8_BLOCK - n)))
        blocks = padded.reshape(bm, FP8_BLOCK, bn, FP8_BLOCK)
        scale = mx.maximum(mx.abs(blocks).max(axis=(1, 3)), 1e-12) / FP8_MAX
        scaled = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:m, :n]
        out[k], out[k + "_scale_inv"] = mx.to_fp8(scaled), scale
    return out


def make_tiny(path, family: str = "glm4_moe", head: str = "random", **kw) -> Path:
    """Build and save a tiny checkpoint in the released layout; returns its path."""
    return write_tiny(path, lambda **c: tiny_config(family, **c), to_hf, head, **kw)


def write_tiny(path, make_config: Callable[..., dict], to_hf_names: Callable, head: str = "random",
               *, seed: int = 0, trunk_scale: float = 0.1, proj_noise: float = 2.5,
               drop_mtp: bool = False, num_shards: int = 1, dtype=mx.float32, fp8: bool = False,
               prepare: Optional[Callable] = None, oracle: Callable = make_oracle,
               **config_kwargs) -> Path:
    """The one writer of every family's tiny checkpoint: the model of
    ``make_config(**config_kwargs)`` from ``seed`` (``prepare(model)`` first, if given), its
    head (``random``; ``oracle`` / ``noisy``: ``oracle(model, trunk_scale, noise, seed)``),
    its weights under the released names (``to_hf_names(model, drop_mtp)``; ``fp8``: the
    projections in the FP8 release form), saved with the test tokenizer."""
    config = make_config(**config_kwargs)
    model = build_model(config, seed)
    if prepare is not None:
        prepare(model)
    if head in ("oracle", "noisy"):
        oracle(model, trunk_scale, proj_noise if head == "noisy" else 0.0, seed)
    weights = to_hf_names(model, drop_mtp)
    if fp8:
        weights = to_fp8(weights)
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                         "activation_scheme": "dynamic",
                                         "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    return save_tiny(path, weights, config, dtype, num_shards)


def save_tiny(path, weights: dict, config: dict, dtype=mx.float32, num_shards: int = 1) -> Path:
    """Write a tiny checkpoint in the released layout (raw names, the head in the model's
    own shards) with the test tokenizer."""
    tokenizer = TOKENIZER_DIR if TOKENIZER_DIR.is_dir() else None
    write_checkpoint(path, weights, config, dtype=dtype, tokenizer_from=tokenizer,
                     tokenizer_files=tuple(f.name for f in TOKENIZER_DIR.glob("*")),
                     num_shards=num_shards if num_shards > 1 else None, mtp_file=False,
                     fmt="pt")
    return Path(path)
