"""Manifold-constrained hyper-connections (mHC), GLM-5.3-Flash's residual streams.

The residual is ``hc_mult`` streams (B, L, hc, H). Before each sub-block one projection of
all the streams (normed together, no weight) gives three weights: ``pre`` collapses the
streams into the sub-block's input, ``post`` spreads its output over the streams, and
``comb``, made doubly stochastic by Sinkhorn iterations, mixes the old streams into the new.
Computed in float32, as transformers 5.24 ``Glm5NextTextHyperConnection`` does.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class HyperConnection(nn.Module):
    def __init__(self, args):
        super().__init__()
        hc = self.count = args.hc_mult
        self.eps, self.norm_eps, self.iters = args.hc_eps, args.rms_norm_eps, args.hc_sinkhorn_iters
        self.fn = mx.zeros(((2 + hc) * hc, hc * args.hidden_size))
        self.base = mx.zeros(((2 + hc) * hc,))
        self.scale = mx.ones((3,))

    def __call__(self, streams):
        """streams (B, L, hc, H) -> (post (B, L, hc), comb (B, L, hc, hc), collapsed (B, L, H))."""
        hc, eps = self.count, self.eps
        flat = streams.reshape(*streams.shape[:2], -1).astype(mx.float32)
        flat = mx.fast.rms_norm(flat, None, self.norm_eps)
        w = flat @ self.fn.astype(mx.float32).T
        pre, post, comb = mx.split(w, [hc, 2 * hc], axis=-1)
        pre_b, post_b, comb_b = mx.split(self.base.astype(mx.float32), [hc, 2 * hc])
        scale = self.scale.astype(mx.float32)
        pre = mx.sigmoid(pre * scale[0] + pre_b) + eps
        post = 2 * mx.sigmoid(post * scale[1] + post_b)
        comb = comb.reshape(*comb.shape[:-1], hc, hc) * scale[2] + comb_b.reshape(hc, hc)
        comb = mx.softmax(comb, axis=-1) + eps
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
            comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
        collapsed = (pre[..., None] * streams).sum(axis=2).astype(streams.dtype)
        return post, comb, collapsed


def expand(post, comb, out, streams):
    """The sub-block's output spread by ``post`` plus the streams mixed by ``comb``."""
    dtype = out.dtype
    return (post.astype(dtype)[..., None] * out[..., None, :]
            + comb.astype(dtype).swapaxes(-1, -2) @ streams)
