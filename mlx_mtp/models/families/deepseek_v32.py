"""DeepSeek-V3.2 (``model_type: deepseek_v32``), with its MTP layer.

Trunk: mlx-lm's (MLA with DeepSeek sparse attention, MoE). Two caches per attention layer
(latents, indexer keys), both trimmed on rollback; verify passes select and attend as plain
one-token decoding does (``dsa.py``); with ``--kv-bits`` both caches are quantized and every
pass is ours (``dsa.py``). The MTP layer is ``model.layers.{N}.*`` in DeepSeek
naming (61 on V3.2) with its own indexer; FP8 releases are dequantized.
"""

import mlx.core as mx
from mlx_lm.models import deepseek_v32 as lm

from ..blocks.attention_trunk import (  # noqa: F401
    Family, ModelArgs, attention_mask, mlp_after, nextn_prefix)
from ..blocks.attention_trunk import Model as _Model
from ..blocks.reference import route_as_reference
from ..cache.index import IndexKeyCache, QuantizedIndexKeyCache
from ..cache.kv import KVCache
from ..cache.quantized import QuantizedKVCache
from ..blocks.dsa import prompt_attention, verify_attention


def dsa_caches(quant=None):
    """A DSA attention layer's caches: its MLA latents and its indexer's keys (``quant``:
    both quantized, ``--kv-bits``)."""
    if quant is not None:
        return QuantizedKVCache(quant), QuantizedIndexKeyCache(quant)
    return KVCache(), IndexKeyCache()


class DSAModel(_Model):
    """The DSA families' forward and caches (``family`` names mlx-lm's classes; GLM-5 builds
    DeepSeek-V3.2's modules, so its gates too are ``lm.MoEGate``)."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        route_as_reference(self, lm.MoEGate)  # groups left out: -inf, as the reference

    def trunk_layers(self, inputs, cache=None, capture=False, taps=()):
        h = self.embed(inputs)
        L = h.shape[1]
        cache = cache if cache is not None else self.make_cache()
        mask = attention_mask(cache[0], L, True)
        tapped = {}
        for i, layer in enumerate(self.model.layers):
            caches = (cache[2 * i], cache[2 * i + 1])
            h = self.decoder_layer(layer, h, mask, caches, capture and L > 1)
            if i in taps:
                tapped[i] = h
        return h, tapped

    def decoder_layer(self, layer, x, mask, caches, verify: bool):
        if self.kv_quantization is not None:  # mlx-lm's DSA layers read no quantized cache
            return self.quantized_layer(layer, x, mask, caches, verify or x.shape[1] == 1)
        if not verify:
            return layer(x, mask, caches)  # mlx-lm's own (one token: its gather path)
        return mlp_after(layer, x, verify_attention(layer.self_attn, layer.input_layernorm(x),
                                                    mask, caches))

    def mtp_forward(self, hidden, next_tokens, mtp_cache, depth: int = 0,
                    last_only: bool = False):
        layer = self.mtp.layers[0]
        e = layer.enorm(self.model.embed_tokens(next_tokens))
        x = layer.eh_proj(mx.concatenate([e, layer.hnorm(hidden)], axis=-1))
        caches = tuple(mtp_cache) if mtp_cache else self.dsa_caches()
        mask = attention_mask(caches[0], x.shape[1], True)
        if self.kv_quantization is not None:  # as mlx-lm's layer: several rows, sparse mask
            return layer.norm(self.quantized_layer(layer.block, x, mask, caches,
                                                   x.shape[1] == 1, last_only))
        if not last_only:
            return layer.norm(layer.block(x, mask, caches))
        block = layer.block  # the MLP on the last row only; every row fills the caches
        r = block.self_attn(block.input_layernorm(x), mask, caches)
        return layer.norm(mlp_after(block, x, r, last_only=True))

    def quantized_layer(self, layer, x, mask, caches, decoding: bool, last_only: bool = False):
        """A decoder layer over quantized caches: ``decoding`` rows (one token, a verify) each
        as a one-token step, other rows by the multi-token formula."""
        attend = verify_attention if decoding else prompt_attention
        return mlp_after(layer, x, attend(layer.self_attn, layer.input_layernorm(x), mask, caches),
                         last_only)

    def dsa_caches(self):
        return dsa_caches(self.kv_quantization)

    def make_cache(self):
        return [c for _ in self.model.layers for c in self.dsa_caches()]

    def use_kv_quantization(self, quant):
        """The MLA latents (latent and RoPE part) and the indexer's keys, all quantized."""
        self.quantize_attention_caches(quant, *self.cached_head_dims(), self.args.index_head_dim)

    @property
    def num_mtp_caches(self) -> int:
        return 2 if self.num_mtp_layers else 0  # latents, indexer keys

    def make_mtp_cache(self):
        return list(self.dsa_caches()) if self.num_mtp_layers else []


class Model(DSAModel):
    family = Family(lm=lm, trunk_cls=lm.DeepseekV32Model, block=lm.DeepseekV32DecoderLayer,
                    mtp_prefix=nextn_prefix, mla=True)
