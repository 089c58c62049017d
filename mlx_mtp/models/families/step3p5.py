"""Step-3.5-Flash / Step-3.7-Flash (``model_type: step3p5``), with the MTP layer.

Trunk: mlx-lm's (GQA with zero-centred q/k norms and a head-wise sigmoid gate, MoE with
a shared expert, full-attention layers interleaved with sliding-window ones). The
sliding-window layers (and the MTP layer, a sliding-attention layer) keep their keys in
``WindowKVCache``: mlx-lm's rotating cache cannot be rolled back once it has wrapped.

The MTP layers follow the trunk at ``model.layers.{N+i}.*`` (45-47 on Step-3.5-Flash):
``enorm`` / ``hnorm`` / ``eh_proj`` / ``shared_head.{norm,output}`` around a dense decoder
block stored under ``transformer.`` (some exports leave that level out). Every norm in the
released checkpoint is zero-centred (applied as ``1 + w``, Gemma-style); mlx-lm adds the 1
to the trunk's norms in its sanitize, we add it to the MTP layer's, and take it off again
when writing the layer back under its checkpoint names. As the reference does, ``1 + w`` is
formed and kept in float32 (``ExactNorm``, output in the input's dtype): mlx-lm adds the 1
in the stored bfloat16, rounding every norm weight (logits ~5e-3 off, greedy text apart
within a few dozen tokens). ``shared_head.output`` is the output layer's copy (the trunk's
``lm_head`` is used, as for DeepSeek's ``shared_head.head``). Drafting depth j runs MTP
layer j (``mtp_chain.ChainedMTP``), as vLLM does for Step.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import step3p5 as lm

from ..blocks.attention_trunk import NEXTN_DUPLICATES, NEXTN_KEYS, Family, ModelArgs  # noqa: F401
from ..blocks.attention_trunk import Model as _Model
from ..blocks.attention_trunk import nextn_prefix
from ..blocks.mtp_chain import ChainedMTP
from ..blocks.reference import replace_modules
from ..blocks.windowed import WindowedTrunk

BLOCK_LEVEL = "transformer."  # the released layout's extra level around the MTP block


def mtp_block(args, index: int):
    """The MTP layer's decoder block; per-layer lists in the config may stop at the trunk."""
    types = list(args.layer_types or [])
    if types and len(types) <= index:
        types += ["sliding_attention"] * (index + 1 - len(types))
    theta = args.rope_theta
    if isinstance(theta, list) and len(theta) <= index:
        theta = theta + [theta[-1]] * (index + 1 - len(theta))
    return lm.Step3p5DecoderLayer(replace(args, layer_types=types or None, rope_theta=theta),
                                  index)


def zero_centred(key: str) -> bool:
    return key.endswith("norm.weight")


class ExactNorm(lm.ZeroCenteredRMSNorm):
    """The reference's norm (transformers' ``Step3p7RMSNorm``): the weight ``1 + w`` held in
    float32, the output in the input's dtype."""

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.weight, self.eps).astype(x.dtype)


class Model(ChainedMTP, WindowedTrunk, _Model):
    family = Family(lm=lm, trunk_cls=lm.Step3p5Model, block=mtp_block, mtp_prefix=nextn_prefix,
                    key_map=dict(NEXTN_KEYS),
                    duplicates=NEXTN_DUPLICATES + ("shared_head.output.",))

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        # Every norm, the trunk's and the MTP layers'.
        replace_modules(self, (lm.ZeroCenteredRMSNorm, nn.RMSNorm),
                        lambda m: ExactNorm(m.weight.shape[0], m.eps))

    @property
    def window(self) -> int:
        return self.args.sliding_window

    @staticmethod
    def is_sliding(layer) -> bool:
        return layer.is_sliding

    @staticmethod
    def cast_predicate(path: str) -> bool:
        return "router_bias" not in path  # mlx-lm keeps it in float32

    # --- weights ----------------------------------------------------------
    def lm_sanitize(self, weights: dict) -> dict:
        """mlx-lm's sanitize, adding the 1 to released zero-centred norms in float32."""
        return super().lm_sanitize({k: v.astype(mx.float32) if zero_centred(k) else v
                                    for k, v in weights.items()})

    def mtp_weights(self, raw: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Released MTP tensors (zero-centred norms, block under ``transformer.``) -> ours."""
        block_moe = any(".moe." in k or "share_expert." in k for k in raw)
        plain = {}
        for k, v in raw.items():
            is_block = k.startswith(BLOCK_LEVEL) or not k.startswith(
                tuple(self.family.key_map) + self.family.duplicates)
            k = k[len(BLOCK_LEVEL):] if k.startswith(BLOCK_LEVEL) else k
            # mlx-lm's sanitize adds the 1 itself to an MoE block in released form.
            if zero_centred(k):
                v = v.astype(mx.float32)
                v = v if is_block and block_moe else v + 1
            plain[k] = v
        return super().mtp_weights(plain)

    def checkpoint_name(self, key: str) -> str:
        name = super().checkpoint_name(key)
        if key.startswith("mtp.layers.0.block."):
            prefix = self.family.mtp_prefix(self.args, 0)
            name = prefix + BLOCK_LEVEL + name[len(prefix):]
        return name

    def checkpoint_mtp_names(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Our MTP tensors under the released names and in the released (zero-centred) form."""
        return {self.checkpoint_name(k): (v - 1 if k.startswith("mtp.") and zero_centred(k)
                                          else v)
                for k, v in weights.items()}
