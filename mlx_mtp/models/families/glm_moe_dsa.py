"""GLM-5 / 5.1 / 5.2 (``model_type: glm_moe_dsa``), with its MTP layer: DeepSeek-V3.2's
architecture (DeepSeek sparse attention, see ``deepseek_v32.py``) with GLM's config
(``rope_parameters``); the MTP layer is ``model.layers.{N}.*`` (78 on GLM-5)."""

from mlx_lm.models import deepseek_v32 as _v32
from mlx_lm.models import glm_moe_dsa as _glm

from ..blocks.attention_trunk import Family, ModelArgs, nextn_prefix  # noqa: F401
from .deepseek_v32 import DSAModel


class Model(DSAModel):
    family = Family(lm=_glm, trunk_cls=_v32.DeepseekV32Model, block=_v32.DeepseekV32DecoderLayer,
                    mtp_prefix=nextn_prefix, mla=True)
