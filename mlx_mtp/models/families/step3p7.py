"""Step-3.7-Flash (``model_type: step3p7``): a vision-language wrapper around Step-3.5's text
model, decoded as text with its three MTP layers.

The config nests the text model under ``text_config`` (its own ``model_type`` is
``step3p5``, in StepFun's legacy field names: ``num_attention_groups``,
``attention_other_setting``, ``moe_layers_enum``, per-layer lists that run on over the MTP
layers); it is unwrapped and built as ``step3p5``. The weights keep Step-3.5's names at the
top level (``model.*``, ``lm_head.*``); the three MTP layers sit flat at
``model.layers.{N..N+2}.*`` (no ``transformer.`` level), one per drafting depth, chained.
Sliding layers, the MTP layers included, take their head counts from
``attention_other_setting`` (mlx-lm's ``Step3p5Attention`` reads it). The vision tower
(``vision_model.*``) and its projector (``vit_large_projector.*``) are dropped with the
other vision-language wrappers' (``layout.VISION_PREFIXES``) before anything reads them, so
they cost neither time nor memory.
"""

from __future__ import annotations

from ..blocks.attention_trunk import ModelArgs
from ..io import layout
from . import step3p5


def text_args(args: ModelArgs) -> ModelArgs:
    """The wrapper's config -> the text model's, with what the loader set on the wrapper
    (tied output layer, MTP count, the hidden fed to the head) carried over."""
    config = args.config
    text = dict(layout.text_config(config), model_type=args.model_type)
    text["tie_word_embeddings"] = layout.tie_word_embeddings(config)
    text["num_nextn_predict_layers"] = layout.config_mtp_layers(config)
    return ModelArgs(args.model_type, text)


class Model(step3p5.Model):
    family = step3p5.Model.family

    def __init__(self, args: ModelArgs):
        super().__init__(text_args(args))

    def checkpoint_name(self, key: str) -> str:
        """Step-3.5's name without its ``transformer.`` level: Step-3.7 stores the block flat."""
        name = super().checkpoint_name(key)
        nested = self.family.mtp_prefix(self.args, 0) + step3p5.BLOCK_LEVEL
        return name.replace(step3p5.BLOCK_LEVEL, "", 1) if name.startswith(nested) else name
