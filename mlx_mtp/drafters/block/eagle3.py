"""EAGLE-3 (speculators ``Eagle3Speculator``; SGLang/EAGLE's legacy ``midlayer.*`` naming): an
autoregressive drafter, one pass per draft.

Its context pairs the projection of a row's three taps, ``fc(taps_t)``, with the token that
*follows* that row, ``x_{t+1}``, at position ``t + 1``: layer 0 attends over
``concat(input_layernorm(embed(x)), hidden_norm(h))``. So layer 0 lags the trunk by one
row: its cache is a ``ContextChainCache`` (``models/cache/context.py``: a ``ChainCache`` over
a ``ContextCache``), whose pending input is the last emitted row's ``fc(taps)``, waiting for
its next token (the anchor). A trunk pass enters every row it ran (``add_context``; a
verify's rows, of which the step's ``accept`` keeps each row's accepted ones and moves the
pending to the last kept row's tap); a draft pass feeds (pending, anchor), then each draft
with the layer's own output as ``h``, reading the cached context beside its own entries,
which are never stored: nothing of a pass needs rolling back, and every row keeps its own
context and length. The head scores a (possibly reduced) draft vocabulary mapped to target
ids by ``d2t`` (target = draft + d2t[draft]); q is zero outside it.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3 import MLP

from ...models.cache import prepare_chunk
from ...models.cache.context import ContextCache, ContextChainCache
from .base import BlockDraftModel, Draw
from .config import DrafterConfig
from .layers import DraftArgs, widen


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

    def _project(self, x: mx.array, position):
        """Queries, keys (roped from ``position``) and values (B, heads, L, D) of ``x``."""
        B, L, _ = x.shape
        q, k, v = (p(x).reshape(B, L, n, -1).transpose(0, 2, 1, 3) for p, n in (
            (self.q_proj, self.n_heads), (self.k_proj, self.n_kv_heads),
            (self.v_proj, self.n_kv_heads)))
        return self.rope(q, offset=position), self.rope(k, offset=position), v

    def _out(self, q, k, v, mask) -> mx.array:
        B, _, L, _ = q.shape
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def __call__(self, x: mx.array, cache) -> mx.array:
        """Context entries (a chunk announced by ``prepare``): stored, causal."""
        q, k, v = self._project(x, cache.offset + 1)  # entry t pairs tap t with token t + 1
        mask = cache.make_mask(x.shape[1])
        return self._out(q, *cache.update_and_fetch(k, v), mask)

    def draft(self, x: mx.array, cache, past: List[tuple]) -> mx.array:
        """Draft pass ``len(past)`` (one entry per row, ``x`` (B, 1, W)): it sees the context
        and the pass's earlier entries (``past``, which it extends), none of them stored."""
        q, k, v = self._project(x, cache.positions() + 1 + len(past))
        past.append((k, v))
        keys, values, mask = cache.attend(mx.concatenate([p[0] for p in past], axis=2),
                                          mx.concatenate([p[1] for p in past], axis=2),
                                          causal=True)
        return self._out(q, keys, values, mask[..., -1:, :])


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

    def __call__(self, h: mx.array, attend: Callable[[Eagle3Attention, mx.array], mx.array],
                 embeds: Optional[mx.array] = None):
        """``attend(self_attn, x)``: the attention's output, over stored or drafted entries."""
        if self.first:
            normed = self.hidden_norm(h)
            x = mx.concatenate([self.input_layernorm(embeds), normed], axis=-1)
            residual = normed if self.norm_before_residual else h
        else:
            x, residual = self.input_layernorm(h), h
        h = residual + attend(self.self_attn, x)
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
        """Layer 0's context behind its pending tap, then each later layer's context."""
        return [ContextChainCache.empty(1)] + [ContextCache.empty(1) for _ in self.layers[1:]]

    @property
    def num_caches(self) -> int:
        return len(self.layers)

    def _run(self, tokens: mx.array, hidden: mx.array,
             attend: Callable[[int, Eagle3Attention, mx.array], mx.array]) -> mx.array:
        """The layers over ``tokens`` (B, L) paired with ``hidden`` (B, L, H); ``attend(i,
        attention, x)`` is layer i's attention output."""
        embeds = self.embed_tokens(tokens) if self.settings.own_embed else self._embed(tokens)
        h = self.layers[0](hidden, partial(attend, 0), embeds)
        for i, layer in enumerate(self.layers[1:], 1):
            h = layer(h, partial(attend, i))
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
        """``tokens`` (B, S): the tokens the trunk read at these rows. Row t's tap waits
        for token t + 1 (the first token pairs with the pending tap; a new row's first has
        none and is a hole); the last row's tap stays pending."""
        if tokens is None:
            raise ValueError("eagle3: add_context needs the rows' tokens")
        x = mx.concatenate(list(taps), axis=-1)
        h = self.fc(self.input_norm(x) if self.settings.norm_before_fc else x)
        B, S, _ = h.shape
        rows, runnable = cache[0].take(h, lengths or [S] * B, verified=True)
        if max(runnable) == 0:
            return
        rows, tokens = cache[0].chunk(rows[:, :-1], tokens, runnable)
        prepare_chunk(cache[1:], S, runnable)
        self._run(tokens, rows, lambda i, attention, x: attention(x, cache[i]))

    def propose(self, anchor: mx.array, cache: list, n: int, draw: Draw):
        """Pass j feeds the newest token with the previous pass's output (pass 0: the
        pending tap and the anchor); every pass's entries stay out of the cache."""
        h = cache[0].pending_rows(anchor.shape[0], self.norm.weight.shape[0],
                                  self.norm.weight.dtype)
        past: List[list] = [[] for _ in self.layers]
        token, picks, log_qs = anchor, [], []
        for j in range(n):
            h = self._run(token[:, None], h,
                          lambda i, attention, x: attention.draft(x, cache[i], past[i]))
            token, log_q = draw(self._logits(h[:, -1]), j)
            picks.append(token)
            log_qs.append(log_q)
        return mx.stack(picks, axis=1), log_qs

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
