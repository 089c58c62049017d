"""``mlx-mtp train --mode dflash``: a DFlash block drafter for a frozen model, in z-lab's
published layout (``DFlashDraftModel``), so ``--draft-model DIR`` loads it unchanged.

The recipe (DFlash): the frozen trunk reads a window of text once and yields its taps (the
residual after each layer of ``target_layer_ids``, through ``trunk_with_taps``, the call the
decoder makes). The drafter projects them into its context once (``add_context``), then runs
a block ``[token at p, mask x (block_size - 1)]`` at each of several random anchors ``p``,
each block seeing the context of the positions before its anchor only
(``ContextCache.prefixes``) and attending within itself both ways, exactly as it drafts
(``DFlash.block_logits``). Slot j is trained with cross-entropy on the token at ``p + j``:
the text's own (``labels="data"``) or the trunk's greedy prediction there given the text
before it (``labels="trunk"``: what greedy verification accepts), weighted
``exp(-(j - 1) / decay)`` when ``decay > 0`` (an early slot's miss rejects every later one).
The embedding and output layer are the target's, bound, never trained or saved.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..drafters.block.config import parse_block_config
from ..drafters.block.dflash import DFlash
from ..models.cache.context import ContextCache

LABELS = ("data", "trunk")


def default_taps(num_layers: int, count: int = 3) -> List[int]:
    """``count`` layers spread from the second to the fourth-last, as z-lab spreads its
    five over Qwen3.5-4B's 32 (1, 8, 15, 22, 29)."""
    last = max(1, num_layers - 3)
    if count == 1:
        return [last]
    return sorted({round(1 + i * (last - 1) / (count - 1)) for i in range(count)})


def drafter_config(text_cfg: dict, taps: Sequence[int], block_size: int, num_layers: int,
                   mask_token_id: int) -> dict:
    """The drafter's ``config.json`` (z-lab DFlash): a Qwen3 body of the trunk's width and
    attention shape, its taps, block and mask token."""
    rope = text_cfg.get("rope_parameters") or {}
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": text_cfg["hidden_size"],
            "intermediate_size": text_cfg["intermediate_size"],
            "num_hidden_layers": num_layers,
            "num_attention_heads": text_cfg["num_attention_heads"],
            "num_key_value_heads": text_cfg["num_key_value_heads"],
            "head_dim": text_cfg.get("head_dim",
                                     text_cfg["hidden_size"] // text_cfg["num_attention_heads"]),
            "rms_norm_eps": text_cfg.get("rms_norm_eps", 1e-6),
            "vocab_size": text_cfg["vocab_size"], "max_position_embeddings": 32768,
            "rope_theta": float(text_cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
            "tie_word_embeddings": True, "torch_dtype": "float32",
            "num_target_layers": text_cfg["num_hidden_layers"], "block_size": block_size,
            "dflash_config": {"mask_token_id": mask_token_id,
                              "target_layer_ids": list(taps)}}


def drafter_config_for(cfg, text_cfg: dict) -> dict:
    """``drafter_config`` from the run's ``TrainConfig``; ValueError for a shape that
    cannot train."""
    for name, value, least in (("block-size", cfg.block_size, 2),
                               ("draft-layers", cfg.draft_layers, 1), ("anchors", cfg.anchors, 1)):
        if value < least:
            raise ValueError(f"--{name} must be >= {least} (got {value})")
    if cfg.seq_len + 1 - cfg.block_size < 1:
        raise ValueError(f"--seq-len {cfg.seq_len} leaves no room for --block-size "
                         f"{cfg.block_size} after a context row")
    taps = cfg.target_layers or default_taps(text_cfg["num_hidden_layers"])
    mask = text_cfg["vocab_size"] - 1 if cfg.mask_token_id is None else cfg.mask_token_id
    return drafter_config(text_cfg, taps, cfg.block_size, cfg.draft_layers, mask)


def build_drafter(config: dict, seed: int = 0) -> DFlash:
    """A fresh drafter for ``config``; output projections scaled down like the trunk's
    (``model.build_scratch_model``) so each layer starts near the identity."""
    mx.random.seed(seed)
    drafter = DFlash(parse_block_config(config))
    scale = 1.0 / math.sqrt(2 * len(drafter.layers))
    for layer in drafter.layers:
        layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * scale
        layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * scale
    mx.eval(drafter.parameters())
    return drafter


def sample_anchors(batch_size: int, length: int, block_size: int, per_row: int, seed: int,
                   step: int) -> np.ndarray:
    """(batch_size, per_row) anchor positions in a window of ``length`` tokens: each with
    at least one context row before it and its whole block inside the window (seeded per
    step, so a resumed run draws the same)."""
    hi = length - block_size
    if hi < 1:
        raise ValueError(f"a window of {length} tokens holds no block of {block_size} after "
                         "a context row")
    rng = np.random.default_rng([seed, step, 1])
    return np.sort(rng.integers(1, hi + 1, size=(batch_size, per_row)), axis=1).astype(np.int32)


def slot_weights(block_size: int, decay: float) -> mx.array:
    """Loss weight of each predicting slot 1..block_size-1 (``decay`` 0: all alike)."""
    j = mx.arange(block_size - 1).astype(mx.float32)
    return mx.exp(-j / decay) if decay > 0 else mx.ones_like(j)


class DFlashLoss:
    """The loss of ``drafter`` drafting for the frozen ``model`` over a window of tokens."""

    def __init__(self, model, drafter: DFlash, labels: str = "data", decay: float = 0.0):
        if labels not in LABELS:
            raise ValueError(f"labels must be one of {', '.join(LABELS)}, not {labels!r}")
        self.model, self.drafter, self.labels = model, drafter, labels
        self.weights = slot_weights(drafter.spec.block_size, decay)
        drafter.bind(model.embed, model.logits)

    def targets(self, tokens: mx.array):
        """The frozen trunk's taps (B, L, H each) and each position's label (B, L): the
        token there, or the trunk's greedy pick for it."""
        h_norm, _, taps = self.model.trunk_with_taps(tokens, self.drafter.spec.target_layer_ids)
        if self.labels == "data":
            labels = tokens
        else:  # the pick for position i + 1 is read at i; position 0 keeps its token
            picks = mx.argmax(self.model.logits(h_norm[:, :-1]), axis=-1).astype(tokens.dtype)
            labels = mx.concatenate([tokens[:, :1], picks], axis=1)
        return [mx.stop_gradient(t) for t in taps], mx.stop_gradient(labels)

    def __call__(self, tokens: mx.array, anchors: np.ndarray, taps=None, labels=None):
        """(weighted mean cross-entropy, accuracy of slot 1) over every anchor's block.
        ``anchors`` (B, A): positions in ``tokens`` (B, L) (``sample_anchors``)."""
        if taps is None:
            taps, labels = self.targets(tokens)
        B, A = anchors.shape
        W = self.drafter.spec.block_size
        cache = [ContextCache.empty(B) for _ in range(self.drafter.num_caches)]
        self.drafter.add_context(taps, cache)
        rows, at = np.repeat(np.arange(B), A).tolist(), anchors.reshape(-1).tolist()
        blocks = [c.prefixes(rows, at) for c in cache]
        row_ix, at_ix = mx.array(rows), mx.array(at)
        want = labels[row_ix[:, None], at_ix[:, None] + mx.arange(1, W)[None]]  # (B*A, W-1)
        logits = self.drafter.block_logits(tokens[row_ix, at_ix], blocks).astype(mx.float32)
        ce = nn.losses.cross_entropy(logits, want)
        loss = (ce * self.weights).sum() / (self.weights.sum() * ce.shape[0])
        first = (mx.argmax(logits[:, 0], axis=-1) == want[:, 0]).astype(mx.float32).mean()
        return loss, first


def export_drafter(drafter: DFlash, config: dict, out, dtype=mx.float32,
                   extra_files: Optional[dict] = None):
    """Write the drafter (config + safetensors) through the one checkpoint writer, which
    publishes the directory atomically."""
    from mlx.utils import tree_flatten

    from ..convert.checkpoint_io import write_checkpoint

    weights = dict(tree_flatten(drafter.parameters()))
    write_checkpoint(out, weights, config, dtype=dtype, mtp_file=False, fmt="pt",
                     extra_files=extra_files)
    return out
