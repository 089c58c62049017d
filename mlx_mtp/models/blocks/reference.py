"""Where mlx-lm 0.32.2's modules compute differently from the released models' reference
code, the replacements our families put into their built model (``replace_modules``; the
weights load into them under the same names). docs/model-families.md lists each difference.

* ``GroupLimitedGate``: DeepSeek-V3's group-limited router (``noaux_tc``: sigmoid scores plus
  a correction bias, the best ``topk_group`` of ``n_group`` groups kept by the sum of their
  top-2 scores, top-k experts among those). DeepSeek's own inference code
  (``inference/model.py``, ``Gate``), SGLang, vLLM and transformers mask the other groups'
  scores with -inf; mlx-lm, following the hub's remote-code ``modeling_deepseek.py``, fills
  them with 0.0, which outranks a kept expert whose biased score is negative: it can route
  to a group the reference ruled out. Families sharing mlx-lm's ``MoEGate`` use it
  where ``n_group > 1`` (with one group the two agree).
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map


def replace_modules(model: nn.Module, cls, make: Callable[[nn.Module], nn.Module]):
    """Every leaf module of ``model`` that is a ``cls`` as ``make(module)``."""
    model.update_modules(tree_map(lambda m: make(m) if isinstance(m, cls) else m,
                                  model.leaf_modules(),
                                  is_leaf=lambda m: isinstance(m, nn.Module)))


@mx.compile
def group_limited_select(gates, bias, top_k: int, n_group: int, topk_group: int,
                         scaling: float, norm_topk_prob: bool):
    """Expert indices and weights as DeepSeek's reference routes (see the module doc)."""
    scores = mx.sigmoid(gates.astype(mx.float32))
    choice = mx.unflatten(scores + bias, axis=-1, shape=(n_group, -1))
    group_scores = mx.topk(choice, 2, axis=-1).sum(axis=-1, keepdims=True)
    dropped = mx.argpartition(group_scores, kth=n_group - topk_group - 1,
                              axis=-2)[..., : n_group - topk_group, :]
    choice = mx.put_along_axis(choice, mx.stop_gradient(dropped), mx.array(-mx.inf), axis=-2)
    choice = mx.flatten(choice, -2, -1)
    inds = mx.stop_gradient(mx.argpartition(-choice, kth=top_k - 1, axis=-1)[..., :top_k])
    weights = mx.take_along_axis(scores, inds, axis=-1)
    if top_k > 1 and norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return inds, weights * scaling


class GroupLimitedGate(nn.Module):
    """An mlx-lm ``MoEGate`` (same weights, same settings) routing as the reference does."""

    def __init__(self, gate: nn.Module):
        super().__init__()
        self.weight = gate.weight
        self.e_score_correction_bias = gate.e_score_correction_bias
        self.top_k, self.n_group, self.topk_group = gate.top_k, gate.n_group, gate.topk_group
        self.routed_scaling_factor = gate.routed_scaling_factor
        self.norm_topk_prob = gate.norm_topk_prob

    def __call__(self, x):
        return group_limited_select(x @ self.weight.T, self.e_score_correction_bias,
                                    self.top_k, self.n_group, self.topk_group,
                                    self.routed_scaling_factor, self.norm_topk_prob)


def route_as_reference(model: nn.Module, gate_cls):
    """Every ``gate_cls`` (an mlx-lm ``MoEGate``) of ``model`` with more than one group as a
    ``GroupLimitedGate``."""
    replace_modules(model, gate_cls,
                    lambda g: GroupLimitedGate(g) if g.n_group > 1 else g)
