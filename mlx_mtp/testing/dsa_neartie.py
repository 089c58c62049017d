"""A DeepSeek-V3.2 / GLM-5 checkpoint on which mlx-lm's two DSA paths select different keys.

mlx-lm computes one token with the absorbed MLA formula and gathered top-k keys, several
tokens with the expanded formula and a sparse mask. The two differ by rounding (1e-7), so
where two keys' indexer scores nearly tie at the top-k boundary, a later layer's indexer
picks one key after a one-token pass and the other after a many-token pass. This builder
makes such a tie on purpose: a 2-layer model with ``index_topk`` 4 and random weights, where
one knob (the scale of the second indexer head's weight in layer 1) moves the keys' scores
past each other. It bisects the knob to where each path flips and sets it between the two
flip points, so for the first decoded token (position ``len(prompt)``) the one-token pass
and the many-token pass select different keys in layer 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .tiny_attention import build_model, save_tiny, to_hf
from .tiny_special import dsa_config

INDEX_TOPK = 4
TIE_LAYER = 1


class _Recorder(nn.Module):
    """Wraps mlx-lm's indexer and keeps the top-k indices it returns."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.seen: List[Optional[mx.array]] = []

    def __call__(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        self.seen.append(out)
        return out


def mlx_lm_selections(model, prompt, first: int) -> Tuple[tuple, tuple, int, int]:
    """Layer ``TIE_LAYER``'s selection (sorted) for token ``first`` at position
    ``len(prompt)``, after a one-token pass and as row 0 of a two-token pass, with mlx-lm's
    own attention; plus both passes' greedy tokens there."""
    from mlx_lm.models.cache import CacheList, KVCache

    attn = model.model.layers[TIE_LAYER].self_attn
    inner, attn.indexer = attn.indexer, _Recorder(attn.indexer)
    try:
        out = []
        for tail in ([first], [first, first]):
            cache = [CacheList(KVCache(), KVCache()) for _ in model.model.layers]
            model.model(mx.array([prompt]), cache)
            logits = model.lm_head(model.model(mx.array([tail]), cache))
            top = attn.indexer.seen[-1]
            out.append((tuple(sorted(np.array(top[0, 0, 0]).tolist())),
                        int(logits[0, 0].argmax())))
    finally:
        attn.indexer = inner
    (one, tok_one), (many, tok_many) = out
    return one, many, tok_one, tok_many


def _first_token(model, prompt) -> int:
    return int(model.lm_head(model.model(mx.array([prompt])))[0, -1].argmax())


def _set_knob(model, base: mx.array, alpha: np.float32):
    w = base * mx.array([[1.0], [float(alpha)]], mx.float32)
    model.model.layers[TIE_LAYER].self_attn.indexer.weights_proj.weight = w


def _bisect(f, lo: np.float32, hi: np.float32) -> Tuple[np.float32, np.float32]:
    """Adjacent float32s (lo, hi) with f(lo) == f(lo_in) != f(hi)."""
    want = f(lo)
    while np.nextafter(lo, hi) != hi:
        mid = np.float32((lo + hi) / 2)
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if f(mid) == want else (lo, mid)
    return lo, hi


def find_near_tie(model, prompt, grid: int = 41) -> Optional[np.float32]:
    """A knob value at which the two paths select differently (None: no tie found)."""
    base = model.model.layers[TIE_LAYER].self_attn.indexer.weights_proj.weight
    first = _first_token(model, prompt)

    def sel(alpha, path):
        _set_knob(model, base, alpha)
        if _first_token(model, prompt) != first:
            return None
        return mlx_lm_selections(model, prompt, first)[path]

    alphas = np.linspace(0.0, 4.0, grid, dtype=np.float32)
    one = [sel(a, 0) for a in alphas]
    for a, b, sa, sb in zip(alphas, alphas[1:], one, one[1:]):
        if sa is None or sb is None or sa == sb:
            continue
        lo1, hi1 = _bisect(lambda x: sel(x, 0), a, b)
        lo2, hi2 = _bisect(lambda x: sel(x, 1), a, b)
        for alpha in (hi1, hi2, lo1, lo2):
            s = sel(alpha, 0), sel(alpha, 1)
            if None not in s and s[0] != s[1]:
                _set_knob(model, base, alpha)
                return alpha
    _set_knob(model, base, np.float32(1.0))
    return None


def make_near_tie_dsa(path, family: str = "deepseek_v32", *, seeds=range(8),
                      prompt_len: int = 10) -> Tuple[Path, List[int], float]:
    """The checkpoint (random weights, no MTP head training: its layer is random), the prompt
    and the knob value; tries ``seeds`` until a tie is found."""
    for seed in seeds:
        config = dsa_config(family, index_topk=INDEX_TOPK, num_layers=2)
        model = build_model(config, seed)
        rng = np.random.default_rng(seed)
        prompt = [int(x) for x in rng.integers(0, config["vocab_size"], prompt_len)]
        alpha = find_near_tie(model, prompt)
        if alpha is not None:
            mx.eval(model.parameters())
            return save_tiny(path, to_hf(model), config), prompt, float(alpha)
    raise RuntimeError(f"no near-tie found for {family} with seeds {list(seeds)}")

