"""Expert parallelism (``--distributed expert``): each MoE block's routed experts placed
whole on ranks, everything else replicated.

Rank r of n holds experts [r·E/n, (r+1)·E/n) of every MoE block (the trunk's and the MTP
head's), found by their mlx-lm experts module (``switch_mlp``: ``SwitchGLU`` / ``SwitchMLP``,
float or quantized). Every rank routes every token as one process does; the experts module
runs its own experts only, answering zero for a token's choice it does not hold (its gate
masked; the choice runs on the rank's first expert, so a rank reads only its own experts'
weights, the memory traffic that bounds decoding, while its FLOPs stay one process's), so a
block's output on a rank is its experts' share of the routed sum. The shared
expert(s) run on rank 0 only (the others hold none). One ``all_sum`` per MoE block adds the
shares: mlx-lm's own (``sharding_group``, placed before what must not be summed, e.g.
LongCat's identity experts), or one after the block for blocks without it (ours, MiMo-V2's).
Attention, dense MLPs, norms, embeddings and the output layer are whole on every rank and
computed identically, with no collective.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterator, List, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from .hybrid_shard import read_share


class _HeldExperts:
    """An experts module holding experts [first_expert, first_expert + held_experts)."""

    first_expert: int = 0
    held_experts: int = 0

    def __call__(self, x, indices):
        local = indices - self.first_expert
        held = (local >= 0) & (local < self.held_experts)
        y = super().__call__(x, mx.where(held, local, 0))  # a choice not held reads expert 0
        return mx.where(held[..., None], y, mx.zeros((), y.dtype))


class HeldSwitchGLU(_HeldExperts, SwitchGLU):
    pass


class HeldSwitchMLP(_HeldExperts, SwitchMLP):
    pass


HELD = {SwitchGLU: HeldSwitchGLU, SwitchMLP: HeldSwitchMLP}


class NoSharedExpert(nn.Module):
    """A shared expert held by rank 0 only: the other ranks add nothing."""

    def __call__(self, x):
        return mx.zeros_like(x)


@lru_cache(maxsize=None)
def summed(block_cls: type) -> type:
    """``block_cls`` whose output is summed over ``sum_group`` (a block without mlx-lm's
    ``sharding_group``; a tensor split's MoE block, ``stream_shard``)."""

    class Summed(block_cls):
        def __call__(self, x, *args):  # DeepSeek-V4's block also takes the token ids
            return mx.distributed.all_sum(super().__call__(x, *args), group=self.sum_group)

    Summed.__name__ = f"Summed{block_cls.__name__}"
    return Summed


def split_parts(text) -> List[nn.Module]:
    """What an expert split divides: the trunk layers and the MTP layers."""
    return list(text.model.layers) + (list(text.mtp.layers) if "mtp" in text else [])


def moe_blocks(module: nn.Module) -> Iterator[nn.Module]:
    """The MoE blocks inside ``module``: those whose ``switch_mlp`` is mlx-lm's experts."""
    for _, m in module.named_modules():
        if type(m.get("switch_mlp")) in HELD:
            yield m


def shared_experts(block: nn.Module) -> List[str]:
    """The names of a block's shared experts: its other children that end in a
    ``down_proj`` (``shared_experts``, ``shared_expert``, ``share_expert``) or are named so
    (DeepSeek-V4's ``shared_experts``, whose projections are ``w1``/``w2``/``w3``)."""
    return [name for name, child in block.children().items()
            if name != "switch_mlp" and isinstance(child, nn.Module)
            and ("down_proj" in child or name in ("shared_experts", "shared_expert"))]


def has_experts(text) -> bool:
    return any(next(moe_blocks(part), None) is not None for part in split_parts(text))


def expert_range(rank: int, size: int, count: int) -> Tuple[int, int]:
    return rank * count // size, (rank + 1) * count // size


def _num_experts(block) -> int:
    return next(v for _, v in tree_flatten(block.switch_mlp.parameters())).shape[0]


def expert_split_problem(text, size: int) -> str:
    """Why ``text``'s experts cannot be placed over ``size`` ranks ("" when they can)."""
    counts = {_num_experts(b) for part in split_parts(text) for b in moe_blocks(part)}
    if not counts:
        return f"{text.model_type} has no routed experts"
    if min(counts) < size:
        return f"{min(counts)} experts per layer cannot be placed on {size} ranks"
    for part in split_parts(text):
        for block in moe_blocks(part):
            latent_out = block.get("fc2_latent_proj")  # Nemotron-H: after the routed sum
            if latent_out is not None and "bias" in latent_out:
                return "a biased projection follows the routed experts (it would be summed)"
    return ""


def place_experts(block: nn.Module, group):
    """Keep this rank's experts of ``block`` and combine the ranks' shares after it."""
    rank, size = group.rank(), group.size()
    experts = block.switch_mlp
    first, end = expert_range(rank, size, _num_experts(block))
    experts.update(tree_map(lambda w: w[first:end], experts.parameters()))
    experts.__class__ = HELD[type(experts)]
    experts.first_expert, experts.held_experts = first, end - first
    if rank != 0:
        for name in shared_experts(block):
            block[name] = NoSharedExpert()
    if hasattr(block, "sharding_group"):  # mlx-lm's sum point
        block.sharding_group = group
    else:
        block.__class__ = summed(type(block))
        block.sum_group = group


def split_experts(text, group):
    """Place ``text``'s experts over ``group``. Each projection's slice is read and copied
    at once, one at a time: a slice is a view that keeps its whole stacked tensor alive, and
    reading one projection of one layer at a time bounds what a rank holds beyond its
    share (the rest, whole tensors, is read where it is)."""
    for part in split_parts(text):
        for block in moe_blocks(part):
            place_experts(block, group)
            for proj in block.switch_mlp.children().values():
                if isinstance(proj, nn.Module):
                    read_share(proj)


def bytes_not_held(text, rank: int, size: int) -> int:
    """Bytes of ``text`` (lazy parameters, shapes only) that rank ``rank`` does not hold
    under an expert split: the other ranks' routed experts, and the shared experts on
    every rank but 0."""
    dropped = 0
    for part in split_parts(text):
        for block in moe_blocks(part):
            first, end = expert_range(rank, size, _num_experts(block))
            for _, w in tree_flatten(block.switch_mlp.parameters()):
                dropped += w.nbytes - w.nbytes // w.shape[0] * (end - first)
            if rank != 0:
                dropped += sum(v.nbytes for name in shared_experts(block)
                               for _, v in tree_flatten(block[name].parameters()))
    return dropped
