"""Qwen's multimodal rotary positions (MRoPE, interleaved sections), for rows whose
positions are given explicitly (a prompt chunk holding or preceding image tokens).

Each position is a triple (t, h, w); rotary frequency ``j`` turns with h when
``j % 3 == 1 and j < 3 * sections[1]``, with w when ``j % 3 == 2 and j < 3 * sections[2]``,
else with t (transformers' ``Qwen3_5TextRotaryEmbedding``). A text token's triple is
(p, p, p), which is ordinary RoPE at p: rows without explicit positions keep the
attention layer's ``nn.RoPE`` at the cache offset.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np


class MultimodalRoPE:
    def __init__(self, dims: int, base: float, sections: Sequence[int]):
        self.dims = dims
        n = dims // 2
        j = np.arange(n)
        axis = np.zeros(n, np.int32)
        axis[(j % 3 == 1) & (j < 3 * sections[1])] = 1
        axis[(j % 3 == 2) & (j < 3 * sections[2])] = 2
        self.axis = mx.array(axis)
        self.inv_freq = mx.array(1.0 / base ** (np.arange(0, dims, 2, dtype=np.float32) / dims))

    def __call__(self, x: mx.array, positions: mx.array) -> mx.array:
        """x (B, heads, L, D); positions (3, L) integer triples."""
        angles = positions.astype(mx.float32)[self.axis].T * self.inv_freq  # (L, dims/2)
        cos, sin = mx.cos(angles), mx.sin(angles)
        half = self.dims // 2
        rot = x[..., :self.dims].astype(mx.float32)
        x1, x2 = rot[..., :half], rot[..., half:]
        out = mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return mx.concatenate([out.astype(x.dtype), x[..., self.dims:]], axis=-1)
