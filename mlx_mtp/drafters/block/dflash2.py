"""DFlash2 (z-lab ``DFlash2DraftModel``, incoai/*-DFlash2): the DFlash body with a grouped
dynamic causal convolution (within the block) around each layer's attention and MLP, and a
candidate selector that turns the block's logits into one path.

Selector: the top-k candidates of each position's logits are scored left to right as
``logit + <pred[prev], proj(h), succ[candidate]>`` with ``prev`` the anchor, then the previous
pick; the draft is drawn from those k scores (greedy: their argmax), so q is the softmax over
the k candidates (zero elsewhere) — what rejection sampling needs.
"""

from __future__ import annotations

from typing import List, Tuple

import mlx.core as mx
import mlx.nn as nn

from .base import Draw
from .config import DrafterConfig
from .layers import ContextDrafter, ContextLayer, DraftArgs, softcap


class GroupedDynamicCausalConv(nn.Module):
    """Per group of ``group_size`` channels, a causal convolution over the block's rows whose
    kernel is a learned base plus a kernel predicted from the input row. ``base_kernel[0]``
    and the first half of the predicted kernels act before the wrapped sublayer, the rest
    after it."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def kernels(self, x: mx.array) -> mx.array:
        """(B, L, 2, kernel_size, groups): the predicted kernels, before and after."""
        return self.kernel_projection(x).reshape(*x.shape[:-1], 2, self.kernel_size, self.groups)

    def __call__(self, x: mx.array, kernels: mx.array, stage: int) -> mx.array:
        B, L, H = x.shape
        rows = x.reshape(B, L, self.groups, self.group_size)
        out = mx.zeros_like(rows)
        for shift in range(self.kernel_size):
            past = rows if shift == 0 else mx.concatenate(
                [mx.zeros_like(rows[:, :shift]), rows[:, :-shift]], axis=1)
            base = self.base_kernel[stage, shift].reshape(self.groups, self.group_size)
            out = out + (base + kernels[:, :, stage, shift, :, None]) * past
        return out.reshape(B, L, H)


class DFlash2Layer(ContextLayer):
    def __init__(self, config: DrafterConfig, i: int):
        super().__init__(config, i)
        args, k, g = config.args, config.settings.conv_kernel_size, config.settings.conv_group_size
        self.attention_conv = GroupedDynamicCausalConv(args.hidden_size, k, g)
        self.mlp_conv = GroupedDynamicCausalConv(args.hidden_size, k, g)

    def __call__(self, x: mx.array, cache) -> mx.array:
        h = self.input_layernorm(x)
        kernels = self.attention_conv.kernels(h)
        attn = self.self_attn(self.attention_conv(h, kernels, 0), cache)
        x = x + self.attention_conv(attn, kernels, 1)
        h = self.post_attention_layernorm(x)
        kernels = self.mlp_conv.kernels(h)
        return x + self.mlp_conv(self.mlp(self.mlp_conv(h, kernels, 0)), kernels, 1)


class CandidateSelector(nn.Module):
    def __init__(self, args: DraftArgs, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(args.hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Embedding(args.vocab_size, rank)
        self.successor_codebook = nn.Embedding(args.vocab_size, rank)

    def walk(self, hidden: mx.array, logits: mx.array, anchor: mx.array, draw: Draw
             ) -> Tuple[mx.array, List[mx.array]]:
        candidates = mx.argpartition(logits, -self.top_k, axis=-1)[..., -self.top_k:]
        unary = mx.take_along_axis(logits, candidates, axis=-1)
        projected = self.hidden_projection(hidden)
        empty = mx.full(logits.shape[:1] + logits.shape[2:], -mx.inf, logits.dtype)
        prev, picks, log_qs = anchor, [], []
        for j in range(logits.shape[1]):
            edges = (self.predecessor_codebook(prev)[:, None] * projected[:, j, None]
                     * self.successor_codebook(candidates[:, j])).sum(-1)
            scores = mx.put_along_axis(empty, candidates[:, j], unary[:, j] + edges, axis=-1)
            prev, log_q = draw(scores, j)
            picks.append(prev)
            log_qs.append(log_q)
        return mx.stack(picks, axis=1), log_qs


class DFlash2DraftModel(ContextDrafter):
    def __init__(self, config: DrafterConfig):
        args, s = config.args, config.settings
        super().__init__(config, [DFlash2Layer(config, i) for i in range(args.num_hidden_layers)])
        self.candidate_selector = CandidateSelector(args, s.selector_rank, s.selector_top_k)

    def block_logits(self, anchor: mx.array, cache: list, n: int) -> Tuple[mx.array, mx.array]:
        """The hidden states and logits (B, n, .) of the ``n`` slots after the anchor (the
        block is ``n + 1`` wide, z-lab's runtime block size)."""
        self.check_draft_count(n)
        hidden = self.block_hidden(anchor, n + 1, cache)[:, 1:]
        logits = self._head(hidden) * self.settings.output_multiplier
        return hidden, softcap(logits, self.settings.final_logit_softcapping)

    def propose(self, anchor: mx.array, cache: list, n: int, draw: Draw):
        hidden, logits = self.block_logits(anchor, cache, n)
        return self.candidate_selector.walk(hidden, logits, anchor, draw)

    def sanitize(self, weights: dict) -> dict:
        """The codebooks are stored without ``.weight``."""
        out = dict(weights)
        for name in ("predecessor_codebook", "successor_codebook"):
            key = f"candidate_selector.{name}"
            if key in out:
                out[f"{key}.weight"] = out.pop(key)
        return out
