"""Ling-3.0-Flash (``model_type: bailing_hybrid``, ``BailingMoeV3ForCausalLM``): KDA + MLA
hybrid, with its MTP layer.

Trunk: mlx-lm's ``bailing_moe_v3`` module (the one mlx-lm picks for this model_type and
architecture): in each group of ``layer_group_size`` layers the last is MLA with a head-wise
sigmoid output gate (``attention.dense``), the others are KDA (Kimi Delta Attention: three
short depthwise convolutions, a per-channel forget gate bounded by ``kda_lower_bound``, the
gated delta rule); MoE with group-limited sigmoid routing after ``first_k_dense_replace``.

KDA layers keep their three conv windows (concatenated, q | k | v) and the delta-rule state
in ``RecurrentCache``: a verify pass records the pre-verify state and each position's
recurrence inputs, and ``accept`` replays the kept prefix in one call from that state (as
for Gated DeltaNet and Mamba-2). The state stays float32 whatever the weights' dtype. MLA
layers run the absorbed formula on every verify row, as one-token decoding does.

MTP: ``model.layers.{num_hidden_layers}.*`` in DeepSeek naming with SGLang's Bailing names
(``enorm``, ``hnorm``, ``eh_proj``, ``final_layernorm``) around an MLA + MoE block, plus a
copy of ``word_embeddings`` (the trunk's is used).
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import bailing_moe_v3 as lm
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

from ..blocks.attention_trunk import Family, ModelArgs, attention_mask  # noqa: F401
from ..blocks.attention_trunk import Model as _Model
from ..blocks.attention_trunk import mla_heads, mlp_after, mlx_lm_sanitize, nextn_prefix
from ..cache.kv import KVCache
from ..cache.recurrent import RecurrentCache, VerifyRecord

# The tensors around the MTP block, as SGLang's Bailing NextN loader names them -> ours.
MTP_KEYS = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "final_layernorm": "norm"}


class Trunk(lm.BailingModel):
    """mlx-lm's trunk, with the names the engine reads."""

    @property
    def embed_tokens(self):
        return self.word_embeddings


def gated_mla(attn, x, mask, cache, absorbed: bool):
    """mlx-lm's Bailing MLA: each head's output times sigmoid(g_proj(x)), then ``dense``."""
    B, L, _ = x.shape
    out = mla_heads(attn, x, mask, cache, absorbed)
    gate = mx.sigmoid(attn.g_proj(x).astype(mx.float32)).astype(out.dtype)
    return attn.dense((out * gate[..., None]).reshape(B, L, -1))


def kda_recurrence(attn):
    """(q, k, v, raw gate, beta logits, state, mask) -> (y, state): mlx-lm's KDA update."""

    def run(q, k, v, a, b, state, mask=None):
        return gated_delta_update(
            q, k, v, a, b, attn.A_log.reshape(attn.num_heads, 1),
            attn.dt_bias.reshape(attn.num_heads, attn.head_dim), state=state, mask=mask,
            use_kernel=not attn.training, lower_bound=attn.lower_bound)

    return run


def kda(attn, x, cache, capture: bool):
    """mlx-lm's KDA mixer on our cache: one conv window for the three convolutions; a
    verify pass (``capture``) records what replay needs."""
    B, L, _ = x.shape
    P, K = attn.projection_size, attn.conv_kernel_size
    proj = mx.concatenate([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], axis=-1)
    conv_state, state = cache.state if cache is not None else (None, None)
    if conv_state is None:
        conv_state = mx.zeros((B, K - 1, 3 * P), x.dtype)
    conv_input = mx.concatenate([conv_state, proj], axis=1)
    convs = (attn.q_conv1d, attn.k_conv1d, attn.v_conv1d)
    q, k, v = (nn.silu(conv(part)).reshape(B, L, attn.num_heads, attn.head_dim)
               for conv, part in zip(convs, mx.split(conv_input, [P, 2 * P], axis=-1)))
    q, k = normalize_qk(q, k, inv_scale=attn.head_dim**-0.5, eps=1e-6)
    inputs = (q, k, v, attn.f_proj(x).reshape(B, L, attn.num_heads, attn.head_dim),
              attn.b_proj(x).astype(mx.float32))
    recurrence = kda_recurrence(attn)
    out, new_state = recurrence(*inputs, state)
    if cache is not None:
        record = VerifyRecord(conv_input, state, inputs, None, recurrence) if capture else None
        cache.advance(conv_input, new_state, L, record)
    gate = attn.g_proj(x).reshape(B, L, attn.num_heads, attn.head_dim)
    out = attn.o_norm(out) * mx.sigmoid(gate.astype(mx.float32)).astype(out.dtype)
    return attn.o_proj(out.reshape(B, L, -1))


class Model(_Model):
    family = Family(lm=lm, trunk_cls=Trunk, block=lm.BailingDecoderLayer,
                    mtp_prefix=nextn_prefix, key_map=dict(MTP_KEYS),
                    duplicates=("word_embeddings.", "shared_head.head."), mla=True,
                    tied=lambda args: args.tie_word_embeddings)

    # --- forward ----------------------------------------------------------
    def decoder_layer(self, layer, x, mask, cache, absorbed: bool, last_only: bool = False,
                      capture: bool = False):
        """``mlx_lm``'s ``BailingDecoderLayer`` (its MTP block is an MLA layer)."""
        normed = layer.input_layernorm(x)
        if layer.is_linear:
            r = kda(layer.attention, normed, cache, capture)
        else:
            r = gated_mla(layer.attention, normed, mask, cache, absorbed)
        return mlp_after(layer, x, r, last_only)

    def splits_mtp_block(self) -> bool:
        return True  # ``decoder_layer`` runs the MoE on the last row alone when asked

    def trunk_layers(self, inputs, cache=None, capture=False, taps=()):
        """``capture``: a verify pass, whose rows are computed as one-token decoding
        computes them (MLA absorbed; KDA records its replay)."""
        h = self.embed(inputs)
        L = h.shape[1]
        cache = cache if cache is not None else [None] * len(self.model.layers)
        kv = next((c for layer, c in zip(self.model.layers, cache) if not layer.is_linear), None)
        mask = attention_mask(kv, L, True)
        tapped = {}
        for i, (layer, c) in enumerate(zip(self.model.layers, cache)):
            h = self.decoder_layer(layer, h, mask, c, capture or L == 1, capture=capture)
            if i in taps:
                tapped[i] = h
        return h, tapped

    def make_cache(self):
        return [RecurrentCache() if layer.is_linear else KVCache() for layer in self.model.layers]

    @staticmethod
    def cast_predicate(path: str) -> bool:
        """The router bias and KDA's decay parameters stay float32 (as transformers keeps
        them)."""
        return not path.endswith(("expert_bias", "A_log", "dt_bias"))

    # --- weights ----------------------------------------------------------
    def lm_sanitize(self, weights: dict) -> dict:
        """mlx-lm's sanitize, stacking experts in every layer that has them: the MTP block
        is sanitized as layer 0, which ``first_k_dense_replace`` would skip (a dense layer
        has no experts to stack)."""
        return mlx_lm_sanitize(lm.Model, replace(self.args, first_k_dense_replace=0), weights)
