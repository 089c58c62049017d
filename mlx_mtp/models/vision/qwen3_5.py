"""The Qwen3.5 / 3.6 vision tower (``Qwen3_5VisionModel`` in transformers), in MLX.

Patches (3 x 2 x 16 x 16 pixels, flattened by the image processor) -> a linear patch
embedding (the checkpoint's Conv3d with stride = kernel) + a learned position grid
resampled bilinearly to each image -> ``depth`` pre-norm blocks (attention within each
image, 2-D rotary positions over (row, column)) -> a merger that concatenates each
2 x 2 block of patches and projects it to the text model's width: one embedding per
image-pad token. Patches arrive in merge-block order (the processor's), so every
per-patch table below is built in that order.

Written on mlx building blocks rather than taken from mlx-vlm: mlx-vlm 0.7.10's package
import pulls in its whole runtime (opencv, datasets, mlx-audio, a server), far more than a
40-tensor tower needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..io.layout import CheckpointError

VISION_PREFIXES = ("model.visual.", "visual.", "vision_tower.", "model.vision_tower.")
QUERY_BLOCK = 1024  # patches whose attention scores are computed together


@dataclass
class VisionArgs:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, config: dict) -> "VisionArgs":
        fields = {k: config[k] for k in cls.__dataclass_fields__ if k in config}
        rope = config.get("rope_parameters") or {}
        fields["rope_theta"] = float(rope.get("rope_theta", cls.rope_theta))
        try:
            return cls(**fields)
        except TypeError as e:
            raise CheckpointError(f"vision_config in config.json is incomplete: {e}") from e

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


ACTIVATIONS = {"gelu_pytorch_tanh": nn.gelu_approx, "gelu": nn.gelu}


def rotate_half_apply(x, cos, sin):
    """x (N, heads, D) rotated by per-row angles (cos/sin (N, D)), half-split layout."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = mx.concatenate([-x2, x1], axis=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class Attention(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.num_heads = args.num_heads
        self.qkv = nn.Linear(args.hidden_size, 3 * args.hidden_size, bias=True)
        self.proj = nn.Linear(args.hidden_size, args.hidden_size, bias=True)

    def __call__(self, x, cos, sin, lengths: List[int]):
        N = x.shape[0]
        q, k, v = mx.split(self.qkv(x).reshape(N, 3, self.num_heads, -1), 3, axis=1)
        q = rotate_half_apply(q[:, 0].astype(mx.float32), cos, sin).astype(x.dtype)
        k = rotate_half_apply(k[:, 0].astype(mx.float32), cos, sin).astype(x.dtype)
        v = v[:, 0]
        scale = q.shape[-1] ** -0.5
        outs, start = [], 0
        for n in lengths:  # attention stays within each image
            qi, ki, vi = (t[start:start + n].transpose(1, 0, 2)[None] for t in (q, k, v))
            # Query blocks bound the score matrix a large image would need at once (CPU).
            for b in range(0, n, QUERY_BLOCK):
                o = mx.fast.scaled_dot_product_attention(qi[:, :, b:b + QUERY_BLOCK], ki, vi,
                                                         scale=scale)
                outs.append(o[0].transpose(1, 0, 2).reshape(o.shape[2], -1))
            start += n
        return self.proj(mx.concatenate(outs, axis=0))


class MLP(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.linear_fc1 = nn.Linear(args.hidden_size, args.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(args.intermediate_size, args.hidden_size, bias=True)
        self.act = ACTIVATIONS[args.hidden_act]

    def __call__(self, x):
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Block(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.norm1 = nn.LayerNorm(args.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(args.hidden_size, eps=1e-6)
        self.attn = Attention(args)
        self.mlp = MLP(args)

    def __call__(self, x, cos, sin, lengths):
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.proj = nn.Linear(args.patch_dim, args.hidden_size, bias=True)  # the Conv3d, flat

    def __call__(self, pixels):
        return self.proj(pixels)


class Merger(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.width = args.hidden_size * args.spatial_merge_size ** 2
        self.norm = nn.LayerNorm(args.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width, bias=True)
        self.linear_fc2 = nn.Linear(self.width, args.out_hidden_size, bias=True)

    def __call__(self, x):
        x = self.norm(x).reshape(-1, self.width)
        return self.linear_fc2(nn.gelu(self.linear_fc1(x)))


def merge_block_rows_cols(h: int, w: int, merge: int) -> Tuple[np.ndarray, np.ndarray]:
    """(row, column) of each patch of an h x w grid, in merge-block order."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    return (rows.reshape(shape).transpose(0, 2, 1, 3).ravel(),
            cols.reshape(shape).transpose(0, 2, 1, 3).ravel())


def _axis_taps(index: np.ndarray, size: int, side: int):
    """Bilinear taps (align_corners) of ``index`` on an axis of ``size`` into ``side``."""
    src = index * (side - 1) / max(size - 1, 1)
    floor = np.floor(src)
    taps = np.clip(floor[:, None].astype(np.int64) + np.arange(2), 0, side - 1)
    weights = np.clip(1 - np.abs(src[:, None] - floor[:, None] - np.arange(2)), 0, None)
    return taps, weights


class VisionModel(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.pos_embed = nn.Embedding(args.num_position_embeddings, args.hidden_size)
        self.side = int(round(args.num_position_embeddings ** 0.5))
        self.blocks = [Block(args) for _ in range(args.depth)]
        self.merger = Merger(args)
        head_dim = args.hidden_size // args.num_heads
        quarter = np.arange(0, head_dim // 2, 2, dtype=np.float32) / (head_dim // 2)
        self.inv_freq = 1.0 / args.rope_theta ** quarter  # a numpy constant, not a weight

    def _grid_tables(self, grids: Sequence[Sequence[int]]):
        """Per patch: position-embedding taps and weights, and rotary cos / sin."""
        m, side = self.args.spatial_merge_size, self.side
        idx, wts, angles = [], [], []
        for t, h, w in grids:
            rows, cols = merge_block_rows_cols(h, w, m)
            rows, cols = np.tile(rows, t), np.tile(cols, t)
            (rt, rw), (ct, cw) = _axis_taps(rows, h, side), _axis_taps(cols, w, side)
            idx.append((rt[:, :, None] * side + ct[:, None, :]).reshape(-1, 4))
            wts.append((rw[:, :, None] * cw[:, None, :]).reshape(-1, 4))
            angles.append(np.concatenate([np.outer(rows, self.inv_freq),
                                          np.outer(cols, self.inv_freq)], axis=-1))
        a = np.concatenate(angles)
        a = np.concatenate([a, a], axis=-1)
        return (mx.array(np.concatenate(idx)), mx.array(np.concatenate(wts), mx.float32),
                mx.array(np.cos(a), mx.float32), mx.array(np.sin(a), mx.float32))

    def __call__(self, pixels: mx.array, grids: Sequence[Sequence[int]]) -> mx.array:
        """pixels (patches, patch_dim) of every image; grids: (t, h, w) per image.
        Returns (image tokens, out_hidden_size): each image's tokens in turn."""
        idx, wts, cos, sin = self._grid_tables(grids)
        x = self.patch_embed(pixels.astype(self.patch_embed.proj.weight.dtype))
        pos = (self.pos_embed(idx) * wts[..., None].astype(x.dtype)).sum(axis=1)
        x = x + pos
        lengths = [h * w for t, h, w in grids for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.merger(x)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """The tower's tensors of a checkpoint (released or mlx-vlm layout), our names."""
        out = {}
        for k, v in weights.items():
            prefix = next((p for p in VISION_PREFIXES if k.startswith(p)), None)
            if prefix is None:
                continue
            k = k[len(prefix):]
            if k == "patch_embed.proj.weight" and v.ndim == 5:
                if v.shape[1] != self.args.in_channels:  # MLX Conv3d: (out, T, P, P, C)
                    v = v.transpose(0, 4, 1, 2, 3)
                v = v.reshape(v.shape[0], -1)
            out[k] = v
        return out
