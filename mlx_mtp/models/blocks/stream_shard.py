"""Tensor split of the stream families' layers (GLM-5.3-Flash, DeepSeek-V4; Qwen4-Exp's layers
are Qwen3.5's, split by ``hybrid_shard``): attention heads, KDA heads, MLP and expert columns
divided over a group, one ``all_sum`` after each mixer and each MLP / MoE block.

What reads the whole residual stays whole on every rank and is computed identically there:
the hyper-connection / mHC stream mixers, the indexers and compressors, the routers, the low-rank
query projections and DeepSeek-V4's one shared key/value head.
"""

from __future__ import annotations

from mlx.nn.layers.distributed import shard_inplace, shard_linear

from .expert_split import shared_experts, summed


def _rows(module, group):
    shard_inplace(module, "all-to-sharded", group=group)


def _columns(module, group):
    shard_inplace(module, "sharded-to-all", group=group)


def _by_rows(module, names, group):
    """Split ``module``'s own parameters ``names`` along their first axis."""
    shard_inplace(module, lambda path, w: 0 if path in names else None, group=group)


def shard_kda(attn, group):
    """GLM-5.3-Flash's KDA (``glm5_next.KDA``) by heads: each projection of ``heads · d``
    rows, its convolution channels, decay and gate by head; the output summed."""
    N = group.size()
    for name in ("q", "k", "v"):
        _rows(attn[f"{name}_proj"], group)
        conv = attn[f"{name}_conv1d"]
        _by_rows(conv, ("weight",), group)
        conv.groups //= N
    for name in ("f_b_proj", "g_b_proj", "b_proj"):  # the low-rank halves read x: whole
        _rows(attn[name], group)
    _by_rows(attn, ("A_log", "dt_bias"), group)
    attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
    attn.num_heads //= N
    attn.projection_size //= N


def shard_nope_mla(attn, group):
    """GLM-5.3-Flash's indexed NoPE MLA (``glm5_next.IndexedMLA``) by query heads: the
    latents and the indexer are whole on every rank."""
    _rows(attn.q_b_proj, group)
    _rows(attn.kv_b_proj, group)  # (heads · (nope + v), latent): contiguous per head
    attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
    attn.heads //= group.size()


def shard_dsv4_attention(attn, group):
    """DeepSeek-V4's attention by query heads and output groups (each rank holds whole
    groups of ``heads / o_groups`` heads, so its ``wo_a`` rows): the key/value head, the
    compressors and the indexer whole on every rank."""
    N = group.size()
    _rows(attn.wq_b, group)
    _rows(attn.wo_a, group)  # read as (groups, o_lora_rank, heads · d / groups)
    _by_rows(attn, ("attn_sink",), group)
    attn.wo_b = shard_linear(attn.wo_b, "sharded-to-all", group=group)
    attn.heads //= N
    attn.groups //= N


def shard_mlp(mlp, group, reduce: bool = True):
    """A gated MLP by intermediate columns (``gate/up/down_proj`` or DeepSeek's ``w1/w3/w2``);
    ``reduce``: its output summed (else the caller sums it with others)."""
    gate, up, down = ("gate_proj", "up_proj", "down_proj") if "down_proj" in mlp else \
        ("w1", "w3", "w2")
    _rows(mlp[gate], group)
    _rows(mlp[up], group)
    if reduce:
        mlp[down] = shard_linear(mlp[down], "sharded-to-all", group=group)
    else:
        _columns(mlp[down], group)


def shard_moe(block, group):
    """A MoE block by every expert's intermediate columns, shared experts too: the partial
    outputs add up, so one all_sum after the block finishes it (the router is whole)."""
    experts = block.switch_mlp
    _rows(experts.gate_proj, group)
    _rows(experts.up_proj, group)
    _columns(experts.down_proj, group)
    for name in shared_experts(block):
        shard_mlp(block[name], group, reduce=False)
    block.__class__ = summed(type(block))
    block.sum_group = group
