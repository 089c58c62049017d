"""GLM-4.5 / 4.6 / 4.7 and GLM-4.5-Air (``model_type: glm4_moe``), with the MTP layer.

Trunk: mlx-lm's (GQA with qkv bias, partial RoPE, optional qk-norm, sigmoid-routed MoE
with ``e_score_correction_bias`` and a shared expert). The MTP layer sits after the trunk
at ``model.layers.{num_hidden_layers}.*`` (92 on GLM-4.5/4.6, 46 on 4.5-Air) in DeepSeek
naming, with an MoE block.
"""

from mlx_lm.models import glm4_moe as lm

from ..blocks.attention_trunk import Family, ModelArgs, nextn_prefix  # noqa: F401
from ..blocks.attention_trunk import Model as _Model
from ..blocks.reference import route_as_reference


class Model(_Model):
    family = Family(lm=lm, trunk_cls=lm.LanguageModel, block=lm.DecoderLayer,
                    mtp_prefix=nextn_prefix)

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        route_as_reference(self, lm.MoEGate)  # groups left out: -inf, as the reference
