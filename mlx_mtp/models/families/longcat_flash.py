"""LongCat-Flash (``model_type: longcat_flash``), with its MTP layer.

Trunk: mlx-lm's. Each layer has two MLA attention sublayers (each its own KV cache: the
trunk's cache list holds two per layer, both trimmed) and dense MLPs, plus a shortcut MoE
whose zero-compute experts return their input. MLA's q/kv LoRA outputs are scaled by
sqrt(hidden / rank). As for DeepSeek, a verify pass runs the absorbed formula on every row
(what plain one-token decoding runs), prefill the expanded one.

The MTP layer (``model.mtp.*``, no count key, one layer): ``eh_proj([enorm.m(e) ||
hnorm.m(h)])`` -> one MLA attention + dense MLP block (``layers.0.self_attn``,
``layers.0.transformer_layer.mlp``) -> ``model.mtp.norm`` -> the trunk's ``lm_head``;
``model.mtp.embed_tokens`` is the embedding's copy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import longcat_flash as _lm

from ..blocks.attention_trunk import Family, ModelArgs, attention_mask, mla_attention
from ..blocks.attention_trunk import Model as _Model

PUBLIC = "model.mtp."
RAW_PREFIX = "model.mtp_layers.0."  # internal, while loading (``model.mtp.*`` reads as ``mtp.*``)
# Released names inside the MTP layer -> the block's (mlx-lm) names.
BLOCK_RENAMES = {"transformer_layer.mlp.": "mlp."}


@dataclass
class LmArgs(_lm.ModelArgs):
    @property
    def num_hidden_layers(self) -> int:
        return self.num_layers


class MTPBlock(nn.Module):
    """One MLA attention sublayer and a dense MLP, pre-norm residual."""

    def __init__(self, args, index: int = 0):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.self_attn = _lm.LongcatFlashMLA(args)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.mlp = _lm.LongcatFlashMLP(args, is_expert=False)


def trunk_layer(layer, h, mask, caches, absorbed: bool):
    """mlx-lm's LongCat decoder layer with the shared MLA attention for its two sublayers."""
    shortcut = None
    for i in range(2):
        h = h + mla_attention(layer.self_attn[i], layer.input_layernorm[i](h), mask,
                              caches[i], absorbed)
        x = layer.post_attention_layernorm[i](h)
        if i == 0:
            shortcut = layer.mlp(x)
        h = h + layer.mlps[i](x)
    return h + shortcut


class Model(_Model):
    family = Family(lm=_lm, args_cls=LmArgs, trunk_cls=_lm.LongcatFlashModel, block=MTPBlock,
                    mtp_prefix=lambda args, i: RAW_PREFIX, mla=True,
                    key_map={"enorm.m": "enorm", "hnorm.m": "hnorm", "eh_proj": "eh_proj",
                             "final_norm": "norm"}, duplicates=("embed_tokens.",))

    def __init__(self, args: ModelArgs):
        config = dict(args.config)
        if not any(config.get(k) is not None for k in ("num_nextn_predict_layers",
                                                        "mtp_num_hidden_layers")):
            config["num_nextn_predict_layers"] = 1  # the release ships one, no count key
        super().__init__(ModelArgs(args.model_type, config))

    # --- forward ----------------------------------------------------------
    def trunk_layers(self, inputs, cache=None, capture=False, taps=()):
        h = self.embed(inputs)
        L = h.shape[1]
        cache = cache if cache is not None else [None] * (2 * len(self.model.layers))
        mask = attention_mask(cache[0], L, True)
        tapped = {}
        for i, layer in enumerate(self.model.layers):
            h = trunk_layer(layer, h, mask, cache[2 * i : 2 * i + 2], capture or L == 1)
            if i in taps:
                tapped[i] = h
        return h, tapped

    def make_cache(self):
        return [self.full_attention_cache() for _ in range(2 * len(self.model.layers))]

    def use_kv_quantization(self, quant):
        self.quantize_attention_caches(quant, *self.cached_head_dims())

    # --- weights ----------------------------------------------------------
    def sanitize(self, weights: dict) -> dict:
        out = {}
        for k, v in weights.items():
            if k == PUBLIC + "norm.weight":
                k = RAW_PREFIX + "final_norm.weight"
            elif k.startswith(PUBLIC + "embed_tokens."):
                k = RAW_PREFIX + k[len(PUBLIC):]
            else:
                k = re.sub(r"^model\.mtp\.layers\.0\.", RAW_PREFIX, k)
            out[k] = v
        return super().sanitize(out)

    def mtp_weights(self, raw: Dict[str, mx.array]) -> Dict[str, mx.array]:
        renamed = {}
        for k, v in raw.items():
            for theirs, ours in BLOCK_RENAMES.items():
                k = ours + k[len(theirs):] if k.startswith(theirs) else k
            # mlx-lm splits kv_b_proj for the trunk's two sublayers (``self_attn.{i}``).
            renamed[k.replace("self_attn.", "self_attn.0.", 1)] = v
        out = super().mtp_weights(renamed)
        return {k.replace(".self_attn.0.", ".self_attn.", 1): v for k, v in out.items()}

    def checkpoint_name(self, key: str) -> str:
        name = super().checkpoint_name(key)
        if not name.startswith(RAW_PREFIX):
            return name
        tail = name[len(RAW_PREFIX):]
        if tail.startswith("final_norm."):
            return PUBLIC + "norm." + tail[len("final_norm."):]
        for theirs, ours in BLOCK_RENAMES.items():
            tail = theirs + tail[len(ours):] if tail.startswith(ours) else tail
        return PUBLIC + "layers.0." + tail

    def expected_mtp_keys(self) -> List[str]:
        return [self.checkpoint_name(k) for k in super().expected_mtp_keys()]
