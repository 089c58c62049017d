"""The models ``mlx-mtp train`` builds and the losses it minimises.

Scratch mode: next-token cross-entropy plus the MTP loss (predict t+2 from the trunk's
post-norm hidden at t and token t+1). Head mode: the head fitted to the frozen model's own
next-token distribution one position later (self-distillation).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .data import ENDOFTEXT_ID, FAMILY, IM_END_ID, _user_error

# Model sizes (text_config fields). "demo" is the shipped model.
SIZES: Dict[str, dict] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16),
    "small": dict(hidden_size=192, num_hidden_layers=8, intermediate_size=512,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=48,
                  linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=48, linear_value_head_dim=48),
    # The shipped demo model (MODEL_CARD.md): 12 layers, 9 Gated DeltaNet + 3 gated attention
    # (3:1), + 1 MTP layer; 18.5M parameters, 37 MB in bfloat16. One MTP layer is a small
    # fraction of a 12-layer trunk, so drafting is cheap relative to a decode step.
    "demo": dict(hidden_size=384, num_hidden_layers=12, intermediate_size=768,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=64, linear_value_head_dim=64),
    # The first demo model (4 layers, 5.5M parameters, float32).
    "demo-v1": dict(hidden_size=256, num_hidden_layers=4, intermediate_size=768,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=64, linear_value_head_dim=64),
    "base": dict(hidden_size=256, num_hidden_layers=8, intermediate_size=768,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=64, linear_value_head_dim=64),
}


# --------------------------------------------------------------------------
# Model config and construction
# --------------------------------------------------------------------------


def text_config(size: str = "demo", vocab_size: int = 4096, mtp_layers: int = 1,
                **overrides) -> dict:
    """A Qwen3.5 ``text_config`` (3 Gated DeltaNet : 1 attention, tied embeddings)."""
    if size not in SIZES:
        raise _user_error(f"--size must be one of {', '.join(SIZES)} (got {size!r})")
    cfg = {
        "model_type": f"{FAMILY}_text",
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 32768,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "hidden_act": "silu",
        "mtp_num_hidden_layers": mtp_layers,
        "mtp_use_dedicated_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0,
                            "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                            "mrope_interleaved": True},
        "eos_token_id": IM_END_ID,
        "pad_token_id": ENDOFTEXT_ID,
    }
    cfg.update(SIZES[size])
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    hd = cfg["head_dim"]
    cfg["rope_parameters"]["mrope_section"] = _mrope_section(int(hd * 0.25) // 2)
    return cfg


def _mrope_section(half_rot: int) -> List[int]:
    a = -(-half_rot * 11 // 32)
    b = a
    return [a, b, max(0, half_rot - a - b)]


def build_scratch_model(text: dict, seed: int = 0):
    from ..models import get_model_module
    from ..models.io.layout import hf_config

    mx.random.seed(seed)
    module = get_model_module(FAMILY)
    model = module.Model(module.ModelArgs.from_dict(hf_config(FAMILY, text)))
    # Scale residual-branch output projections down with depth (GPT-2 style).
    n = text["num_hidden_layers"] + text.get("mtp_num_hidden_layers", 0)
    scale = 1.0 / math.sqrt(2 * n)
    ups = [(k, v * scale) for k, v in tree_flatten(model.parameters())
           if k.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight"))]
    model.load_weights(ups, strict=False)
    mx.eval(model.parameters())
    return model


def count_params(module) -> int:
    return sum(v.size for _, v in tree_flatten(module.parameters()))


# --------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------


def _mean_ce(logits, targets, weights, hard=None, hard_weight: float = 1.0):
    ce = nn.losses.cross_entropy(logits.astype(mx.float32), targets)
    if weights is None:
        return ce.mean()
    if hard is not None:
        from .hardmine import hard_weights

        weights = hard_weights(logits, targets, weights, hard, hard_weight)
    return (ce * weights).sum() / mx.maximum(weights.sum(), 1e-6)


def _tail(a: Optional[mx.array], start: int) -> Optional[mx.array]:
    return None if a is None else a[:, start:]


def scratch_losses(model, batch: mx.array, weights: Optional[mx.array] = None,
                   hard: Optional[mx.array] = None, hard_weight: float = 1.0):
    """(trunk CE, MTP CE) for a (B, L+1) batch: the mean over predicted tokens, or with
    ``weights`` (B, L+1; each token's weight as a target) the weighted mean; with ``hard``
    (B, L+1) flagged targets each loss misses at top-1 weigh ``hard_weight`` times more."""
    text = model.text
    inputs, targets = batch[:, :-1], batch[:, 1:]
    hidden, h_mtp = text.trunk(inputs)
    ce = _mean_ce(text.logits(hidden), targets, _tail(weights, 1), _tail(hard, 1), hard_weight)
    if text.num_mtp_layers == 0:
        return ce, mx.array(0.0)
    # Pair (h_t, token t+1) predicts token t+2.
    m = text.mtp_forward(h_mtp[:, :-1], inputs[:, 1:], None)
    mtp_ce = _mean_ce(text.logits(m), batch[:, 2:], _tail(weights, 2), _tail(hard, 2),
                      hard_weight)
    return ce, mtp_ce


def head_targets(model, batch: mx.array, temperature: float = 1.0):
    """Frozen trunk pass: (MTP input hidden, log-probs the head must match, hard targets)."""
    text = model.text
    hidden, h_mtp = text.trunk(batch)
    logits = text.logits(hidden).astype(mx.float32)
    # Head at t (pair h_t, token t+1) predicts t+2: the trunk's own distribution at t+1.
    target_lp = nn.log_softmax(logits[:, 1:] / temperature, axis=-1)
    return mx.stop_gradient(h_mtp[:, :-1]), mx.stop_gradient(target_lp)


def head_loss(model, h, next_tokens, target_lp):
    """Soft cross-entropy of the head against the trunk's distribution, and the KL."""
    text = model.text
    lp = nn.log_softmax(text.logits(text.mtp_forward(h, next_tokens, None)).astype(mx.float32), -1)
    p = mx.exp(target_lp)
    soft_ce = -(p * lp).sum(-1).mean()
    ent = -(p * target_lp).sum(-1).mean()
    return soft_ce, soft_ce - ent
