"""GLM-4.7-Flash (``model_type: glm4_moe_lite``, 30B-A3B), with the MTP layer.

Trunk: mlx-lm's (DeepSeek-style MLA attention and MoE). The MTP layer is
``model.layers.{num_hidden_layers}.*`` (47) in DeepSeek naming, an MLA + MoE block.
"""

from mlx_lm.models import glm4_moe_lite as lm

from ..blocks.attention_trunk import Family, ModelArgs, nextn_prefix  # noqa: F401
from ..blocks.attention_trunk import Model as _Model
from ..blocks.reference import route_as_reference


class Model(_Model):
    family = Family(lm=lm, trunk_cls=lm.Glm4MoeLiteModel, block=lm.Glm4MoeLiteDecoderLayer,
                    mtp_prefix=nextn_prefix, mla=True)

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        route_as_reference(self, lm.MoEGate)  # groups left out: -inf, as the reference
