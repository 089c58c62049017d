"""EAGLE-3 (speculators ``Eagle3Speculator``; SGLang/EAGLE's legacy ``midlayer.*`` naming): an
autoregressive drafter, one pass per draft.

Its context pairs the projection of a row's three taps, ``fc(taps_t)``, with the token that
*follows* that row, ``x_{t+1}``, at position ``t + 1``: layer 0 attends over
``concat(input_layernorm(embed(x)), hidden_norm(h))`` with its own causal KV cache. The last
emitted row waits (``PendingTap``) until its next token, the anchor, is known. A draft pass
feeds (pending, anchor), then each draft with the layer's own output as ``h``; those entries
are speculative, so ``rollback`` drops them and the next ``add_context`` feeds the verified
rows with their real taps. The head scores a (possibly reduced) draft vocabulary mapped to
target ids by ``d2t`` (target = draft + d2t[draft]); q is zero outside it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3 import MLP

from ...models.cache import prepare_chunk
from ...models.cache.kv import KVCache
from .base import BlockDraftModel, Draw
from .config import DrafterConfig
from .layers import DraftArgs, widen


class PendingTap:
    """The last emitted row's ``fc(taps)`` (B, 1, H), waiting for the token after it."""

    def __init__(self):
        self._hidden: Optional[mx.array] = None

    def put(self, hidden: mx.array):
        self._hidden = hidden

    def get(self) -> Optional[mx.array]:
        return self._hidden


class Eagle3Attention(nn.Module):
    def __init__(self, args: DraftArgs, input_size: int):
        super().__init__()
        hd = args.head_dim
        self.n_heads, self.n_kv_heads, self.scale = (args.num_attention_heads,
                                                     args.num_key_value_heads, hd ** -0.5)
        self.q_proj = nn.Linear(input_size, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(input_size, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(input_size, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, args.hidden_size, bias=False)
        self.rope = args.make_rope()

    def __call__(self, x: mx.array, cache: KVCache) -> mx.array:
        B, L, _ = x.shape
        q, k, v = (p(x).reshape(B, L, n, -1).transpose(0, 2, 1, 3) for p, n in (
            (self.q_proj, self.n_heads), (self.k_proj, self.n_kv_heads),
            (self.v_proj, self.n_kv_heads)))
        position = cache.offset + 1  # entry t pairs tap t with token t + 1
        mask = cache.make_mask(L)
        k, v = cache.update_and_fetch(self.rope(k, offset=position), v)
        out = mx.fast.scaled_dot_product_attention(self.rope(q, offset=position), k, v,
                                                   scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class Eagle3Layer(nn.Module):
    """``first``: layer 0, over [token embedding, tap projection] (2H wide)."""

    def __init__(self, args: DraftArgs, first: bool, norm_before_residual: bool = False):
        super().__init__()
        H, eps = args.hidden_size, args.rms_norm_eps
        self.first, self.norm_before_residual = first, norm_before_residual
        self.input_layernorm = nn.RMSNorm(H, eps=eps)
        if first:
            self.hidden_norm = nn.RMSNorm(H, eps=eps)
        self.self_attn = Eagle3Attention(args, 2 * H if first else H)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=eps)
        self.mlp = MLP(H, args.intermediate_size)

    def __call__(self, h: mx.array, cache: KVCache, embeds: Optional[mx.array] = None):
        if self.first:
            normed = self.hidden_norm(h)
            x = mx.concatenate([self.input_layernorm(embeds), normed], axis=-1)
            residual = normed if self.norm_before_residual else h
        else:
            x, residual = self.input_layernorm(h), h
        h = residual + self.self_attn(x, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3DraftModel(BlockDraftModel):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        args, s = config.args, config.settings
        self.spec, self.settings = config.spec, s
        taps_width = len(self.spec.target_layer_ids) * self.spec.hidden_size  # the trunk's
        if s.norm_before_fc:
            self.input_norm = nn.RMSNorm(taps_width, eps=args.rms_norm_eps)
        self.fc = nn.Linear(taps_width, args.hidden_size, bias=False)
        self.layers = [Eagle3Layer(args, i == 0, s.norm_before_residual)
                       for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if s.own_embed:
            self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        if s.own_head:
            self.lm_head = nn.Linear(args.hidden_size, s.draft_vocab_size or args.vocab_size,
                                     bias=False)
        if s.draft_vocab_size:
            self.d2t = mx.zeros((s.draft_vocab_size,), mx.int32)
        self._embed = self._head = None

    def bind(self, embed, head):
        self._embed, self._head = embed, head
        return self

    def make_cache(self) -> list:
        """One KV cache per layer, then the pending tap."""
        return [KVCache() for _ in self.layers] + [PendingTap()]

    def _forward(self, tokens: mx.array, hidden: mx.array, cache: list) -> mx.array:
        embeds = self.embed_tokens(tokens) if self.settings.own_embed else self._embed(tokens)
        prepare_chunk(cache[:-1], tokens.shape[1])
        h = self.layers[0](hidden, cache[0], embeds)
        for layer, c in zip(self.layers[1:], cache[1:]):
            h = layer(h, c)
        return h

    def _logits(self, h: mx.array) -> mx.array:
        """Target-vocabulary logits of the drafter's outputs ``h``."""
        h = self.norm(h)
        logits = self.lm_head(h) if self.settings.own_head else self._head(h)
        to_target = None
        if self.settings.draft_vocab_size:
            to_target = mx.arange(self.settings.draft_vocab_size, dtype=mx.int32) + self.d2t
        return widen(logits, to_target, self.spec.vocab_size)

    def add_context(self, taps: Sequence[mx.array], cache: list, tokens=None, lengths=None):
        """``tokens`` (B, S): the tokens the trunk read at these rows (their first one follows
        the pending row; the prompt's first has no row before it)."""
        if tokens is None:
            raise ValueError("eagle3: add_context needs the rows' tokens")
        if lengths is not None and set(lengths) != {tokens.shape[1]}:
            raise ValueError("eagle3: a batch's rows must add the same number of rows")
        x = mx.concatenate(list(taps), axis=-1)
        h = self.fc(self.input_norm(x) if self.settings.norm_before_fc else x)
        pending = cache[-1].get()
        if pending is None:
            rows, tokens = h[:, :-1], tokens[:, 1:]
        else:
            rows = mx.concatenate([pending, h[:, :-1]], axis=1)
        if tokens.shape[1]:
            self._forward(tokens, rows, cache)
        cache[-1].put(h[:, -1:])

    def propose(self, anchor: mx.array, cache: list, n: int, draw: Draw):
        h, token, picks, log_qs = cache[-1].get(), anchor, [], []
        for j in range(n):
            h = self._forward(token[:, None], h, cache)
            token, log_q = draw(self._logits(h[:, -1]), j)
            picks.append(token)
            log_qs.append(log_q)
        return mx.stack(picks, axis=1), log_qs

    def rollback(self, cache: list, drafted: int, accepted: Sequence[int]):
        """Every drafted entry goes: the accepted ones come back with their real taps."""
        for c in cache[:-1]:
            c.trim(drafted)

    def sanitize(self, weights: dict) -> dict:
        """Legacy ``midlayer.*`` is ``layers.0.*``; ``t2d`` is implied by ``d2t``; the
        verifier's copies and rotary buffers are not the drafter's."""
        out = {}
        for key, value in weights.items():
            if key == "t2d" or key.startswith("verifier") or "rotary_emb" in key:
                continue
            if key == "embed_tokens.weight" and not self.settings.own_embed:
                continue
            if key.startswith("midlayer."):
                key = "layers.0." + key[len("midlayer."):]
            out[key] = value.astype(mx.int32) if key == "d2t" else value
        return out
