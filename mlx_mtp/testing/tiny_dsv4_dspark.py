"""A tiny DeepSeek-V4 checkpoint carrying DSpark stages under ``mtp.<stage>.*`` (the released
layout ``drafters/block/dsv4_dspark.py`` reads): the trunk of ``tiny_streams``'
``deepseek_v4`` and, in the same shards, the stages under DeepSeek's names (``attn.*``,
``attn.kv_norm``, ``ffn.experts.E.w1/w2/w3``, ``hc_attn_fn``, ``hc_head_fn``, ``main_proj``, ``main_norm``,
``norm``), the Markov head and a confidence head in the last stage. Every stage weight is
random (mixers, sinks and routers included) so a parity test exercises them all.
"""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..drafters.block.dsv4_dspark import DeepseekV4DSpark, stage_spec
from ..models.families.deepseek_v4 import ModelArgs
from .tiny_attention import build_model, save_tiny
from .tiny_streams import _hash_routes, _per_expert, deepseek_v4_config, deepseek_v4_to_hf


def dspark_config(taps=(1, 3), block: int = 3, stages: int = 2, noise: int = 5,
                  markov_rank: int = 8, **kw) -> dict:
    config = deepseek_v4_config(**kw)
    config.update(dspark_target_layer_ids=list(taps), dspark_block_size=block,
                  dspark_noise_token_id=noise, dspark_markov_rank=markov_rank,
                  num_nextn_predict_layers=stages)
    return config


def random_stages(config: dict, seed: int = 0) -> DeepseekV4DSpark:
    """The drafter with every weight random (norms around 1, mixers and sinks small)."""
    mx.random.seed(seed)
    drafter = DeepseekV4DSpark(ModelArgs.from_dict(config), stage_spec(config),
                               config["dspark_markov_rank"])
    rng = np.random.default_rng(seed + 1)
    updates = []
    for k, v in tree_flatten(drafter.parameters()):
        if k.endswith("norm.weight"):
            updates.append((k, 1 + 0.1 * rng.standard_normal(v.shape)))
        elif re.search(r"(hc_\w+_(fn|base)|hc_head\.(fn|base)|attn_sink|gate\.bias)$", k):
            updates.append((k, 0.3 * rng.standard_normal(v.shape)))
        elif k.endswith("gate.weight") or "markov_w1" in k:
            updates.append((k, rng.standard_normal(v.shape)))
    drafter.load_weights([(k, mx.array(v, mx.float32)) for k, v in updates], strict=False)
    mx.eval(drafter.parameters())
    return drafter


def stages_to_released(drafter: DeepseekV4DSpark, confidence: bool = True) -> dict:
    """The drafter's tensors under the released ``mtp.<stage>.*`` names."""
    flat = dict(tree_flatten(drafter.parameters()))
    out = {}
    for k in {k.split("switch_mlp.")[0] for k in flat if ".switch_mlp." in k}:
        _per_expert(out, k, flat, names=("w1", "w3", "w2"))
    out.update(flat)
    last = len(drafter.stages) - 1
    released = {}
    for k, v in out.items():
        k = re.sub(r"^stages\.(\d+)\.(block\.)?", r"mtp.\1.", k)
        k = re.sub(r"\.hc_head\.", ".hc_head_", k)
        k = k.replace(".attn.norm.", ".attn.kv_norm.")
        k = re.sub(r"^markov_head\.", f"mtp.{last}.markov_head.", k)
        released[k] = v
    if confidence:
        H, R = drafter.spec.hidden_size, drafter.markov_head.markov_w1.weight.shape[1]
        released[f"mtp.{last}.confidence_head.proj.weight"] = mx.zeros((1, H + R))
        released[f"mtp.{last}.confidence_head.proj.bias"] = mx.zeros((1,))
    return released


def make_tiny_deepseek_v4_dspark(path, seed: int = 0, confidence: bool = True, **kw) -> Path:
    config = dspark_config(**kw)
    model = build_model(config, seed)
    _hash_routes(model)
    weights = deepseek_v4_to_hf(model)
    weights.update(stages_to_released(random_stages(config, seed), confidence))
    return save_tiny(path, weights, config)
