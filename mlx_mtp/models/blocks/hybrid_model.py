"""The Qwen hybrid model (Qwen3.5/3.6 dense and MoE, Qwen3-Next): the ``hybrid`` trunk,
the output layer and the MTP head, behind the engine's ``MTPModel`` interface."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..cache.kv import cache_state_arrays
from ..cache.recurrent import RecurrentCache
from ..interface import Capabilities, MTPModel
from .hybrid import MAX_COMPILED_TOKENS, HybridArgs, MTPHead, Trunk
from .hybrid_shard import read_share, shard_layer


class HybridModel(MTPModel):
    """Trunk + lm_head + optional MTP head."""

    linear_cls = None  # set by the family module

    @property
    def capabilities(self) -> Capabilities:
        expert = ("expert",) if self.args.num_experts > 0 else ()  # blocks/expert_split.py
        return Capabilities(compilable=True, splits=("pipeline", "tensor") + expert)

    def __init__(self, args: HybridArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.mtp_hidden = args.mtp_hidden
        self.model = Trunk(args, self.linear_cls)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.mtp_num_hidden_layers > 0:
            self.mtp = MTPHead(args)
        self.compiled_max_k = 0  # set_compiled: the largest K traced for
        self.compiled_traced = 0  # set_compiled: the longest step traced

    def trunk_layers(self, inputs, cache=None, capture=False, taps=()):
        return self.model(None, cache, capture, input_embeddings=self.embed(inputs), taps=taps)

    def shard(self, group):
        for layer in list(self.model.layers) + (list(self.mtp.layers) if "mtp" in self else []):
            shard_layer(layer, group)
            read_share(layer)  # read and slice one layer at a time

    def set_compiled(self, on: bool, max_k: Optional[int] = None):
        """Run Gated DeltaNet layers' decode steps as compiled graphs, traced here for
        plain steps and verify passes up to ``max_k`` drafts (batch of one), so a change
        of K never traces mid-decode. ``max_k`` None: the largest K given before (a
        caller switching off and on again, e.g. the bench's graph probe, keeps every K
        traced); already traced lengths are not traced again."""
        was_on = self.compiled
        self.compiled_max_k = max(max_k or 0, self.compiled_max_k)
        for layer in self.model.layers:
            layer.set_compiled(on)
        if on:
            first = self.compiled_traced + 1 if was_on else 1
            self.compiled_traced = min(self.compiled_max_k + 1, MAX_COMPILED_TOKENS)
            for T in range(first, self.compiled_traced + 1):
                cache = self.make_cache()
                self.trunk(mx.zeros((1, 1), mx.int32), cache)  # a state to step from
                h, _ = self.trunk(mx.zeros((1, T), mx.int32), cache, capture=T > 1)
                mx.eval(h, cache_state_arrays(cache))

    @property
    def compiled(self) -> bool:
        return any(layer.compiled_steps is not None for layer in self.model.layers)

    def mtp_forward(self, hidden, next_tokens, mtp_cache, depth: int = 0,
                    last_only: bool = False):
        """hidden (B,S,H) at positions i, next_tokens (B,S) = t_{i+1}; ``depth``: the
        draft's depth (0: the trunk's hiddens; families with one MTP layer ignore it).

        Returns the head's post-norm output (B,S,H): ``logits()`` of it predicts
        t_{i+2}, and it is the hidden to chain the next draft on. ``last_only``: (B,1,H),
        the last row's (the caches get every row's entries as without it); the earlier
        rows skip the MLP / MoE and the norm after attention.
        """
        return self.mtp(hidden, self.model.embed_tokens(next_tokens), mtp_cache, last_only)

    def make_cache(self):
        return [RecurrentCache() if l.is_linear else self.full_attention_cache()
                for l in self.model.layers]

    def use_kv_quantization(self, quant):
        self.quantize_attention_caches(quant, self.args.head_dim)
