"""z-lab DFlash: a small Qwen3 stack that drafts a whole block in one pass.

``ctx = hidden_norm(fc(concat(taps)))`` is projected by each layer's ``k_proj``/``v_proj``
(``k_norm``, RoPE at the rows' absolute positions) into the context cache once. A pass
embeds ``[anchor, mask x (block_size - 1)]`` with the target's embedding, runs every layer
over the context plus the block (bidirectional; causal where the config says so, and a
sliding layer sees the context within its window), and the target's head turns slots
1.. into the drafts' logits. The block is always the trained width: a shorter draft takes
the first positions of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

from ...models.cache.context import ContextCache
from .base import BlockDraftModel, BlockSpec, Draw

ARCHITECTURE = "DFlashDraftModel"
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class DFlashArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    layer_types: Tuple[str, ...]
    rope_scaling: Optional[dict] = None
    sliding_window: Optional[int] = None
    is_causal: Optional[bool] = None  # None: sliding layers causal, full ones not (z-lab)
    final_logit_softcapping: Optional[float] = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0

    def causal(self, layer: int) -> bool:
        sliding = self.layer_types[layer] == "sliding_attention"
        return sliding if self.is_causal is None else self.is_causal

    def window(self, layer: int) -> Optional[int]:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None


def parse_config(cfg: Dict[str, Any]) -> Tuple[DFlashArgs, BlockSpec]:
    """A z-lab DFlash ``config.json`` as our args and spec; ValueError names what is wrong
    (``block_size`` top level or in ``dflash_config``, which holds the mask token and the
    tapped layers)."""
    dflash = cfg.get("dflash_config")
    if not isinstance(dflash, dict) or "target_layer_ids" not in dflash \
            or "mask_token_id" not in dflash:
        raise ValueError("a DFlash config needs dflash_config.{target_layer_ids,mask_token_id}")
    L = int(cfg["num_hidden_layers"])
    layer_types = tuple(cfg.get("layer_types") or ("full_attention",) * L)
    if len(layer_types) != L or set(layer_types) - set(LAYER_TYPES):
        raise ValueError(f"DFlash layer_types {list(layer_types)} must be {L} of {LAYER_TYPES}")
    if "sliding_attention" in layer_types and not cfg.get("sliding_window"):
        raise ValueError("DFlash sliding_attention layers need sliding_window")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    cap = dflash.get("final_logit_softcapping", cfg.get("final_logit_softcapping"))
    args = DFlashArgs(
        hidden_size=int(cfg["hidden_size"]), num_hidden_layers=L,
        num_attention_heads=int(cfg["num_attention_heads"]),
        num_key_value_heads=int(cfg["num_key_value_heads"]),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]),
        intermediate_size=int(cfg["intermediate_size"]), rms_norm_eps=float(cfg["rms_norm_eps"]),
        rope_theta=float(cfg.get("rope_theta", (rope or {}).get("rope_theta", 10000.0))),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        layer_types=layer_types, rope_scaling=rope, sliding_window=cfg.get("sliding_window"),
        is_causal=cfg.get("is_causal"), final_logit_softcapping=cap,
        input_embedding_scale=float(dflash.get("input_embedding_scale", 1.0)),
        output_multiplier=float(dflash.get("output_multiplier", 1.0)))
    spec = BlockSpec(
        kind="dflash", hidden_size=args.hidden_size, vocab_size=int(cfg["vocab_size"]),
        target_layer_ids=tuple(int(i) for i in dflash["target_layer_ids"]),
        block_size=int(dflash.get("block_size", cfg.get("block_size", 16))),
        mask_token_id=int(dflash["mask_token_id"]),
        num_target_layers=cfg.get("num_target_layers"))
    if spec.block_size < 2 or not spec.target_layer_ids:
        raise ValueError("a DFlash drafter needs block_size >= 2 and at least one tapped layer")
    return args, spec


class DFlashAttention(nn.Module):
    def __init__(self, args: DFlashArgs, layer: int):
        super().__init__()
        H, hd = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = hd ** -0.5
        self.causal, self.window = args.causal(layer), args.window(layer)
        self.q_proj = nn.Linear(H, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(H, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, H, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)

    def _heads(self, x, n: int):
        B, L, _ = x.shape
        return x.reshape(B, L, n, -1).transpose(0, 2, 1, 3)

    def keys_values(self, x, rope, offset):
        """K/V (B, H_kv, L, D) of ``x`` at positions ``offset`` (B,) onwards."""
        k = rope(self.k_norm(self._heads(self.k_proj(x), self.n_kv_heads)), offset=offset)
        return k, self._heads(self.v_proj(x), self.n_kv_heads)

    def add_context(self, ctx, rope, cache: ContextCache):
        cache.prepare(ctx.shape[1])
        cache.update_and_fetch(*self.keys_values(ctx, rope, cache.positions()))

    def __call__(self, x, rope, cache: ContextCache):
        B, L, _ = x.shape
        start = cache.positions()
        q = rope(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), offset=start)
        keys, values, mask = cache.attend(*self.keys_values(x, rope, start), self.causal,
                                          self.window)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DFlashLayer(nn.Module):
    def __init__(self, args: DFlashArgs, layer: int):
        super().__init__()
        self.self_attn = DFlashAttention(args, layer)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x, rope, cache):
        h = x + self.self_attn(self.input_layernorm(x), rope, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlash(BlockDraftModel):
    """The z-lab DFlash drafter (``DFlashDraftModel`` checkpoints)."""

    def __init__(self, args: DFlashArgs, spec: BlockSpec):
        super().__init__()
        self.args, self.spec = args, spec
        H = args.hidden_size
        self.fc = nn.Linear(len(spec.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.layers = [DFlashLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.rope = initialize_rope(args.head_dim, base=args.rope_theta, traditional=False,
                                    scaling_config=args.rope_scaling,
                                    max_position_embeddings=args.max_position_embeddings)
        self._embed = self._head = None  # the target's: bound, not the drafter's parameters

    @classmethod
    def from_config(cls, cfg: Dict[str, Any]) -> "DFlash":
        return cls(*parse_config(cfg))

    def bind(self, embed, head):
        self._embed, self._head = embed, head

    def make_cache(self) -> list:
        return [ContextCache.empty(1) for _ in self.layers]

    def add_context(self, taps: Sequence[mx.array], cache: list):
        ctx = self.hidden_norm(self.fc(mx.concatenate(list(taps), axis=-1)))
        for layer, c in zip(self.layers, cache):
            layer.self_attn.add_context(ctx, self.rope, c)

    def block_logits(self, anchor: mx.array, cache: list) -> mx.array:
        """Logits (B, block_size - 1, V) of the slots after ``anchor`` (B,)."""
        B, n = anchor.shape[0], self.spec.block_size - 1
        mask = mx.full((B, n), self.spec.mask_token_id, anchor.dtype)
        h = self._embed(mx.concatenate([anchor[:, None], mask], axis=1))
        h = h * self.args.input_embedding_scale
        for layer, c in zip(self.layers, cache):
            h = layer(h, self.rope, c)
        logits = self._head(self.norm(h[:, 1:])) * self.args.output_multiplier
        cap = self.args.final_logit_softcapping
        return mx.tanh(logits / cap) * cap if cap else logits

    def propose(self, anchor: mx.array, cache: list, n: int, draw: Draw):
        logits = self.block_logits(anchor, cache)
        picks, log_qs = [], []
        for j in range(n):  # one pass drafted every slot: each draw reads its own logits
            pick, lq = draw(logits[:, j], j)
            picks.append(pick)
            log_qs.append(lq)
        return mx.stack(picks, axis=1), log_qs

    def rollback(self, cache: list, drafted: int, accepted: Sequence[int]):
        pass
