"""Tiny block drafters in their published layouts, for a tiny trunk (tests only)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

from ..drafters.block import KINDS
from ..drafters.block.config import parse_block_config

BODY_KINDS = ("dflash", "dflash2", "dspark")  # the DFlash-lineage kinds


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


def block_config(kind: str, hidden: int, vocab: int, taps: Sequence[int],
                 num_target_layers: int, **kw) -> dict:
    """``kind``'s ``config.json`` in its published layout: z-lab's for DFlash and DFlash2
    (a kernel-2 convolution, a top-4 selector), DeepSpec's for DSpark (a rank-8 Markov head,
    no confidence head, every slot predicting)."""
    config = dflash_config(hidden, vocab, taps, num_target_layers, **kw)
    if kind == "dflash2":
        config.update(architectures=["DFlash2DraftModel"], is_causal=False)
        config["dflash_config"].update(conv_kernel_size=2, conv_group_size=hidden // 4,
                                       selector_rank=8, selector_top_k=4)
    elif kind == "dspark":
        zlab = config.pop("dflash_config")
        config.update(architectures=["Qwen3DSparkModel"], tie_word_embeddings=False,
                      markov_rank=8, enable_confidence_head=False, **zlab)
    return config


def eagle3_config(hidden: int, vocab: int, taps: Sequence[int], block_size: int = 4,
                  num_layers: int = 1, draft_vocab_size: int = None,
                  norm_before_residual: bool = False, **layer) -> dict:
    """A speculators EAGLE-3 ``config.json`` drafting ``block_size - 1`` tokens: its layer
    ids count the embedding output as 0 (transformers' ``hidden_states`` index), so the
    residual after trunk layer ``i`` (``taps``, 0-based) is id ``i + 1``; ``layer``
    overrides the backbone's fields."""
    backbone = {"model_type": "llama", "hidden_size": hidden, "intermediate_size": 2 * hidden,
                "num_hidden_layers": num_layers, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": hidden // 4, "vocab_size": vocab,
                "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
                **layer}
    return {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
            "transformer_layer_config": backbone, "draft_vocab_size": draft_vocab_size or vocab,
            "target_hidden_size": hidden, "norm_before_residual": norm_before_residual,
            "tie_word_embeddings": draft_vocab_size is None,
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in taps],
            "speculators_config": {"algorithm": "eagle3", "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": block_size - 1}],
                "default_proposal_method": "greedy", "verifier": {"name_or_path": "tiny"}}}


def make_tiny_block(path, kind: str, hidden: int, vocab: int, taps: Sequence[int],
                    num_target_layers: int, seed: int = 0, own_embed_head: bool = True,
                    **kw) -> Path:
    """A random-weight ``kind`` drafter saved as its packaging ships one (the DFlash kinds
    without an embedding and head; DSpark with its own unless ``own_embed_head`` is off;
    EAGLE-3 with the target's embedding, and its own head over a random ``d2t`` subset of
    the vocabulary when ``draft_vocab_size`` is given, else the target's)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = (eagle3_config(hidden, vocab, taps, **kw) if kind == "eagle3"
              else block_config(kind, hidden, vocab, taps, num_target_layers, **kw))
    mx.random.seed(seed)
    params = tree_flatten(KINDS[kind](parse_block_config(config)).parameters())
    weights = {k.replace("codebook.weight", "codebook"):  # DFlash2's published names
               mx.random.normal(v.shape) * (0.3 if v.ndim == 2 else 0.1) + (v.ndim == 1)
               for k, v in params if k != "d2t"
               and (own_embed_head or k not in ("embed_tokens.weight", "lm_head.weight"))}
    if kind == "eagle3" and config["draft_vocab_size"] < vocab:  # target = draft + d2t[draft]
        size = config["draft_vocab_size"]
        ids = mx.sort(mx.random.permutation(vocab)[:size])
        weights["d2t"] = (ids - mx.arange(size)).astype(mx.int64)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config))
    return path


def make_tiny_dflash(path, hidden: int, vocab: int, taps: Sequence[int],
                     num_target_layers: int, seed: int = 0, **kw) -> Path:
    """A random-weight DFlash drafter saved as z-lab ships one (no embedding, no head)."""
    return make_tiny_block(path, "dflash", hidden, vocab, taps, num_target_layers, seed, **kw)
