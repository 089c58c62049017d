"""Tiny block drafters in their published layouts, for a tiny trunk (tests only)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

from ..drafters.block.config import parse_block_config
from ..drafters.block.dflash import DFlash


def dflash_config(hidden: int, vocab: int, taps: Sequence[int], num_target_layers: int,
                  block_size: int = 4, num_layers: int = 1, **extra) -> dict:
    """A z-lab DFlash ``config.json`` for a trunk of ``hidden`` and ``vocab``."""
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden,
            "intermediate_size": 2 * hidden, "num_hidden_layers": num_layers,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": hidden // 4,
            "rms_norm_eps": 1e-6, "vocab_size": vocab, "max_position_embeddings": 4096,
            "rope_theta": 10000.0, "tie_word_embeddings": True,
            "num_target_layers": num_target_layers, "block_size": block_size,
            "dflash_config": {"mask_token_id": vocab - 1, "target_layer_ids": list(taps)},
            **extra}


def make_tiny_dflash(path, hidden: int, vocab: int, taps: Sequence[int],
                     num_target_layers: int, seed: int = 0, **kw) -> Path:
    """A random-weight DFlash drafter saved as z-lab ships one (no embedding, no head)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = dflash_config(hidden, vocab, taps, num_target_layers, **kw)
    mx.random.seed(seed)
    weights = {k: mx.random.normal(v.shape) * (0.3 if v.ndim == 2 else 0.1) + (v.ndim == 1)
               for k, v in tree_flatten(DFlash(parse_block_config(config)).parameters())}
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config))
    return path
