"""Layer code the block kinds share: the drafter's transformer shape (``DraftArgs``), attention
whose keys are the cached context plus the block itself (``ContextAttention``), the decoder
layer around it, and the body every DFlash-lineage kind runs (``ContextDrafter``: ``fc`` over
the taps, ``hidden_norm``, the layers, the final ``norm``).

The context is projected once, when rows are emitted (``add_context``): each layer's keys
(normed, roped at their absolute positions) and values go into its ``ContextCache`` (rows of
different lengths, merge/filter/accept like the trunk's caches, whose list it rides at the
end of while decoding). A pass over a block reads them beside the block's own keys/values,
which are never stored, so the cache keeps the context only and a rejected draft leaves
nothing to roll back; a sliding layer's mask limits the context to its window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

from ...models.cache import prepare_chunk
from ...models.cache.context import ContextCache
from .base import BlockDraftModel

if TYPE_CHECKING:
    from .config import DrafterConfig


@dataclass(frozen=True)
class DraftArgs:
    """The drafter's own transformer shape (a Qwen3/Llama backbone in every packaging)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    rope_scaling: Optional[dict] = None
    windows: Tuple[Optional[int], ...] = ()  # per layer: its sliding window (None: full)

    def make_rope(self):
        return initialize_rope(self.head_dim, base=self.rope_theta, traditional=False,
                               scaling_config=self.rope_scaling,
                               max_position_embeddings=self.max_position_embeddings)


def layer_attention(config: "DrafterConfig", i: int) -> Tuple[bool, Optional[int]]:
    """Layer ``i``'s (causal, window): a sliding layer is causal unless the config says
    otherwise (z-lab's rule)."""
    window = config.args.windows[i] if config.args.windows else None
    causal = config.settings.causal
    return (window is not None if causal is None else causal), window


class ContextAttention(nn.Module):
    """Queries from the block; keys/values from [cached context, block]. ``causal``: a block
    row sees the context and the block rows up to itself (else the whole block); ``window``:
    a block row sees the context rows within that many positions (None: all)."""

    def __init__(self, args: DraftArgs, causal: bool = False, window: Optional[int] = None):
        super().__init__()
        dim, hd = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = hd ** -0.5
        self.causal, self.window = causal, window
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.rope = args.make_rope()

    def _heads(self, x: mx.array, n: int) -> mx.array:
        B, L, _ = x.shape
        return x.reshape(B, L, n, -1).transpose(0, 2, 1, 3)

    def _keys_values(self, x: mx.array, offset: mx.array):
        keys = self.rope(self.k_norm(self._heads(self.k_proj(x), self.n_kv_heads)), offset=offset)
        return keys, self._heads(self.v_proj(x), self.n_kv_heads)

    def add_context(self, ctx: mx.array, cache):
        cache.update_and_fetch(*self._keys_values(ctx, cache.offset))

    def __call__(self, x: mx.array, cache: ContextCache) -> mx.array:
        """Each row's block sits right after its own context (rows may differ in length)."""
        B, L, _ = x.shape
        start = cache.positions()
        queries = self.rope(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), offset=start)
        keys, values, mask = cache.attend(*self._keys_values(x, start), self.causal, self.window)
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale,
                                                   mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class ContextLayer(nn.Module):
    """A pre-norm decoder layer over ``ContextAttention``."""

    def __init__(self, config: "DrafterConfig", i: int):
        super().__init__()
        args = config.args
        causal, self.window = layer_attention(config, i)
        self.self_attn = ContextAttention(args, causal, self.window)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class ContextDrafter(BlockDraftModel):
    """The DFlash-lineage body as a drafter: taps -> context (``fc``, ``hidden_norm``) ->
    every layer's cached K/V; a block ``[anchor, mask, ...]`` -> its final-normed hidden
    states. Tensor names are the published ones (``fc``, ``hidden_norm``, ``layers.i.*``,
    ``norm``). The target's embedding and head are bound (``bind``) unless a kind ships its
    own; both are kept out of the drafter's parameters."""

    def __init__(self, config: "DrafterConfig", layers: Sequence[nn.Module]):
        super().__init__()
        args = config.args
        self.spec, self.settings = config.spec, config.settings
        self.fc = nn.Linear(len(self.spec.target_layer_ids) * args.hidden_size,
                            args.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.layers = list(layers)
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self._embed = self._head = None

    def bind(self, embed: Callable[[mx.array], mx.array], head: Callable[[mx.array], mx.array]):
        self._embed, self._head = embed, head
        return self

    def make_cache(self) -> list:
        return [ContextCache.empty(1) for _ in self.layers]

    @property
    def num_caches(self) -> int:
        return len(self.layers)

    def add_context(self, taps: Sequence[mx.array], cache: list, tokens=None, lengths=None):
        ctx = self.hidden_norm(self.fc(mx.concatenate(list(taps), axis=-1)))
        prepare_chunk(cache, ctx.shape[1], lengths)
        for layer, c in zip(self.layers, cache):
            layer.self_attn.add_context(ctx, c)

    def embed(self, tokens: mx.array) -> mx.array:
        return self._embed(tokens) * self.settings.input_embedding_scale

    def check_draft_count(self, n: int):
        if not 0 < n <= self.spec.max_draft:
            raise ValueError(f"{self.spec.kind}: {n} drafts asked of a pass that proposes "
                             f"1..{self.spec.max_draft}")

    def block_hidden(self, anchor: mx.array, width: int, cache: list) -> mx.array:
        """Final-normed hidden states (B, width, H) of the block ``[anchor, mask x (width-1)]``."""
        masks = mx.full((anchor.shape[0], width - 1), self.spec.mask_token_id, anchor.dtype)
        h = self.embed(mx.concatenate([anchor[:, None], masks], axis=1))
        for layer, c in zip(self.layers, cache):
            h = layer(h, c)
        return self.norm(h)


def softcap(logits: mx.array, cap: Optional[float]) -> mx.array:
    return logits if not cap else mx.tanh(logits / cap) * cap


def widen(logits: mx.array, draft_to_target: Optional[mx.array], vocab_size: int) -> mx.array:
    """Draft-vocabulary logits (..., V_draft) as target-vocabulary logits (..., V): the
    tokens a reduced head cannot name get -inf, so q is zero there."""
    if draft_to_target is None:
        return logits
    full = mx.full(logits.shape[:-1] + (vocab_size,), -mx.inf, dtype=logits.dtype)
    full[..., draft_to_target] = logits
    return full
