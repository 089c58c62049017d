"""Which block drafter a directory's ``config.json`` describes, in every published packaging.

``parse_block_config(config)`` returns a ``DrafterConfig``: the kind, its ``BlockSpec`` (taps
0-based: "the residual after trunk layer i"), the drafter's transformer shape and the kind's
own settings. Packagings recognised:

- z-lab DFlash / DFlash2: ``architectures`` ``DFlashDraftModel`` / ``DFlash2DraftModel``,
  ``dflash_config{target_layer_ids, mask_token_id, block_size?}`` (older checkpoints keep
  ``block_size`` at the top level); taps already 0-based.
- DSpark, DeepSpec-native (``Qwen3DSparkModel``): the fields at the top level; every slot
  predicts unless ``logits_start``/``sample_from_anchor`` says otherwise. LiquidAI's variant
  nests the ids in an untagged ``dflash_config``.
- DSpark, SpecForge: ``dflash_config.projector_type == "dspark"``; every slot predicts.
- speculators (``speculators_model_type`` ``dspark`` / ``eagle3``): the backbone in
  ``transformer_layer_config``; ``(eagle_)aux_hidden_state_layer_ids`` count the embedding
  output as 0, so they are shifted down by one here. A DSpark block's anchor slot follows
  from ``block_size - speculative_tokens`` (else ``sample_from_anchor``, else a pure anchor).
- a reduced draft vocabulary: ``draft_vocab_size`` (< ``vocab_size``; ``d2t`` in the weights).

Anything else, or fields that contradict each other: ``ValueError`` naming the field and
what was expected (the loader turns it into exit 2).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Tuple

from .base import BlockSpec
from .layers import DraftArgs

KIND_NAMES = ("dflash", "dflash2", "dspark", "eagle3")


@dataclass(frozen=True)
class BlockSettings:
    """A kind's own knobs (each kind reads the ones it has; the defaults mean "absent")."""

    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: Optional[float] = None
    # block rows see only earlier block rows; None: the sliding layers do (z-lab's default)
    causal: Optional[bool] = False
    draft_vocab_size: Optional[int] = None  # a reduced head (d2t maps it to target ids)
    # DFlash2
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    # DSpark
    markov_rank: int = 0
    confidence_head: bool = False
    confidence_with_markov: bool = True
    own_embed: bool = True
    own_head: bool = True
    offset_norms: bool = False  # RMSNorm weights stored as w - 1 (Qwen3.5 house style)
    # EAGLE-3
    norm_before_fc: bool = False
    norm_before_residual: bool = False


@dataclass(frozen=True)
class DrafterConfig:
    kind: str
    spec: BlockSpec
    args: DraftArgs
    settings: BlockSettings


def _need(c: dict, key: str, where: str):
    if c.get(key) is None:
        raise ValueError(f"drafter config: {where}{key} is missing")
    return c[key]


def _int(c: dict, key: str, where: str = "", default=None) -> int:
    value = c.get(key, default) if default is not None else _need(c, key, where)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"drafter config: {where}{key} must be an integer, not {value!r}")
    return value


def _draft_args(c: dict, where: str = "") -> DraftArgs:
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    heads = _int(c, "num_attention_heads", where)
    hidden = _int(c, "hidden_size", where)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    layers = _int(c, "num_hidden_layers", where)
    return DraftArgs(
        hidden_size=hidden, intermediate_size=_int(c, "intermediate_size", where),
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=_int(c, "num_key_value_heads", where, heads),
        head_dim=_int(c, "head_dim", where, hidden // heads),
        vocab_size=_int(c, "vocab_size", where),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=float(c.get("rope_theta", rope.get("rope_theta", 10000.0))),
        max_position_embeddings=int(c.get("max_position_embeddings", 4096)),
        rope_scaling=scaling, windows=_layer_windows(c, layers, where))


def _taps(ids, field: str, shift: int, num_target_layers: Optional[int]) -> Tuple[int, ...]:
    if not isinstance(ids, (list, tuple)) or not ids or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"drafter config: {field} must be a non-empty list of layer indices, "
                         f"not {ids!r}")
    taps = tuple(i - shift for i in ids)
    if min(taps) < 0:
        raise ValueError(f"drafter config: {field} {list(ids)} taps the embedding output "
                         f"(id {shift - 1} in this packaging), which is not tapped: every id "
                         f"must be >= {shift}")
    if num_target_layers is not None and max(taps) >= num_target_layers:
        raise ValueError(f"drafter config: {field} {list(ids)} taps past the trunk's "
                         f"{num_target_layers} layers")
    return taps


def _layer_windows(c: dict, layers: int, where: str) -> Tuple[Optional[int], ...]:
    """Each layer's sliding window over the context (None: full attention)."""
    types = c.get("layer_types") or ["full_attention"] * layers
    if len(types) != layers or set(types) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"drafter config: {where}layer_types {types} must name full_attention "
                         f"or sliding_attention for each of the {layers} layers")
    window = c.get("sliding_window")
    if "sliding_attention" in types and not (isinstance(window, int) and window > 1):
        raise ValueError(f"drafter config: {where}sliding_window {window!r} must be an integer "
                         "> 1 for sliding_attention layers")
    if c.get("attention_sink_bias"):
        raise ValueError("drafter config: attention_sink_bias (per-head sinks) is not supported")
    return tuple(window if t == "sliding_attention" else None for t in types)


def _draft_vocab(c: dict, vocab: int) -> Optional[int]:
    size = c.get("draft_vocab_size")
    if size is None or size == vocab:
        return None
    if not isinstance(size, int) or not 0 < size < vocab:
        raise ValueError(f"drafter config: draft_vocab_size {size!r} must be an integer "
                         f"below vocab_size {vocab}")
    return size


def _spec(kind, args, taps, block_size, mask, anchor_predicts, num_target_layers):
    if block_size < (1 if anchor_predicts else 2):
        raise ValueError(f"drafter config: block_size {block_size} leaves no draft slot")
    if mask is not None and not 0 <= mask < args.vocab_size:
        raise ValueError(f"drafter config: mask_token_id {mask} is outside the vocabulary "
                         f"(0..{args.vocab_size - 1})")
    return BlockSpec(kind=kind, hidden_size=args.hidden_size, vocab_size=args.vocab_size,
                     target_layer_ids=taps, block_size=block_size, mask_token_id=mask,
                     anchor_predicts=anchor_predicts, num_target_layers=num_target_layers)


def _zlab(c: dict, kind: str) -> DrafterConfig:
    """z-lab DFlash / DFlash2 (``dflash_config``)."""
    d = c.get("dflash_config")
    if not isinstance(d, dict):
        raise ValueError("drafter config: dflash_config is missing (expected an object with "
                         "target_layer_ids and mask_token_id)")
    args = _draft_args(c)
    n_target = c.get("num_target_layers")
    taps = _taps(_need(d, "target_layer_ids", "dflash_config."), "dflash_config.target_layer_ids",
                 0, n_target)
    block = d.get("block_size", c.get("block_size"))
    if not isinstance(block, int):
        raise ValueError("drafter config: block_size (top level or in dflash_config) is missing")
    settings = dict(
        input_embedding_scale=float(d.get("input_embedding_scale", 1.0)),
        output_multiplier=float(d.get("output_multiplier", 1.0)),
        final_logit_softcapping=d.get("final_logit_softcapping",
                                      c.get("final_logit_softcapping")),
        causal=c.get("is_causal", d.get("causal")))
    if kind == "dflash2":
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            settings[key] = _int(d, key, "dflash_config.")
        if args.hidden_size % settings["conv_group_size"]:
            raise ValueError(f"drafter config: dflash_config.conv_group_size "
                             f"{settings['conv_group_size']} must divide hidden_size "
                             f"{args.hidden_size}")
        if not 0 < settings["selector_top_k"] <= args.vocab_size:
            raise ValueError("drafter config: dflash_config.selector_top_k must be in "
                             f"1..{args.vocab_size}")
    spec = _spec(kind, args, taps, block, _int(d, "mask_token_id", "dflash_config."), False,
                 n_target)
    return DrafterConfig(kind, spec, args, BlockSettings(**settings))


def _anchor_slot(block: int, spec_tokens, sample_from_anchor, default: bool) -> bool:
    """Whether slot 0 predicts (DeepSpec) or is a pure anchor (DFlash-derived heads)."""
    if spec_tokens is not None:
        if block - spec_tokens not in (0, 1):
            raise ValueError(f"drafter config: speculative_tokens {spec_tokens} must be "
                             f"block_size {block} (every slot predicts) or block_size - 1")
        return block == spec_tokens
    if isinstance(sample_from_anchor, bool):
        return sample_from_anchor
    return default


def _dspark_settings(c: dict, d: dict, backbone: dict, vocab: int,
                     causal: bool = False) -> BlockSettings:
    """``backbone``: the config holding the drafter's ``model_type`` (a Qwen3 block; a
    ``qwen3_5`` one stores its norm weights as offsets from one)."""
    model_type = backbone.get("model_type", "qwen3")
    if "qwen3" not in model_type and model_type != "llama":
        raise ValueError(f"drafter config: model_type {model_type!r}: only Qwen3/Llama DSpark "
                         "backbones are supported (not gemma4-style blocks)")
    if backbone.get("enable_qwen35_gated_q_proj"):
        raise ValueError("drafter config: enable_qwen35_gated_q_proj (gated attention) is not "
                         "supported in a DSpark drafter")

    def pick(key, default):
        return c.get(key, d.get(key, default))
    return BlockSettings(
        draft_vocab_size=_draft_vocab(c, vocab), offset_norms=model_type == "qwen3_5",
        final_logit_softcapping=pick("final_logit_softcapping", None),
        causal=bool(c.get("dflash_query_causal", d.get("causal", causal))),
        markov_rank=int(pick("markov_rank", 0)),
        confidence_head=bool(pick("enable_confidence_head", True)),
        confidence_with_markov=bool(pick("confidence_head_with_markov", True)),
        own_embed=bool(c.get("has_own_embed", True)), own_head=bool(c.get("has_lm_head", True)))


def _dspark_native(c: dict) -> DrafterConfig:
    """DeepSpec (top-level fields), SpecForge (tagged dflash_config) and LiquidAI (untagged
    dflash_config) DSpark heads: the ids are 0-based like z-lab's."""
    d = c.get("dflash_config") or {}
    src, where = (c, "") if "target_layer_ids" in c else (d, "dflash_config.")
    args = _draft_args(c)
    n_target = c.get("num_target_layers", d.get("num_target_layers"))
    taps = _taps(_need(src, "target_layer_ids", where), f"{where}target_layer_ids", 0, n_target)
    block = _int(c if "block_size" in c else d, "block_size", "")
    start = c.get("logits_start")
    anchor = (start == 0) if start is not None else _anchor_slot(
        block, None, c.get("sample_from_anchor", d.get("sample_from_anchor")), True)
    mask = _int(src if "mask_token_id" in src else c, "mask_token_id", where)
    spec = _spec("dspark", args, taps, block, mask, anchor, n_target)
    return DrafterConfig("dspark", spec, args, _dspark_settings(c, d, c, args.vocab_size))


def _speculators(c: dict, kind: str) -> DrafterConfig:
    """vLLM speculators: the backbone in transformer_layer_config, ids shifted by one."""
    tlc = c.get("transformer_layer_config")
    if not isinstance(tlc, dict):
        raise ValueError("drafter config: transformer_layer_config is missing (expected the "
                         "drafter's backbone config)")
    args = _draft_args(tlc, "transformer_layer_config.")
    methods = (c.get("speculators_config") or {}).get("proposal_methods") or [{}]
    spec_tokens = methods[0].get("speculative_tokens")
    if kind == "eagle3":
        key = ("eagle_aux_hidden_state_layer_ids" if "eagle_aux_hidden_state_layer_ids" in c
               else "aux_hidden_state_layer_ids")
        taps = _taps(_need(c, key, ""), key, 1, None)
        if len(taps) != 3:
            raise ValueError(f"drafter config: {key} must name 3 layers, not {len(taps)}")
        reduced = _draft_vocab(c, args.vocab_size)
        settings = BlockSettings(  # a frozen embedding is the target's own
            draft_vocab_size=reduced, own_embed=bool(c.get("embed_requires_grad", False)),
            own_head=bool(reduced or not c.get("tie_word_embeddings", False)),
            norm_before_fc=bool(c.get("norm_before_fc", False)),
            norm_before_residual=bool(c.get("norm_before_residual", False)))
        spec = _spec(kind, args, taps, int(spec_tokens or 3) + 1, None, False, None)
        trunk_hidden = c.get("target_hidden_size") or args.hidden_size  # fc reads 3 of them
        if not isinstance(trunk_hidden, int):
            raise ValueError(f"drafter config: target_hidden_size must be an integer, not "
                             f"{trunk_hidden!r}")
        return DrafterConfig(kind, replace(spec, hidden_size=trunk_hidden, autoregressive=True),
                             args, settings)
    taps = _taps(_need(c, "aux_hidden_state_layer_ids", ""), "aux_hidden_state_layer_ids", 1,
                 None)
    block = _int(c, "block_size")
    anchor = _anchor_slot(block, spec_tokens, c.get("sample_from_anchor"), False)
    spec = _spec(kind, args, taps, block, _int(c, "mask_token_id"), anchor, None)
    sliding_causal = any(args.windows) and not c.get("sliding_window_non_causal", False)
    return DrafterConfig(kind, spec, args, _dspark_settings(c, {}, tlc, args.vocab_size,
                                                            sliding_causal))


def detect_kind(c: dict) -> Optional[str]:
    """The kind a config names, or None when it does not say (``--draft-kind`` decides)."""
    spec_type = c.get("speculators_model_type")
    if spec_type is not None:
        if spec_type not in ("dspark", "eagle3"):
            raise ValueError(f"drafter config: speculators_model_type {spec_type!r} is not a "
                             "block drafter (expected 'dspark' or 'eagle3')")
        return spec_type
    arch = " ".join(c.get("architectures") or ())
    if "DFlash2DraftModel" in arch:
        return "dflash2"
    if (c.get("dflash_config") or {}).get("projector_type") == "dspark" or "DSpark" in arch:
        return "dspark"
    if "DFlashDraftModel" in arch:
        return "dflash"
    return None


def parse_block_config(c: dict, kind: Optional[str] = None) -> DrafterConfig:
    """``c``: a drafter's config.json; ``kind``: the user's ``--draft-kind``, needed only
    when the config does not name its kind, and refused when it names another."""
    if not isinstance(c, dict):
        raise ValueError("drafter config: config.json must hold a JSON object")
    if kind is not None and kind not in KIND_NAMES:
        raise ValueError(f"--draft-kind {kind!r}: expected one of {', '.join(KIND_NAMES)}")
    if "block_size" not in c and any(k.startswith("dspark_") for k in c):
        raise ValueError("drafter config: dspark_* fields belong to a target with its DSpark "
                         "stages inside (DeepSeek-V4), not a standalone drafter")
    found = detect_kind(c)
    if found is None and kind is None:
        raise ValueError("drafter config: architectures/speculators_model_type name no block "
                         f"drafter; pass --draft-kind ({', '.join(KIND_NAMES)})")
    if found is not None and kind is not None and found != kind:
        raise ValueError(f"--draft-kind {kind} contradicts the config, which describes {found}")
    kind = found or kind
    if "speculators_model_type" in c or (kind == "eagle3"):
        return _speculators(c, kind)
    if kind == "dspark":
        return _dspark_native(c)
    return _zlab(c, kind)


def fit_to_tensors(config: DrafterConfig, names) -> DrafterConfig:
    """The config as the checkpoint's tensor ``names`` settle it: a DSpark or EAGLE-3 head
    that ships no ``embed_tokens`` / ``lm_head`` / confidence head uses the target's (or none);
    a frozen EAGLE-3 embedding is the target's even when shipped (no second copy)."""
    if config.kind not in ("dspark", "eagle3"):
        return config
    names, s = set(names), config.settings
    own_head = "lm_head.weight" in names
    if s.draft_vocab_size and not own_head:
        raise ValueError(f"{config.kind}: draft_vocab_size {s.draft_vocab_size} needs the "
                         "drafter's own lm_head.weight, which the checkpoint lacks")
    if s.draft_vocab_size and "d2t" not in names:
        raise ValueError(f"{config.kind}: draft_vocab_size {s.draft_vocab_size} needs the d2t "
                         "table, which the checkpoint lacks")
    own_embed = "embed_tokens.weight" in names and (config.kind == "dspark" or s.own_embed)
    confidence = s.confidence_head and "confidence_head.proj.weight" in names
    return replace(config, settings=replace(s, own_embed=own_embed, own_head=own_head,
                                            confidence_head=confidence))
