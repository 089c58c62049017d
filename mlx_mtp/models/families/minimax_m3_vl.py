"""MiniMax-M3 (``model_type: minimax_m3_vl``): the text model of the VLM release, decoded
plainly; its MTP head is refused.

Trunk: mlx-lm's ``minimax_m3_vl`` text model (GQA with zero-centred norms, block-sparse
indexer layers choosing the top key blocks per query, MoE with a shared expert), its config
unwrapped from ``text_config``; the key blocks are cut over each row's positions rather than
cache slots (``PositionBlocks``), so batched rows select as single rows do. Sparse layers
keep two caches (keys and values, the indexer's keys), the others one; rollback is a trim.

Weights: the release stores the text model as ``language_model.{model,lm_head}.*``; the
vision tower and projectors (``vision_tower.*``, ``multi_modal_projector.*``,
``patch_merge_mlp.*``) are dropped. The release also ships ``mtp.*`` tensors, but no public
source says how they are laid out or what hidden state they read: transformers 5.24 ignores
``mtp.*``, mlx-lm has no MTP code for this type, and the config declares no MTP fields. So a
checkpoint holding them is refused for MTP, with a message pointing to ``--no-mtp``.
"""

from __future__ import annotations

from typing import List

import mlx.core as mx
from mlx_lm.models import minimax_m3_vl as lm

from ..io import layout
from ..blocks.attention_trunk import Family, ModelArgs, attention_mask, mlx_lm_sanitize
from ..blocks.attention_trunk import Model as _Model
from ..interface import Capabilities
from ..cache.kv import KVCache

TEXT_PREFIXES = ("model.", "lm_head.")  # the text model's weights, under our names


class MTPHeadUnsupportedError(layout.CheckpointError):
    pass


class PositionBlocks(lm.Attention):
    """mlx-lm's attention with its key blocks cut over each row's positions, not over cache
    slots: a batch's rows sit left-padded and with holes (rejected drafts) in one slot
    range, and must select the blocks their own single-row decoding selects. On one row
    (slots are positions) it selects exactly what mlx-lm's ``_block_mask`` does."""

    def _block_mask(self, x, mask, offset, cache):
        B, L, _ = x.shape
        H, D, size = self.index_n_heads, self.index_head_dim, self.index_block_size
        k = self.index_k_norm(self.index_k_proj(x).reshape(B, L, 1, D)).transpose(0, 2, 1, 3)
        k = self.index_rope(k, offset=offset)
        if cache is not None:
            k, _ = cache.update_and_fetch(k, mx.zeros((B, 1, L, 0), k.dtype))
        S = k.shape[2]
        n_blocks = -(-S // size)  # no row holds more positions than slots
        if self.index_topk_blocks >= n_blocks:
            return mask
        per_key = mask if isinstance(mask, mx.array) else (
            mx.arange(S)[None] <= mx.arange(S - L, S)[:, None])[None, None]
        valid = per_key[:, 0, -1, :]  # the last query (a real token) sees every valid slot
        rank = mx.cumsum(valid.astype(mx.int32), axis=-1) - 1  # slot -> position
        by_position = mx.argsort(mx.where(valid, 0, S) + mx.arange(S), axis=-1)  # -> slot
        q = self.index_q_norm(self.index_q_proj(x).reshape(B, L, H, D)).transpose(0, 2, 1, 3)
        q = self.index_rope(q, offset=offset)
        scores = q.astype(mx.float32) @ k.astype(mx.float32).swapaxes(-1, -2)
        scores = mx.where(per_key, scores, -mx.inf)  # a future key must not win a block
        scores = mx.take_along_axis(scores, by_position[:, None, None, :], axis=-1)
        scores = mx.pad(scores, [(0, 0)] * 3 + [(0, n_blocks * size - S)],
                        constant_values=-mx.inf)
        block_scores = scores.reshape(*scores.shape[:3], n_blocks, size).max(axis=-1)
        if self.index_local_blocks > 0:
            q_block = (rank[:, S - L:] // size)[:, None, :, None]
            ids = mx.arange(n_blocks)
            is_local = (ids <= q_block) & (ids > q_block - self.index_local_blocks)
            block_scores = mx.where(is_local, mx.inf, block_scores)
        top = self.index_topk_blocks
        inds = mx.argpartition(-block_scores, kth=top - 1, axis=-1)[..., :top]
        keep = mx.put_along_axis(mx.zeros(block_scores.shape, mx.bool_),
                                 mx.stop_gradient(inds), mx.array(True), axis=-1)
        slot_block = (mx.maximum(rank, 0) // size)[:, None, None, :]
        keep = mx.take_along_axis(keep, slot_block, axis=-1) & per_key
        return mx.repeat(keep, self.num_attention_heads // H, axis=1)


class Trunk(lm.TextModel):
    """mlx-lm's text model with ``PositionBlocks`` in its block-sparse layers."""

    def __init__(self, args):
        super().__init__(args)
        for i, layer in enumerate(self.layers):
            if layer.self_attn.is_sparse_attn:
                layer.self_attn = PositionBlocks(args, i)


def unsupported_head(model_type: str, what: str) -> MTPHeadUnsupportedError:
    return MTPHeadUnsupportedError(
        f"model_type {model_type!r}: mlx-mtp cannot draft with {what}; no public source gives "
        "the layout of MiniMax-M3's MTP head or the hidden state it reads (transformers 5.24 "
        "ignores mtp.*, mlx-lm has no MTP code for it). Run with --no-mtp (plain decoding).")


class Model(_Model):
    # Not split across processes yet: no split of it is tested (it has no MTP head to draft
    # with either), so --distributed refuses it in one line.
    capabilities = Capabilities(splits=())
    family = Family(lm=lm, args_cls=lm.TextArgs, trunk_cls=Trunk, block=None,
                    mtp_prefix=lambda args, i: "mtp.",
                    tied=lambda args: args.tie_word_embeddings)

    def __init__(self, args: ModelArgs):
        text = layout.text_config(args.config)
        declared = layout.config_mtp_layers(args.config)
        if declared:
            raise unsupported_head(args.model_type, f"{declared} MTP layer(s)")
        super().__init__(ModelArgs(args.model_type, dict(text, model_type=args.model_type)))
        # ``--no-mtp`` records an explicit count of 0; a release declares none.
        self.head_declined = any(k in text for k in layout.MTP_LAYER_COUNT_KEYS)

    # --- forward ----------------------------------------------------------
    def layer_caches(self, cache) -> List[tuple]:
        """The flat cache list, one tuple per layer (sparse layers: keys, indexer keys)."""
        flat, out = iter(cache), []
        for layer in self.model.layers:
            n = 2 if layer.self_attn.is_sparse_attn else 1
            out.append(tuple(next(flat) for _ in range(n)))
        return out

    def trunk_layers(self, inputs, cache=None, capture=False, taps=()):
        h = self.embed(inputs)
        L = h.shape[1]
        caches = self.layer_caches(cache) if cache is not None else [None] * len(
            self.model.layers)
        mask = attention_mask(caches[0][0] if cache is not None else None, L, False)
        tapped = {}
        for i, (layer, c) in enumerate(zip(self.model.layers, caches)):
            h = layer(h, mask, c)
            if i in taps:
                tapped[i] = h
        return h, tapped

    def make_cache(self):
        return [KVCache() for layer in self.model.layers
                for _ in range(2 if layer.self_attn.is_sparse_attn else 1)]

    @staticmethod
    def cast_predicate(path: str) -> bool:
        return "e_score_correction_bias" not in path  # mlx-lm keeps it in float32

    # --- weights ----------------------------------------------------------
    def lm_sanitize(self, weights: dict) -> dict:
        """mlx-lm's sanitize (expert stacking, fused and folded experts, MXFP8 scales) on
        our names, which are its ``language_model.*`` ones less that level."""
        wrapped = {"language_model." + k: v for k, v in weights.items()}
        out = mlx_lm_sanitize(lm.Model, lm.ModelArgs(text_config=self.args), wrapped)
        return {k[len("language_model."):]: v for k, v in out.items()}

    def sanitize(self, weights: dict) -> dict:
        weights = layout.text_weight_names(weights)  # language_model.* -> model.*, lm_head.*
        head = sorted(k for k in weights if layout.is_mtp_key(k))
        if not self.head_declined:  # the engine would ask for drafts from a head it lacks
            raise unsupported_head(self.model_type, f"this checkpoint's MTP head ({len(head)} "
                                                    "tensors under mtp.*)" if head else
                                   "this checkpoint, which has no MTP head (no mtp.* tensors)")
        return self.lm_sanitize({k: v for k, v in weights.items() if k.startswith(TEXT_PREFIXES)})

    def checkpoint_name(self, key: str) -> str:
        """Our name -> the release's (``language_model.*``), which mlx-lm also reads."""
        return "language_model." + key if key.startswith(TEXT_PREFIXES) else key

    def is_mtp_key(self, key: str) -> bool:
        return layout.is_mtp_key(key)
