"""Mellum2 (``model_type: mellum``), with its MTP layer.

Trunk: mlx-lm's (GQA with q/k norms, full-attention layers interleaved with sliding-window
ones, each kind with its own RoPE base, softmax-routed MoE in every layer). Window layers
keep their keys in ``WindowKVCache`` (mlx-lm's rotating cache cannot roll back once it has
wrapped).

The release ships one MTP layer under ``mtp.*``, laid out as Qwen3-Next's head:
``fc([pre_fc_norm_embedding(e) || pre_fc_norm_hidden(h)])`` -> the decoder block at
``mtp.layers.0.*`` (sliding-window attention, MoE with per-expert tensors, as the trunk's)
-> ``norm`` -> the trunk's ``lm_head``. Plain norms (x * w). While loading, the released
names move under ``model.mtp_layers.0.`` (``mtp.layers.0.*`` reads as our own converted
names otherwise); they are written back under their released names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import List, Optional

from mlx_lm.models import mellum as lm

from ..blocks.attention_trunk import Family, ModelArgs  # noqa: F401
from ..blocks.attention_trunk import Model as _Model
from ..blocks.windowed import WindowedTrunk

PUBLIC_PREFIX = "mtp."
PUBLIC_BLOCK = "mtp.layers.0."
RAW_PREFIX = "model.mtp_layers."  # where the released tensors sit while loading
HEAD_KEYS = {"pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm", "fc": "eh_proj",
             "norm": "norm"}
# A released tensor: a head tensor, or a block tensor (ours are ``mtp.layers.0.{block,...}``).
RELEASED = re.compile(r"^mtp\.(?:(?:%s)\.|layers\.0\.(?!(?:block|enorm|hnorm|eh_proj|norm)\.))"
                      % "|".join(HEAD_KEYS))


@dataclass
class LmArgs(lm.ModelArgs):
    mtp_layer_types: Optional[List[str]] = None  # transformers' default: sliding attention

    @classmethod
    def from_dict(cls, params: dict):
        """Also a config transformers wrote: it names the expert count ``num_local_experts``."""
        if "num_experts" not in params and "num_local_experts" in params:
            params = dict(params, num_experts=params["num_local_experts"])
        return super().from_dict(params)


class Trunk(lm.MellumModel):
    """mlx-lm's trunk, each layer marked with its kind (mlx-lm reads it from the config)."""

    def __init__(self, args: LmArgs):
        super().__init__(args)
        for layer, kind in zip(self.layers, args.layer_types):
            layer.is_sliding = kind == "sliding_attention"


def mtp_block(args: LmArgs, index: int):
    """The MTP layer's block: attention of its own kind (window, RoPE base), MoE."""
    kind = (args.mtp_layer_types or ["sliding_attention"])[0]
    layer = lm.MellumDecoderLayer(replace(args, layer_types=list(args.layer_types[:index])
                                          + [kind]), index)
    layer.is_sliding = kind == "sliding_attention"
    return layer


def raw_name(key: str) -> str:
    """A released MTP tensor's name -> ``model.mtp_layers.0.<tail>``; other keys unchanged."""
    if not RELEASED.match(key):
        return key
    tail = key[len(PUBLIC_BLOCK):] if key.startswith(PUBLIC_BLOCK) else key[len(PUBLIC_PREFIX):]
    return f"{RAW_PREFIX}0.{tail}"


def released_name(raw: str) -> str:
    """``model.mtp_layers.0.<tail>`` -> the release's name of the tensor."""
    tail = raw[len(RAW_PREFIX) + len("0."):]
    head = tail.split(".", 1)[0]
    return (PUBLIC_PREFIX if head in HEAD_KEYS else PUBLIC_BLOCK) + tail


class Model(WindowedTrunk, _Model):
    family = Family(lm=lm, args_cls=LmArgs, trunk_cls=Trunk, block=mtp_block,
                    mtp_prefix=lambda args, i: f"{RAW_PREFIX}{i}.", key_map=dict(HEAD_KEYS),
                    duplicates=())

    @property
    def window(self) -> int:
        return self.args.sliding_window

    @staticmethod
    def is_sliding(layer) -> bool:
        return layer.is_sliding

    # --- weights ----------------------------------------------------------
    def sanitize(self, weights: dict) -> dict:
        return super().sanitize({raw_name(k): v for k, v in weights.items()})

    def checkpoint_name(self, key: str) -> str:
        name = super().checkpoint_name(key)
        return released_name(name) if name.startswith(RAW_PREFIX) else name

    def expected_mtp_keys(self) -> List[str]:
        return [released_name(k) for k in super().expected_mtp_keys()]
