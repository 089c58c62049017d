"""Qwen3-Next (``model_type: qwen3_next``), with the MTP head.

Differences from Qwen3.5: fused Gated DeltaNet projections (``in_proj_qkvz``,
``in_proj_ba``, grouped per key head), per-expert MoE weights, optional dense
``mlp_only_layers``, a flat config, and no MTP count in config.json (one layer,
as vLLM assumes; the count fields of ``layout.MTP_LAYER_COUNT_KEYS`` override it).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..blocks import hybrid
from ..blocks.hybrid_model import HybridModel
from ..io import layout


class ModelArgs(hybrid.HybridArgs):
    @classmethod
    def from_dict(cls, params: dict):
        return super().from_dict(layout.args_dict(params))


class GatedDeltaNet(hybrid.GatedDeltaNetBase):
    def __init__(self, args: hybrid.HybridArgs):
        super().__init__(args)
        H = args.hidden_size
        self.in_proj_qkvz = nn.Linear(H, self.key_dim * 2 + self.value_dim * 2, bias=False)
        self.in_proj_ba = nn.Linear(H, self.num_v_heads * 2, bias=False)

    def project(self, x):
        B, S, _ = x.shape
        nk, dk, nv, dv = self.num_k_heads, self.head_k_dim, self.num_v_heads, self.head_v_dim
        # Projections are grouped per key head: [q | k | v... | z...] for each group.
        qkvz = self.in_proj_qkvz(x).reshape(B, S, nk, -1)
        ba = self.in_proj_ba(x).reshape(B, S, nk, -1)
        q, k, v, z = mx.split(qkvz, [dk, 2 * dk, 2 * dk + nv // nk * dv], axis=-1)
        b, a = mx.split(ba, [nv // nk], axis=-1)
        qkv = mx.concatenate(
            [q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1
        )
        return qkv, z.reshape(B, S, nv, dv), b.reshape(B, S, nv), a.reshape(B, S, nv)


class Model(HybridModel):
    linear_cls = GatedDeltaNet

    def sanitize(self, weights: dict):
        return layout.sanitize_text_weights(self, layout.text_weight_names(weights))
