"""MiMo-V2-Flash (``model_type: mimo_v2_flash``), with its MTP layers.

Trunk: mlx-lm's (sliding-window layers with an attention-sink bias interleaved with
full-attention ones, sigmoid-routed MoE). Window layers keep their keys in
``WindowKVCache`` (mlx-lm's rotating cache cannot roll back once wrapped) and attend to
``sliding_window_size + 1`` keys, as the reference does (mlx-lm: ``sliding_window_size``).

The release ships three MTP layers at ``model.mtp.layers.{0,1,2}.*`` and no count key:
``eh_proj([enorm(e) || hnorm(h)])`` -> a sliding-window decoder block with sink bias and
a dense MLP (its second norm is ``pre_mlp_layernorm``) -> ``final_layernorm`` -> the
trunk's ``lm_head``. Drafting depth j runs layer j (``mtp_chain.ChainedMTP``: each layer
keeps its own window cache, caught up on committed positions); deeper drafts reuse the last.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List

import mlx.core as mx
from mlx_lm.models import mimo_v2_flash as _lm

from ..blocks.attention_trunk import Family, ModelArgs  # noqa: F401
from ..blocks.attention_trunk import Model as _Model
from ..blocks.mtp_chain import ChainedMTP
from ..blocks.reference import route_as_reference
from ..blocks.windowed import WindowedTrunk

RELEASED_LAYERS = 3  # MTP layers the release ships (its config has no count key)
PUBLIC_PREFIX = "model.mtp.layers."
# Internal name of the raw layers while loading: ``model.mtp.*`` would be read as ``mtp.*``.
RAW_PREFIX = "model.mtp_layers."
BLOCK_RENAMES = {"pre_mlp_layernorm.": "post_attention_layernorm."}  # theirs -> mlx-lm's


@dataclass
class LmArgs(_lm.ModelArgs):
    @property
    def rms_norm_eps(self) -> float:  # what the MTP layer's norms read
        return self.layernorm_epsilon


def mtp_block(args, index: int):
    return _lm.DecoderLayer(args, is_moe=False, is_sliding_window=True)


class Model(ChainedMTP, WindowedTrunk, _Model):
    family = Family(lm=_lm, args_cls=LmArgs, trunk_cls=_lm.LanguageModel, block=mtp_block,
                    mtp_prefix=lambda args, i: f"{RAW_PREFIX}{i}.",
                    key_map={"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj",
                             "final_layernorm": "norm"}, duplicates=())

    def __init__(self, args: ModelArgs):
        config = dict(args.config)
        if not any(config.get(k) is not None for k in ("num_nextn_predict_layers",
                                                        "mtp_num_hidden_layers")):
            config["num_nextn_predict_layers"] = RELEASED_LAYERS
        super().__init__(ModelArgs(args.model_type, config))
        route_as_reference(self, _lm.MoEGate)  # groups left out: -inf, as the reference

    @property
    def window(self) -> int:
        # Keys a window layer attends to: the W before the query and the query itself, as
        # the reference (SGLang; transformers' ``sliding_window = sliding_window_size + 1``)
        # does. mlx-lm attends to W.
        return self.args.sliding_window_size + 1

    @staticmethod
    def is_sliding(layer) -> bool:
        return layer.is_sliding_window

    # --- weights ----------------------------------------------------------
    def released_prefix(self, i: int) -> str:
        return f"{PUBLIC_PREFIX}{i}."

    def sanitize(self, weights: dict) -> dict:
        pattern = re.compile(r"^model\.mtp\.layers\.(\d+)\.")
        return super().sanitize({pattern.sub(lambda m: f"{RAW_PREFIX}{m.group(1)}.", k): v
                                 for k, v in weights.items()})

    def mtp_weights(self, raw: Dict[str, mx.array]) -> Dict[str, mx.array]:
        renamed = {}
        for k, v in raw.items():
            for theirs, ours in BLOCK_RENAMES.items():
                k = ours + k[len(theirs):] if k.startswith(theirs) else k
            renamed[k] = v
        return super().mtp_weights(renamed)

    def checkpoint_name(self, key: str) -> str:
        name = super().checkpoint_name(key)
        if not name.startswith(RAW_PREFIX):
            return name
        name = PUBLIC_PREFIX + name[len(RAW_PREFIX):]
        for theirs, ours in BLOCK_RENAMES.items():
            name = name.replace("." + ours, "." + theirs)
        return name

    def expected_mtp_keys(self) -> List[str]:
        return [self.checkpoint_name(k) for k in super().expected_mtp_keys()]
