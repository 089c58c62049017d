"""DSpark (DeepSeek DeepSpec; speculators, SpecForge and LiquidAI packagings): the DFlash body
with its own embedding and head (or the target's), a Markov head and a confidence head.

A pass runs the trained block width ``[anchor, mask x (block_size-1)]`` (the block is
bidirectional, so its width is part of the model) and reads ``n`` slots from slot 0 when the
anchor's slot predicts (DeepSpec, ``spec.anchor_predicts``) or from slot 1 (DFlash-derived
heads). Slot ``j``'s draft is drawn from ``base[j] + w2(w1[prev])`` with ``prev`` the anchor,
then the previous draft: that Markov-corrected distribution is the q rejection sampling uses.
A reduced head scores draft ids; ``d2t`` (offsets: target = draft + d2t[draft]) places them
in the target vocabulary, the rest get q = 0.
"""

from __future__ import annotations

from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from .base import Draw
from .config import DrafterConfig
from .layers import ContextDrafter, ContextLayer, softcap, widen


class MarkovHead(nn.Module):
    """A rank-R bias from the previous token: ``w2(w1[prev])``; ``w1`` is indexed by target
    ids, ``w2`` scores the head's (draft) vocabulary."""

    def __init__(self, vocab_size: int, out_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, out_size, bias=False)

    def __call__(self, prev: mx.array) -> mx.array:
        return self.markov_w2(self.markov_w1(prev))


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)


class DSparkDraftModel(ContextDrafter):
    def __init__(self, config: DrafterConfig):
        args, s = config.args, config.settings
        super().__init__(config, [ContextLayer(config, i) for i in range(args.num_hidden_layers)])
        out_vocab = s.draft_vocab_size or args.vocab_size
        if s.own_embed:
            self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        if s.own_head:
            self.lm_head = nn.Linear(args.hidden_size, out_vocab, bias=False)
        if s.markov_rank:
            self.markov_head = MarkovHead(args.vocab_size, out_vocab, s.markov_rank)
        if s.confidence_head:
            rank = s.markov_rank if s.confidence_with_markov else 0
            self.confidence_head = ConfidenceHead(args.hidden_size + rank)
        if s.draft_vocab_size:
            self.d2t = mx.zeros((s.draft_vocab_size,), mx.int32)

    def _draft_to_target(self) -> Optional[mx.array]:
        if not self.settings.draft_vocab_size:
            return None
        return mx.arange(self.settings.draft_vocab_size, dtype=mx.int32) + self.d2t

    def embed(self, tokens: mx.array) -> mx.array:
        return self.embed_tokens(tokens) if self.settings.own_embed else self._embed(tokens)

    def block_logits(self, anchor: mx.array, cache: list, n: int) -> Tuple[mx.array, mx.array]:
        """The hidden states (B, n, H) and head logits (B, n, V_head) of the ``n`` predicting
        slots, before the Markov bias."""
        self.check_draft_count(n)
        first = 0 if self.spec.anchor_predicts else 1
        hidden = self.block_hidden(anchor, self.spec.block_size, cache)[:, first:first + n]
        head = self.lm_head if self.settings.own_head else self._head
        return hidden, softcap(head(hidden), self.settings.final_logit_softcapping)

    def propose(self, anchor: mx.array, cache: list, n: int, draw: Draw):
        _, logits = self.block_logits(anchor, cache, n)
        to_target = self._draft_to_target()
        prev, picks, log_qs = anchor, [], []
        for j in range(n):
            step = logits[:, j]
            if self.settings.markov_rank:
                step = step + self.markov_head(prev)
            prev, log_q = draw(widen(step, to_target, self.spec.vocab_size), j)
            picks.append(prev)
            log_qs.append(log_q)
        return mx.stack(picks, axis=1), log_qs

    def confidence(self, hidden: mx.array, prev: mx.array) -> mx.array:
        """Per-slot confidence logits (B, n) of the slots ``hidden`` (from ``block_logits``),
        ``prev`` (B, n) the token before each slot's draft. Optional for drafting: a caller
        may stop a block once the product of sigmoids falls below a threshold."""
        if self.settings.confidence_with_markov:
            hidden = mx.concatenate([hidden, self.markov_head.markov_w1(prev)], axis=-1)
        return self.confidence_head.proj(hidden)[..., 0]

    def sanitize(self, weights: dict) -> dict:
        """``t2d`` is implied by ``d2t``; ``d2t`` is an index table (int32); offset norm
        weights (``qwen3_5`` backbones) become plain ones."""
        out = {k: v for k, v in weights.items() if k != "t2d"}
        if "d2t" in out:
            out["d2t"] = out["d2t"].astype(mx.int32)
        if self.settings.offset_norms:
            out = {k: v + 1 if k.endswith("norm.weight") else v for k, v in out.items()}
        return out
