"""Tensor split of the Qwen hybrid layers (``HybridModel.shard``): attention, Gated DeltaNet,
MLP and expert projections divided by heads / intermediate columns over a group, with one
``all_sum`` after each mixer and MLP."""

from __future__ import annotations

import mlx.core as mx
from mlx.nn.layers.distributed import shard_inplace, shard_linear
from mlx.utils import tree_map

from .hybrid import GatedAttention, GatedDeltaNetBase, SparseMoeBlock


class _AllSumMoe(SparseMoeBlock):
    """A MoE block whose experts and shared expert hold a slice of the intermediate
    columns: their partial outputs add up, so one all_sum finishes the block."""

    def __call__(self, x):
        return mx.distributed.all_sum(super().__call__(x), group=self._group)


def _shard_by_rows(module, group, segments=1):
    shard_inplace(module, "all-to-sharded", segments=segments, group=group)


def _shard_mlp(mlp, group, reduce: bool):
    for proj in ("gate_proj", "up_proj"):
        _shard_by_rows(getattr(mlp, proj), group)
    if reduce:
        mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)
    else:
        shard_inplace(mlp.down_proj, "sharded-to-all", group=group)


def _shard_attention(attn: GatedAttention, group):
    N = group.size()
    for proj in ("q_proj", "k_proj", "v_proj"):  # q_proj rows: [q | gate] per head
        _shard_by_rows(getattr(attn, proj), group)
    attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
    attn.n_heads //= N
    attn.n_kv_heads //= N


def _shard_delta_net(gdn: GatedDeltaNetBase, group):
    N = group.size()
    qkv_split = [gdn.key_dim, 2 * gdn.key_dim]  # conv channels: q | k | v, each by heads
    if "in_proj_qkvz" in gdn:  # Qwen3-Next: grouped per key head, contiguous by rows
        _shard_by_rows(gdn.in_proj_qkvz, group)
        _shard_by_rows(gdn.in_proj_ba, group)
    else:
        _shard_by_rows(gdn.in_proj_qkv, group, segments=qkv_split)
        for proj in ("in_proj_z", "in_proj_b", "in_proj_a"):
            _shard_by_rows(getattr(gdn, proj), group)
    shard_inplace(gdn.conv1d, lambda path, w: (0, qkv_split), group=group)
    shard_inplace(gdn, lambda path, w: 0 if path in ("dt_bias", "A_log") else None, group=group)
    gdn.out_proj = shard_linear(gdn.out_proj, "sharded-to-all", group=group)
    gdn.num_k_heads //= N
    gdn.num_v_heads //= N
    gdn.key_dim //= N
    gdn.value_dim //= N
    gdn.conv_dim //= N
    gdn.conv1d.groups = gdn.conv_dim


def shard_layer(layer, group):
    """Split one decoder layer (trunk or MTP) across ``group`` by heads / columns."""
    if getattr(layer, "is_linear", False):
        _shard_delta_net(layer.linear_attn, group)
    else:
        _shard_attention(layer.self_attn, group)
    mlp = layer.mlp
    if isinstance(mlp, SparseMoeBlock):
        for proj in ("gate_proj", "up_proj"):
            _shard_by_rows(getattr(mlp.switch_mlp, proj), group)
        shard_inplace(mlp.switch_mlp.down_proj, "sharded-to-all", group=group)
        _shard_mlp(mlp.shared_expert, group, reduce=False)
        mlp.__class__ = _AllSumMoe
        mlp._group = group
    else:
        _shard_mlp(mlp, group, reduce=True)


def read_share(layer):
    """Read a sharded layer's slices into buffers of their own, now: a slice is a view
    that keeps its whole tensor alive (a rank would hold every rank's part). The views
    stay referenced while the copies are made, so no op reuses (donates) their buffers."""
    views = layer.parameters()
    mx.eval(views)
    copies = tree_map(lambda v: v * 1, views)  # exact, -0.0 included
    mx.eval(copies)
    layer.update(copies)
