"""Loading a block drafter (a local directory or a hub id) and checking it against the trunk
it will draft for. ``--draft-model`` names either a split MTP drafter or a block drafter:
``kind_of`` tells them apart by the config (``--draft-kind`` where it cannot tell).
"""

from __future__ import annotations

from typing import Optional

import mlx.nn as nn

from ...models.io.files import load_safetensors, read_json_object
from ...errors import CheckpointError
from ...models.io.loader import load_config, resolve_model_path, weight_files
from ...models.io.split_drafter import is_drafter_config
from . import KINDS, dsv4_dspark
from .base import BlockDraftModel
from .config import DrafterConfig, detect_kind, fit_to_tensors, parse_block_config


class BlockDrafterError(CheckpointError):
    pass


def kind_of(config: dict) -> Optional[str]:
    """The block-drafter kind a config declares (None: not a block drafter it knows)."""
    if dsv4_dspark.declares_stages(config):
        return dsv4_dspark.KIND
    try:
        return detect_kind(config)
    except ValueError as e:
        raise BlockDrafterError(str(e)) from None


def kind_for(spec: str, kind: Optional[str] = None) -> Optional[str]:
    """The block-drafter kind of the drafter ``spec`` names (``kind``: ``--draft-kind``,
    where the config does not say); None: a split MTP drafter. A kind the config
    contradicts is refused."""
    config = read_config(spec)[1]
    declared = kind_of(config)
    if kind is None or kind == declared:
        return declared
    if declared is not None or is_drafter_config(config):
        raise BlockDrafterError(f"--draft-kind {kind}: {spec} is a "
                                f"{declared or 'split MTP'} drafter, not a {kind} one")
    return kind


def parse(config: dict, kind: Optional[str], where: str) -> DrafterConfig:
    """``parse_block_config``, its ValueError as one ``BlockDrafterError`` line."""
    try:
        return parse_block_config(config, kind)
    except ValueError as e:
        raise BlockDrafterError(f"{where}: unusable block drafter config: {e}") from None


def read_config(spec: str) -> tuple:
    """(local directory, config) of the drafter ``spec`` names (a hub id is downloaded)."""
    path = resolve_model_path(str(spec))
    return path, read_json_object(path / "config.json", "drafter config")


def load_block_drafter(spec: str, kind: Optional[str] = None) -> BlockDraftModel:
    """The drafter at ``spec`` (``kind``: when its config does not say), its weights opened
    lazily: they are read by the model that drafts with it (``use_block_drafter``), so a
    pipeline rank that holds a stand-in never reads them."""
    path, config = read_config(spec)
    if dsv4_dspark.declares_stages(config):
        return own_stages(path, config, spec)
    parsed = parse(config, kind, str(spec))
    weights = {k: v for f in weight_files(path) for k, v in load_safetensors(f).items()}
    try:
        drafter = KINDS[parsed.kind](fit_to_tensors(parsed, weights))
        weights = drafter.sanitize(weights)
        quantize_like(drafter, config.get("quantization"), weights)
        drafter.load_weights(list(weights.items()))
    except ValueError as e:
        raise BlockDrafterError(f"{spec}: the {parsed.kind} weights do not fit its config: "
                                f"{str(e).splitlines()[0]}") from None
    drafter.eval()
    return drafter


def own_stages(path, config: dict, spec: str) -> BlockDraftModel:
    """The DSpark stages a DeepSeek-V4 checkpoint carries under ``mtp.*``."""
    try:
        drafter = dsv4_dspark.load_stages(path, config)
    except ValueError as e:
        raise BlockDrafterError(f"{spec}: its DSpark stages cannot be loaded: "
                                f"{str(e).splitlines()[0]}") from None
    drafter.eval()  # its weights are read where a model keeps it (use_block_drafter)
    return drafter


def own_drafter(model_spec: Optional[str]) -> Optional[tuple]:
    """``(model_spec, None)`` when the model's own checkpoint carries a block drafter (a
    DeepSeek-V4 with DSpark stages), for ``attach_block_drafter``; else None."""
    if model_spec is None:
        return None
    config = load_config(resolve_model_path(str(model_spec)))  # the loader's own errors
    return (model_spec, None) if dsv4_dspark.declares_stages(config) else None


def quantize_like(drafter: BlockDraftModel, quantization: Optional[dict], weights: dict):
    """Quantize the modules the checkpoint stores quantized (``convert --draft-q-bits``), so
    their matmuls run through mlx's quantized ops."""
    if not quantization:
        return
    nn.quantize(drafter, group_size=quantization["group_size"], bits=quantization["bits"],
                mode=quantization.get("mode", "affine"),
                class_predicate=lambda path, _: f"{path}.scales" in weights)


def check_fits(drafter: BlockDraftModel, model, where: str = "the drafter"):
    """Refuse a drafter that cannot read ``model``'s taps or speak its vocabulary."""
    spec, args = drafter.spec, model.text.args
    if not model.capabilities.taps:
        raise BlockDrafterError(f"{where}: this model offers no hidden-state taps for a "
                                f"{spec.kind} drafter")
    problems = []
    if spec.hidden_size != args.hidden_size:
        problems.append(f"hidden size {spec.hidden_size} != the model's {args.hidden_size}")
    if spec.vocab_size != args.vocab_size:
        problems.append(f"vocabulary {spec.vocab_size} != the model's {args.vocab_size}")
    try:
        model.check_taps(spec.target_layer_ids)
    except ValueError as e:
        problems.append(f"taps layers {list(spec.target_layer_ids)}: {e}")
    if spec.mask_token_id is not None and not 0 <= spec.mask_token_id < args.vocab_size:
        problems.append(f"mask token {spec.mask_token_id} is outside the vocabulary")
    if problems:
        raise BlockDrafterError(f"{where} ({spec.kind}) does not fit this model: "
                                + "; ".join(problems))


def attach_block_drafter(model, spec: str, kind: Optional[str] = None) -> BlockDraftModel:
    """Load the drafter ``spec`` names, check it against ``model`` and draft with it."""
    drafter = load_block_drafter(spec, kind)
    check_fits(drafter, model, str(spec))
    model.use_block_drafter(drafter)
    return drafter


def describe(config: dict) -> Optional[dict]:
    """What ``inspect`` says of a block drafter's config (None: not one; a model carrying
    its own drafter is a model: ``describe_own``)."""
    if kind_of(config) is None or dsv4_dspark.declares_stages(config):
        return None
    return summary(parse(config, None, "drafter").spec, config.get("quantization"))


def describe_own(config: dict) -> Optional[dict]:
    """What ``inspect`` says of the drafter a model's own checkpoint carries (None: none)."""
    if not dsv4_dspark.declares_stages(config):
        return None
    try:
        spec = dsv4_dspark.stage_spec(config)
    except ValueError as e:
        raise BlockDrafterError(str(e)) from None
    return summary(spec, config.get("quantization"))


def summary(spec, quantization: Optional[dict]) -> dict:
    return {"kind": spec.kind, "taps": list(spec.target_layer_ids), "block_size": spec.block_size,
            "max_draft": spec.max_draft, "autoregressive": spec.autoregressive,
            "hidden_size": spec.hidden_size,
            "vocab_size": spec.vocab_size, "quantization": quantization}
