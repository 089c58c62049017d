"""Attention trunks that interleave full-attention and sliding-window layers (Step-3.5,
MiMo-V2-Flash): mlx-lm's loop with one mask per kind of layer, window layers (and a
windowed MTP layer) in ``WindowKVCache`` so they roll back after wrapping."""

from __future__ import annotations

from mlx_lm.models.base import create_attention_mask

from ..cache.kv import KVCache
from ..cache.window import WindowKVCache


class WindowedTrunk:
    """Mixin for ``attention_trunk.TextModel``: set ``window`` and ``is_sliding``."""

    @property
    def window(self) -> int:
        raise NotImplementedError

    @staticmethod
    def is_sliding(layer) -> bool:
        raise NotImplementedError

    def trunk_layers(self, inputs, cache=None, capture=False, taps=()):
        h = self.embed(inputs)
        layers = self.model.layers
        cache = cache if cache is not None else [None] * len(layers)
        masks, tapped = {}, {}
        for i, (layer, c) in enumerate(zip(layers, cache)):
            sliding = self.is_sliding(layer)
            if sliding not in masks:
                masks[sliding] = create_attention_mask(
                    h, c, window_size=self.window if sliding else None)
            h = layer(h, masks[sliding], c)
            if i in taps:
                tapped[i] = h
        return h, tapped

    def attention_cache(self, layer, quantized: bool = False):
        """``quantized``: a full-attention layer's cache follows ``--kv-bits``."""
        if self.is_sliding(layer):
            return WindowKVCache(self.window)
        return self.full_attention_cache() if quantized else KVCache()

    def make_cache(self):
        return [self.attention_cache(layer, quantized=True) for layer in self.model.layers]

    def use_kv_quantization(self, quant):
        """The full-attention layers only: a window layer holds at most window + rollback
        margin positions and stays in full precision, as do the chained MTP layers' caches
        (``make_mtp_cache``); attention sinks have no quantized attention in mlx-lm."""
        args = self.args
        if quant is not None and getattr(args, "add_full_attention_sink_bias", False):
            raise ValueError(f"--kv-bits is not available for {self.model_type}: its "
                             "full-attention layers have attention sinks")
        dims = (args.head_dim, getattr(args, "v_head_dim", args.head_dim))
        self.quantize_attention_caches(quant, *dims)

    def make_mtp_cache(self):
        if not self.num_mtp_layers:
            return []
        return [self.attention_cache(layer.block) for layer in self.mtp.layers]
