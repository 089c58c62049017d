"""Checkpoint layout, both ways: Hugging Face <-> MLX weights, and the config fields they depend on.

Raw Hugging Face checkpoints (and transformers exports) store
* the trunk under ``model.language_model.*`` (multimodal Qwen3.5/3.6) or ``model.*``
  (Qwen3-Next, flat ``*ForCausalLM``), the MTP head at top-level ``mtp.*`` (some
  re-exports: ``model.mtp.*``), ``lm_head.*`` (absent when tied);
* zero-centred RMSNorm weights, applied as ``x * (1 + w)``;
* conv1d weights as (C, 1, K);
* MoE experts fused (``experts.gate_up_proj`` [E, 2I, H], gate half first;
  ``experts.down_proj`` [E, H, I]) or per expert (``experts.{e}.{gate,up,down}_proj.weight``),
  the MTP layer's possibly in the other form than the trunk's.
MLX conversions (ours and mlx-lm's) store applied norms, (C, K, 1) convs and stacked
``switch_mlp`` experts. ``sanitize_text_weights`` reads any mix of the two;
``to_hf`` writes the Hugging Face form.
"""

from __future__ import annotations

import copy
import logging
import re
from typing import Dict, Iterable, List, Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from ...errors import CheckpointError  # noqa: F401 (re-exported)

log = logging.getLogger("mlx_mtp")


class MissingMTPWeightsError(CheckpointError):
    pass


# --------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------

# MTP layer count, in the order runtimes read it: Qwen3.5/3.6 (`mtp_num_hidden_layers`),
# DeepSeek/GLM/Qwen3-Next re-exports (`num_nextn_predict_layers`), transformers'
# generic MTP path (`num_mtp_layers`), GGUF-style and training-framework exports
# (`nextn_predict_layers`, `num_mtp_modules`), vLLM draft configs (`n_predict`).
MTP_LAYER_COUNT_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers", "num_mtp_layers",
                        "nextn_predict_layers", "num_mtp_modules", "n_predict")
LAYER_TYPES = ("linear_attention", "full_attention")
# The hybrid (Gated DeltaNet) families; the others are attention-trunk ones.
QWEN_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def text_config(config: dict) -> dict:
    """The language model's config: ``text_config`` of a multimodal config, else the config."""
    return config.get("text_config", config)


def family(config: dict) -> str:
    """``qwen3_5``, ``qwen3_5_moe`` or ``qwen3_next`` (also for ``*_text`` and ``*_mtp`` types)."""
    name = config.get("model_type") or text_config(config).get("model_type") or ""
    for suffix in ("_text", "_mtp"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    if name == "qwen3_5" and text_config(config).get("num_experts", 0):
        name = "qwen3_5_moe"  # vLLM's `qwen3_5_mtp` covers both
    return name


def config_mtp_layers(config: dict) -> int:
    """MTP layers the config declares (Qwen3-Next configs declare none and ship one)."""
    text = text_config(config)
    for c in (text, config):
        for key in MTP_LAYER_COUNT_KEYS:
            if c.get(key) is not None:
                return int(c[key])
    return 1 if family(config) == "qwen3_next" else 0


def set_config_mtp_layers(config: dict, n: int):
    """Record ``n`` MTP layers in every count field the config has (or the family's own)."""
    text = text_config(config)
    present = [(c, k) for c in (text, config) for k in MTP_LAYER_COUNT_KEYS if k in c]
    for c, k in present:
        c[k] = n
    if not present:
        if family(config) != "qwen3_next":
            text["mtp_num_hidden_layers"] = n
        elif n != 1:  # the official Qwen3-Next config leaves the count implicit (1)
            text["num_nextn_predict_layers"] = n


def tie_word_embeddings(config: dict) -> bool:
    # A nested (multimodal) config's own flag decides, as in transformers; its
    # text_config may say otherwise (transformers 5 writes the default there).
    if "text_config" in config and "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    return bool(text_config(config).get("tie_word_embeddings", False))


def config_quantization(config: dict) -> Optional[dict]:
    return config.get("quantization") or text_config(config).get("quantization")


def layer_types(text: dict) -> List[str]:
    """Per-layer ``linear_attention`` / ``full_attention``: ``layer_types`` (transformers 5),
    else the periodic ``full_attention_interval``."""
    n = int(text.get("num_hidden_layers", 0))
    types = text.get("layer_types")
    if types is None:
        interval = int(text.get("full_attention_interval", 4))
        if interval < 1:
            raise CheckpointError(f"full_attention_interval must be >= 1 (got {interval}).")
        return [LAYER_TYPES[(i + 1) % interval == 0] for i in range(n)]
    unknown = sorted({t for t in types if t not in LAYER_TYPES})
    if unknown:
        raise CheckpointError(
            f"layer_types has unsupported entries {unknown}; this model family has only "
            f"{' and '.join(LAYER_TYPES)} layers.")
    if len(types) < n:
        raise CheckpointError(
            f"layer_types lists {len(types)} layers but num_hidden_layers is {n}.")
    return list(types[:n])  # longer lists may append the MTP layers


def periodic_interval(types: List[str]) -> Optional[int]:
    """The ``full_attention_interval`` that reproduces ``types``, if one does."""
    for interval in range(1, len(types) + 1):
        if [LAYER_TYPES[(i + 1) % interval == 0] for i in range(len(types))] == types:
            return interval
    return None


def args_dict(config: dict) -> dict:
    """The text config with every field resolved the way this package reads it."""
    text = dict(text_config(config))
    text["tie_word_embeddings"] = tie_word_embeddings(config)
    text["mtp_num_hidden_layers"] = config_mtp_layers(config)
    if text["mtp_num_hidden_layers"] and text.get("mtp_use_dedicated_embeddings"):
        # No released checkpoint sets it; vLLM and SGLang share the trunk's embeddings too.
        raise CheckpointError(
            "mtp_use_dedicated_embeddings is true: MTP heads with their own embedding table "
            "are not supported. Run with --no-mtp to use the model without its head.")
    text["layer_types"] = layer_types(text)
    if not text.get("model_type"):
        text["model_type"] = config.get("model_type", "")
    return text


def hf_config(family_name: str, text: dict, nested: bool = True) -> dict:
    """A Hugging Face config.json for ``text``: Qwen3.5 nested (``...ForConditionalGeneration``)
    or flat (``...ForCausalLM``, ``model_type: qwen3_5_text``); Qwen3-Next always flat."""
    if family_name == "qwen3_next":
        return dict(text)
    arch = "Qwen3_5MoeForConditionalGeneration" if family_name == "qwen3_5_moe" else \
        "Qwen3_5ForConditionalGeneration"
    text = dict(text, model_type=f"{family_name}_text")
    if not nested:
        return dict(text, architectures=[arch.replace("ConditionalGeneration", "CausalLM")])
    return {"architectures": [arch], "model_type": family_name, "text_config": text,
            "tie_word_embeddings": text.get("tie_word_embeddings", False)}


def mlx_config(config: dict) -> dict:
    """config.json for an MLX conversion that plain mlx-lm loads too.

    mlx-lm has no module for a flat ``qwen3_5*_text`` config, reads the attention
    pattern only from ``full_attention_interval`` and ``tie_word_embeddings`` only
    from ``text_config``: nest flat Qwen3.5 configs and write those fields where it
    reads them. The vision config goes (the tower is not converted).
    """
    config = copy.deepcopy(config)
    config.pop("_name_or_path", None)
    config.pop("vision_config", None)
    name = family(config)
    if name not in QWEN_FAMILIES:  # attention-trunk families: mlx-lm reads the HF config
        return config
    if name != "qwen3_next" and "text_config" not in config:
        text = dict(config, model_type=f"{name}_text")
        arch = [a.replace("ForCausalLM", "ForConditionalGeneration")
                for a in config.get("architectures", [])]
        config = {"architectures": arch, "model_type": name, "text_config": text,
                  "tie_word_embeddings": text.get("tie_word_embeddings", False)}
    text = text_config(config)
    text["tie_word_embeddings"] = tie_word_embeddings(config)
    config["model_type"] = name  # vLLM's *_mtp draft types are unknown to mlx-lm
    if "text_config" in config:
        config["tie_word_embeddings"] = text["tie_word_embeddings"]
        text["model_type"] = f"{name}_text"
    interval = periodic_interval(layer_types(text))
    if interval is not None:
        text["full_attention_interval"] = interval
    else:  # a stale interval would silently build the wrong layers in mlx-lm
        text.pop("full_attention_interval", None)
    return config


# --------------------------------------------------------------------------
# Weight names
# --------------------------------------------------------------------------

_MTP_LAYER_RE = re.compile(r"(?:^|\.)mtp\.(?:layers\.)?(\d+)\.")  # DeepSeek-V4: mtp.{i}.


def is_mtp_key(key: str) -> bool:
    """``mtp.*`` (raw HF), ``model.mtp.*`` or ``language_model.mtp.*`` (MLX)."""
    return key.startswith("mtp.") or ".mtp." in key


def count_mtp_layers(keys: Iterable[str]) -> int:
    found = [int(m.group(1)) for k in keys if (m := _MTP_LAYER_RE.search(k))]
    return max(found) + 1 if found else 0


# The vision side of multimodal checkpoints (Qwen3.5/3.6; Step-3.7's tower and projector).
VISION_PREFIXES = ("model.visual", "visual.", "vision_tower", "model.vision", "vision_model.",
                   "vit_large_projector.", "model.multi_modal_projector.")


def text_weight_names(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """Keys relative to the language model (``model.*``, ``lm_head.*``, ``mtp.*``);
    vision tensors dropped."""
    out = {}
    for k, v in weights.items():
        if k.startswith(VISION_PREFIXES):
            continue
        if k.startswith("model.language_model."):
            k = "model." + k[len("model.language_model."):]
        elif k.startswith("language_model."):
            k = k[len("language_model."):]
        if k.startswith("model.mtp."):
            k = k[len("model."):]
        out[k] = v
    return out


# --------------------------------------------------------------------------
# Hugging Face -> MLX
# --------------------------------------------------------------------------

# Norms stored zero-centred ((1 + w) scaling) in raw Hugging Face checkpoints. The
# Gated DeltaNet's own norm (linear_attn.norm) is a plain-weight norm.
SHIFTED_NORM_SUFFIXES = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
    "mtp.norm.weight",
    "mtp.pre_fc_norm_hidden.weight",
    "mtp.pre_fc_norm_embedding.weight",
)
# Zero-centred layer norms sit near 0, applied ones near 1. q/k norms and the final
# norms (model.norm, mtp.norm) are left out of the statistic: trained ones drift far
# from either.
_STAT_NORM_SUFFIXES = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                       "mtp.pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_embedding.weight")
ZERO_CENTRED_MEAN = 0.5
_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


def norms_zero_centred(weights: Dict[str, mx.array], keys: Iterable[str]) -> Optional[bool]:
    """Whether the norms among ``keys`` are stored zero-centred (None: no norms to tell)."""
    norms = [weights[k] for k in keys if k.endswith(_STAT_NORM_SUFFIXES) and weights[k].ndim == 1]
    if not norms:
        return None
    mean = mx.mean(mx.concatenate([n.astype(mx.float32) for n in norms])).item()
    return mean < ZERO_CENTRED_MEAN


def _trunk_zero_centred(weights: Dict[str, mx.array], trunk_keys: List[str]) -> bool:
    # An MLX conversion moves the conv axes and shifts the norms in the same pass,
    # so the conv layout tells; a trunk without Gated DeltaNet layers falls back to
    # the norms' statistics.
    conv = [weights[k] for k in trunk_keys if k.endswith("conv1d.weight")]
    if conv:
        return any(v.shape[-1] != 1 for v in conv)
    return bool(norms_zero_centred(weights, trunk_keys))


def split_experts(weights: dict, prefix: str, num_experts: int):
    """Bring one MoE block's experts (fused 3-D or per expert) into stacked ``switch_mlp`` form."""
    fused = f"{prefix}.experts.gate_up_proj"
    if fused in weights:
        down = f"{prefix}.experts.down_proj"
        if down not in weights:
            raise CheckpointError(f"{fused} is present but {down} is missing: the checkpoint "
                                  "is incomplete; download it again.")
        gate_up = weights.pop(fused)
        mid = gate_up.shape[-2] // 2
        weights[f"{prefix}.switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
        weights[f"{prefix}.switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
        weights[f"{prefix}.switch_mlp.down_proj.weight"] = weights.pop(down)
        return
    names = [f"{prefix}.experts.{e}.{p}.weight" for p in _EXPERT_PROJS for e in range(num_experts)]
    present = [n in weights for n in names]
    if not any(present):
        return
    if not all(present):
        missing = [n for n, ok in zip(names, present) if not ok]
        raise CheckpointError(
            f"{len(missing)} of the {len(names)} per-expert tensors of {prefix} are missing "
            f"(e.g. {', '.join(missing[:3])}): the checkpoint is incomplete or was written "
            f"for another num_experts; download it again.")
    for p in _EXPERT_PROJS:
        weights[f"{prefix}.switch_mlp.{p}.weight"] = mx.stack(
            [weights.pop(f"{prefix}.experts.{e}.{p}.weight") for e in range(num_experts)])


def sanitize_text_weights(model, weights: dict) -> dict:
    """Turn text-level weights (keys ``model.*``, ``lm_head.*``, ``mtp.*``) into ``model``'s.

    Reads raw Hugging Face checkpoints, MLX conversions and mixes of the two: conv1d
    axis order, (1 + w) norms (decided for the trunk and for the MTP head separately:
    a re-export may pair a converted trunk with a raw head), fused or per-expert
    experts in the trunk and in the MTP layers, tied heads, and the MTP weights
    themselves (kept, or dropped when the model has no head).
    """
    args = model.args
    n_mtp = model.num_mtp_layers
    if n_mtp > 0:
        if not any(is_mtp_key(k) for k in weights):
            raise MissingMTPWeightsError(missing_mtp_message(model))
    else:
        weights = {k: v for k, v in weights.items() if not is_mtp_key(k)}
    if args.tie_word_embeddings:
        weights.pop("lm_head.weight", None)

    trunk_keys = [k for k in weights if not is_mtp_key(k)]
    trunk_raw = _trunk_zero_centred(weights, trunk_keys)
    head_raw = norms_zero_centred(weights, [k for k in weights if is_mtp_key(k)])
    head_raw = trunk_raw if head_raw is None else head_raw
    if n_mtp > 0 and trunk_keys and head_raw != trunk_raw:
        log.info("The MTP head's norms are stored %s, the trunk's %s: converting each as stored.",
                 *(("zero-centred", "applied") if head_raw else ("applied", "zero-centred")))

    if args.num_experts > 0:
        prefixes = [f"model.layers.{i}.mlp" for i in range(args.num_hidden_layers)]
        prefixes += [f"mtp.layers.{i}.mlp" for i in range(n_mtp)]
        for p in prefixes:
            split_experts(weights, p, args.num_experts)

    out = {}
    for k, v in weights.items():
        if "conv1d.weight" in k and v.shape[-1] != 1:
            v = v.moveaxis(2, 1)
        if v.ndim == 1 and k.endswith(SHIFTED_NORM_SUFFIXES) and (
                head_raw if is_mtp_key(k) else trunk_raw):
            v = v + 1.0
        out[k] = v

    if n_mtp > 0:
        expected = {k for k, _ in tree_flatten(model.parameters()) if k.startswith("mtp.")}
        missing = sorted(expected - out.keys())
        if missing:
            raise MissingMTPWeightsError(missing_mtp_message(model, missing))
    return out


def missing_mtp_message(model, missing: Optional[List[str]] = None) -> str:
    n = model.num_mtp_layers
    if missing:
        what = f"{len(missing)} mtp.* tensors are missing, e.g. " + ", ".join(missing[:5])
    else:
        total = sum(1 for k, _ in tree_flatten(model.parameters()) if k.startswith("mtp."))
        what = f"it has none of the {total} mtp.* tensors"
    return (
        f"The config promises {n} MTP layer(s) (model_type={model.model_type!r}) but the "
        f"weights lack the MTP head: {what}. This usually means the checkpoint was "
        "converted by a tool that strips mtp.* weights. Fix: convert again from the "
        "original Hugging Face checkpoint with `mlx-mtp convert --hf-path SRC --mlx-path DST`, "
        "or graft the head into this model with `mlx-mtp add-mtp --model THIS --source SRC`, "
        "or draft with its split drafter (mlx-community's ...-MTP-4bit repo, or `convert "
        "--split-mtp`'s output): --mtp-model DRAFTER. To run without MTP, pass --no-mtp."
    )


# --------------------------------------------------------------------------
# MLX -> Hugging Face
# --------------------------------------------------------------------------

def to_hf(model, family_name: str, *, nested: bool = True, expert_layout: str = "fused",
          mtp_expert_layout: str = "per_expert") -> Dict[str, mx.array]:
    """The model's float weights under the names and in the forms released checkpoints use.

    ``nested``: Qwen3.5's multimodal ``model.language_model.*`` names (else ``model.*``).
    Expert layouts: ``fused`` or ``per_expert`` (Qwen3-Next: always per expert).
    """
    text = model.text
    if family_name == "qwen3_next":
        expert_layout = mtp_expert_layout = "per_expert"
    trunk_prefix = "model.language_model." if nested and family_name != "qwen3_next" else "model."
    out = {}
    for k, v in tree_flatten(text.parameters()):
        if k == "lm_head.weight" and text.args.tie_word_embeddings:
            continue
        if "conv1d.weight" in k:
            v = v.moveaxis(1, 2)  # (C, K, 1) -> (C, 1, K)
        if v.ndim == 1 and k.endswith(SHIFTED_NORM_SUFFIXES):
            v = v - 1.0
        if k.startswith("model."):
            k = trunk_prefix + k[len("model."):]
        out[k] = v
    for k in [k for k in out if k.endswith(".switch_mlp.gate_proj.weight")]:
        prefix = k[: -len(".switch_mlp.gate_proj.weight")]
        gate, up, down = (out.pop(f"{prefix}.switch_mlp.{p}.weight") for p in _EXPERT_PROJS)
        if (mtp_expert_layout if is_mtp_key(prefix) else expert_layout) == "fused":
            out[f"{prefix}.experts.gate_up_proj"] = mx.concatenate([gate, up], axis=1)
            out[f"{prefix}.experts.down_proj"] = down
        else:
            for e in range(gate.shape[0]):
                for p, w in zip(_EXPERT_PROJS, (gate, up, down)):
                    out[f"{prefix}.experts.{e}.{p}.weight"] = w[e]
    return out


# --------------------------------------------------------------------------
# A head loaded in the wrong layout fails silently: watch the acceptance
# --------------------------------------------------------------------------

WARMUP_DRAFT_TOKENS = 64
IMPLAUSIBLE_ACCEPTANCE = 0.02
_warned = set()


def check_acceptance(num_draft_tokens: int, num_accepted_tokens: int, source: str = "") -> bool:
    """Log a warning (once per ``source``) when draft acceptance after a warm-up is
    implausibly low for a head the checkpoint shipped: native MTP heads accept 60-90%,
    a head whose (1 + w) norms were read in the wrong form accepts almost nothing,
    with fluent drafts and no other symptom. Cheap: call it after every step.
    Returns whether acceptance is implausibly low."""
    if num_draft_tokens < WARMUP_DRAFT_TOKENS:
        return False
    rate = num_accepted_tokens / num_draft_tokens
    if rate >= IMPLAUSIBLE_ACCEPTANCE:
        return False
    if source not in _warned:
        _warned.add(source)
        log.warning(
            "MTP acceptance is %.1f%% after %d draft tokens%s, far below what a native head "
            "gives (60-90%%). The head's weights may be in the wrong layout (e.g. a raw "
            "zero-centred head paired with a converted trunk) or belong to another model; "
            "re-create it with `mlx-mtp convert` or `mlx-mtp add-mtp --force` from the "
            "original checkpoint, or run with --no-mtp.",
            100 * rate, num_draft_tokens, f" ({source})" if source else "")
    return True
