"""What each rank of a split model holds, decided before any tensor is read.

The model is built and its checkpoint opened lazily (``mx.load`` reads only the
safetensors headers), so parameter shapes give every rank's bytes: ``load_distributed``
checks its own share against the memory limit before reading it, and ``inspect --ranks``
prints the plan for every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from mlx.utils import tree_flatten

from .blocks.expert_split import bytes_not_held
from .io.loader import (ModelLoadError, build_model, loadable_weights, model_config,
                        parameter_bytes, read_drafter)


class DistributedError(ModelLoadError):
    """The model cannot be split this way over this group (a user error: exit 2)."""


def split_layers(layer_bytes: Sequence[int], head_bytes: int, size: int) -> List[Tuple[int, int]]:
    """Contiguous layer ranges per rank, balanced by bytes; rank 0 (which also holds
    ``head_bytes``) gets the last layers, rank ``size-1`` the first ones."""
    n = len(layer_bytes)
    if n < size:
        raise DistributedError(f"{n} layers cannot be split over {size} ranks")
    target = (sum(layer_bytes) + head_bytes) / size
    ranges, start = [None] * size, 0
    for stage, rank in enumerate(range(size - 1, 0, -1)):
        end, acc = start, 0
        left_after = size - 1 - stage  # ranks still to fill, rank 0 included
        while end < n - left_after and (end == start or acc + layer_bytes[end] <= target):
            acc += layer_bytes[end]
            end += 1
        ranges[rank], start = (start, end), end
    ranges[0] = (start, n)
    return ranges


@dataclass
class RankShare:
    """One rank's part: its trunk layers [start, end) and the bytes of its weights."""

    rank: int
    layers: Tuple[int, int]
    weight_bytes: int
    holds_head: bool  # the output projection and the MTP head(s)


def open_lazily(path: Path, mtp: bool = True, mtp_hidden: Optional[str] = None,
                dtype=None, mtp_model=None):
    """The model for the checkpoint at ``path`` with its weights attached unread; returns
    (model, config). Every rank decides the dtype from the whole checkpoint, so all pick
    the same one. ``mtp_model``: a split MTP drafter whose head replaces the model's."""
    config = model_config(path, mtp, mtp_hidden)
    drafter = read_drafter(mtp_model, config, path) if mtp and mtp_model else None
    model = build_model(config, path / "config.json")
    weights = loadable_weights(model, path, config, dtype, drafter)
    wanted = {k for k, _ in tree_flatten(model.parameters())}
    missing = sorted(wanted - weights.keys())
    if missing:
        raise ModelLoadError(f"Weights in {path} do not match the model: missing {missing[:3]}")
    model.load_weights([(k, v) for k, v in weights.items() if k in wanted], strict=True)
    return model, config


def rank_shares(model, mode: str, size: int) -> List[RankShare]:
    """Every rank's layers and weight bytes. Pipeline: contiguous layers balanced by
    bytes, rank 0 also holding everything outside the layers (embedding, final norm,
    output projection, MTP head), the others what a tap reads (``tap_modules``), the last
    rank the embedding too. Tensor: every layer
    on every rank, each layer's bytes divided by ``size`` (an estimate: norms, routers
    and DSA indexers stay whole), the rest whole on every rank. Expert: every layer on
    every rank, less the routed experts other ranks hold (and, but on rank 0, the shared
    experts), exactly."""
    text = model.text
    layer_bytes = [parameter_bytes(l) for l in text.model.layers]
    n, total = len(layer_bytes), parameter_bytes(model)
    outside = total - sum(layer_bytes)
    if mode == "tensor":
        share = outside + sum(layer_bytes) // size
        return [RankShare(r, (0, n), share, True) for r in range(size)]
    if mode == "expert":
        return [RankShare(r, (0, n), total - bytes_not_held(text, r, size), True)
                for r in range(size)]
    embed = parameter_bytes(text.model.embed_tokens)
    head = embed + sum(parameter_bytes(m) for m in text.output_modules())
    head += sum(parameter_bytes(text[name]) for name in ("lm_head", "mtp") if name in text)
    # Layers a stage may not begin at ride with the layer before them.
    starts = [i for i in range(n) if i == 0 or text.stage_may_start(i)]
    ends = starts[1:] + [n]
    units = split_layers([sum(layer_bytes[a:b]) for a, b in zip(starts, ends)], head, size)
    ranges = [(starts[a], ends[b - 1]) for a, b in units]
    taps = sum(parameter_bytes(m) for m in text.tap_modules())  # held by every stage
    shares = []
    for rank, (start, end) in enumerate(ranges):
        own = sum(layer_bytes[start:end])
        own += outside if rank == 0 else taps + (embed if rank == size - 1 else 0)
        shares.append(RankShare(rank, (start, end), own, rank == 0))
    return shares
