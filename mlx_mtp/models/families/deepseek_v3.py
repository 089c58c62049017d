"""DeepSeek-V3 / V3-0324 / V3.1 / R1 (``model_type: deepseek_v3``), with the MTP layer.

Trunk: mlx-lm's (MLA attention, group-limited sigmoid-routed MoE). The MTP layer is
``model.layers.{num_hidden_layers}.*`` (61), an MLA + MoE block. Released weights are FP8
with 128x128-block ``weight_scale_inv`` (dequantized on load); ``eh_proj`` is bf16.
"""

from mlx_lm.models import deepseek_v3 as lm

from ..blocks.attention_trunk import Family, ModelArgs, nextn_prefix  # noqa: F401
from ..blocks.attention_trunk import Model as _Model
from ..blocks.reference import route_as_reference


class Model(_Model):
    family = Family(lm=lm, trunk_cls=lm.DeepseekV3Model, block=lm.DeepseekV3DecoderLayer,
                    mtp_prefix=nextn_prefix, mla=True)

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        route_as_reference(self, lm.MoEGate)  # groups left out: -inf, as the reference
