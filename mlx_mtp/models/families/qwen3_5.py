"""Qwen3.5 / Qwen3.6 dense (``model_type: qwen3_5``), with the MTP head.

Hugging Face layout: trunk under ``model.language_model.*`` (vision under
``model.visual.*``: loaded apart, by ``vision.encoder``, only when images are asked for),
head ``lm_head.*``, MTP at top-level ``mtp.*``; config nested under ``text_config`` or
flat. MLX conversions (mlx-lm's layout) use ``language_model.{model,lm_head,mtp}.*``,
which is also our tree.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.nn as nn

from ..blocks import hybrid
from ..blocks.hybrid_model import HybridModel
from ..interface import LanguageModelWrapper
from ..io import layout


@dataclass
class ModelArgs:
    model_type: str
    text_config: dict  # resolved by layout.args_dict (tied head, MTP count, layer types)

    @classmethod
    def from_dict(cls, params: dict):
        return cls(model_type=params["model_type"], text_config=layout.args_dict(params))


class GatedDeltaNet(hybrid.GatedDeltaNetBase):
    def __init__(self, args: hybrid.HybridArgs):
        super().__init__(args)
        H = args.hidden_size
        self.in_proj_qkv = nn.Linear(H, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(H, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(H, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(H, self.num_v_heads, bias=False)

    def project(self, x):
        B, S, _ = x.shape
        z = self.in_proj_z(x).reshape(B, S, self.num_v_heads, self.head_v_dim)
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)


class TextModel(HybridModel):
    linear_cls = GatedDeltaNet


class Model(LanguageModelWrapper):
    def __init__(self, args: ModelArgs):
        super().__init__(args, TextModel(hybrid.HybridArgs.from_dict(args.text_config)))

    @property
    def capabilities(self):
        return replace(self.language_model.capabilities, images=self.image_encoder is not None)

    def trunk_with_images(self, inputs, images, start, cache=None):
        text = self.language_model
        h = images.embed(text.model.embed_tokens(inputs), start)
        positions = images.chunk_positions(start, inputs.shape[1])
        return text.trunk_outputs(text.model(inputs, cache, input_embeddings=h,
                                             positions=positions)[0])

    def sanitize(self, weights: dict):
        text = layout.sanitize_text_weights(self.language_model, layout.text_weight_names(weights))
        return {f"language_model.{k}": v for k, v in text.items()}
