"""Multimodal rotary positions of a prompt (transformers' ``Qwen3_5Model.get_rope_index``
for images), shifted so the engine's decode steps need no per-row state.

transformers gives text tokens (p, p, p), consecutive; an image of g_h x g_w merged
patches starting at p gets (p, p + i, p + j) and the text after it continues at
p + max(g_h, g_w); decoding then runs at ``offset + delta`` with
``delta = max + 1 - len(prompt)`` (<= 0 with images). Rotary attention depends only on
differences of positions, so shifting every row of the prompt by ``-delta`` changes no
attention score: the prompt's last text token then sits at its own index, and every
later row (decode steps, verify rows, the MTP head's rows) at its cache offset, as in
text-only decoding.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np


def prompt_positions(ids: np.ndarray, grids: Sequence[Tuple[int, int, int]], pad_id: int,
                     merge: int) -> np.ndarray:
    """(3, L) int32 positions of the prompt ``ids`` whose image-pad runs hold the images of
    ``grids`` ((t, h, w) patches each) in order; shifted as the module doc says."""
    L = len(ids)
    pos = np.zeros((3, L), np.int64)
    grid_iter = iter(grids)
    i = p = 0
    while i < L:
        if ids[i] != pad_id:
            pos[:, i] = p
            i, p = i + 1, p + 1
            continue
        t, h, w = next(grid_iter)
        gh, gw = h // merge, w // merge
        n = t * gh * gw
        if i + n > L or not (ids[i:i + n] == pad_id).all():
            raise ValueError(f"image at prompt position {i} needs {n} consecutive image tokens")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        pos[:, i:i + n] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + p
        i, p = i + n, p + max(gh, gw)
    return (pos - (p - L)).astype(np.int32)
