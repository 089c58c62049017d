"""MiMo-7B (``model_type: mimo``), with its MTP layer.

Trunk: mlx-lm's (Qwen2 blocks with qkv bias). The MTP layer is ``model.mtp_layers.0.*``:
``input_proj([hidden_layernorm(h) || token_layernorm(e)])`` (hidden first) -> a dense
Qwen2 block -> ``final_layernorm`` -> the trunk's ``lm_head``. No embedding/head copies.
"""

from mlx_lm.models import mimo as lm

from ..blocks.attention_trunk import Family, ModelArgs  # noqa: F401
from ..blocks.attention_trunk import Model as _Model

MIMO_KEYS = {"token_layernorm": "enorm", "hidden_layernorm": "hnorm", "input_proj": "eh_proj",
             "final_layernorm": "norm"}


class Model(_Model):
    family = Family(lm=lm, trunk_cls=lm.MiMoModel,
                    block=lambda args, index: lm.TransformerBlock(args),
                    mtp_prefix=lambda args, i: f"model.mtp_layers.{i}.",
                    key_map=MIMO_KEYS, duplicates=(), hidden_first=True,
                    tied=lambda args: args.tie_word_embeddings)
