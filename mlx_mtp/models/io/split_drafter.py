"""Split MTP drafters: the MTP head in a directory of its own, next to a trunk without one.

The layout is mlx-vlm's (>= 0.7, ``mlx_vlm/speculative/drafters/qwen3_5_mtp``), which
mlx-community publishes as ``...-MTP-4bit`` repos:

* ``config.json``: ``model_type`` ``qwen3_5_mtp``; ``text_config`` = the trunk's text config,
  copied whole (``mtp_num_hidden_layers`` included); ``tie_word_embeddings``; ``block_size``
  (verify length, 1 + drafts; default depth + 2); ``quantization`` / ``quantization_config``
  only when quantized, per-module entries keyed without the ``mtp.`` prefix;
* ``model.safetensors`` (metadata ``format: mlx``): the head's tensors named as the HF
  ``mtp.*`` ones without the prefix (``fc``, ``pre_fc_norm_*``, ``layers.N.*`` with stacked
  ``switch_mlp`` experts, ``norm``), every norm stored already shifted (1 + w); keys that
  still carry ``mtp.`` are the raw Hugging Face layout (zero-centred norms);
* tokenizer files when the source had them. No embedding or output layer: the drafter
  borrows the trunk's. The format carries no fingerprint of its trunk.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx

from .config_checks import check_config
from .files import load_safetensors, read_json_object
from .layout import (SHIFTED_NORM_SUFFIXES, CheckpointError, args_dict, config_mtp_layers,
                     count_mtp_layers, family, is_mtp_key, text_config)

DRAFTER_MODEL_TYPE = "qwen3_5_mtp"  # mlx-vlm writes it for qwen3_5, qwen3_5_moe, qwen3_next
# Text-config fields that must agree for a head to belong to a trunk.
MATCH_FIELDS = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "intermediate_size", "num_experts",
                "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size", "tie_word_embeddings")


class DrafterError(CheckpointError):
    pass


def is_drafter_config(config: dict) -> bool:
    """mlx-vlm's rule for an MTP drafter: a ``*mtp*`` model_type."""
    return "mtp" in str(config.get("model_type", ""))


def default_block_size(depth: int) -> int:
    return depth + 2


@dataclass
class Drafter:
    path: Path
    config: dict
    weights: Dict[str, mx.array]  # bare names (``fc.weight``...), norms shifted

    @property
    def num_layers(self) -> int:
        return count_mtp_layers("mtp." + k for k in self.weights) or config_mtp_layers(self.config)

    def quantization_overrides(self, prefix: str) -> Dict[str, dict]:
        """Per-module quantization of the head's quantized modules, keyed by their path in
        the model (``prefix`` + bare path): explicit, so no bits are guessed."""
        q = self.config.get("quantization") or self.config.get("quantization_config") or {}
        default = {k: q[k] for k in ("group_size", "bits", "mode") if k in q}
        out = {}
        for key in self.weights:
            if key.endswith(".scales"):
                module = key[: -len(".scales")]
                entry = q.get(module) if isinstance(q.get(module), dict) else default
                out[prefix + module] = {"group_size": 64, "bits": 4, "mode": "affine", **entry}
        return out


def _head_weights(files: List[Path]) -> Dict[str, mx.array]:
    weights = {}
    for f in files:
        for k, v in load_safetensors(f).items():
            if k.startswith("mtp."):  # raw Hugging Face layout: norms zero-centred
                if v.ndim == 1 and k.endswith(SHIFTED_NORM_SUFFIXES):
                    v = v + 1.0
                k = k[len("mtp."):]
            weights[k] = v
    return weights


def read_drafter(path: Path) -> Drafter:
    """The drafter at ``path`` (a directory in the split layout)."""
    config_file = path / "config.json"
    if not config_file.exists():
        raise DrafterError(f"{path} has no config.json: it is not an MTP drafter directory.")
    config = read_json_object(config_file, "the MTP drafter's config")
    check_config(config, config_file)
    if not is_drafter_config(config):
        raise DrafterError(
            f"{path} is not a split MTP drafter (model_type {config.get('model_type')!r}, "
            f"expected {DRAFTER_MODEL_TYPE!r}). Pass it as --model, or pass the drafter "
            "made for this model (e.g. an ...-MTP-4bit repo) as --mtp-model.")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DrafterError(f"{path} has no *.safetensors file: the drafter is incomplete.")
    weights = _head_weights(files)
    if not any(k.startswith("layers.") for k in weights) or "fc.weight" not in weights:
        raise DrafterError(f"{path} holds no MTP layer (no fc.weight / layers.*): it is not "
                           "an MTP drafter.")
    return Drafter(path, config, weights)


def sibling_drafter(trunk: Path) -> Optional[Path]:
    """A drafter directory next to ``trunk`` named as mlx-community names them:
    ``Name-4bit`` -> ``Name-MTP-4bit`` (the quantization suffix kept last) or ``Name-MTP``."""
    name = trunk.name
    candidates = [f"{name}-MTP"]
    head, sep, tail = name.rpartition("-")
    if sep and re.fullmatch(r"(\d+bit|bf16|fp16|mxfp4|nvfp4|mxfp8|\d+bit-.*)", tail):
        candidates.insert(0, f"{head}-MTP-{tail}")
    for c in candidates:
        path = trunk.parent / c
        if (path / "config.json").exists():
            try:
                config = read_json_object(path / "config.json")
            except CheckpointError:
                continue
            if is_drafter_config(config):
                return path
    return None


def _tokenizer_vocab(path: Path) -> Optional[dict]:
    f = path / "tokenizer.json"
    if not f.exists():
        return None
    data = read_json_object(f)
    try:
        vocab = dict((data.get("model") or {}).get("vocab") or {})
        vocab.update({t["content"]: t["id"] for t in data.get("added_tokens", [])})
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise DrafterError(f"{f} is not a tokenizer.json ({type(e).__name__}: {e}); the "
                           "file is damaged.") from e
    return vocab


def check_belongs(drafter: Drafter, trunk_config: dict, trunk_path: Path) -> None:
    """Refuse a drafter made for another model: family, the shape fields of the two text
    configs, and the tokenizer vocabulary when both directories ship one."""
    where = f"The MTP drafter {drafter.path} does not belong to {trunk_path}"
    theirs_family = family(text_config(drafter.config)) or family(drafter.config)
    if theirs_family != family(trunk_config):
        raise DrafterError(f"{where}: it is for a {theirs_family!r} model, the trunk is "
                           f"{family(trunk_config)!r}. Use the drafter published with this "
                           "model.")
    ours, theirs = args_dict(trunk_config), args_dict(drafter.config)
    mismatches = [f"{k}: trunk {ours.get(k)} vs drafter {theirs.get(k)}" for k in MATCH_FIELDS
                  if k in theirs and ours.get(k) != theirs.get(k)]
    if mismatches:
        raise DrafterError(f"{where}: " + "; ".join(mismatches) + ". Use the drafter made "
                           "from the same model (size and variant).")
    a, b = _tokenizer_vocab(trunk_path), _tokenizer_vocab(drafter.path)
    if a is not None and b is not None and a != b:
        differ = sum(1 for t in a.keys() | b.keys() if a.get(t) != b.get(t))
        raise DrafterError(f"{where}: their tokenizers differ ({differ} tokens map to other "
                           "ids), so the head would predict the wrong tokens. Use the drafter "
                           "made from the same model.")


def merge_into(trunk_weights: Dict[str, mx.array], drafter: Drafter) -> Dict[str, mx.array]:
    """Trunk weights (any head of its own dropped) plus the drafter's under ``mtp.``, as a
    checkpoint holding both would store them (the model's sanitize reads the rest)."""
    out = {k: v for k, v in trunk_weights.items() if not is_mtp_key(k)}
    out.update({"mtp." + k: v for k, v in drafter.weights.items()})
    return out


def drafter_config(config: dict, depth: int, quantization: Optional[dict],
                   block_size: Optional[int] = None) -> dict:
    """config.json of the drafter of a model whose config is ``config``."""
    text = json.loads(json.dumps(text_config(config)))
    for key in ("quantization", "quantization_config"):
        text.pop(key, None)
    text["mtp_num_hidden_layers"] = depth
    text.setdefault("model_type", config.get("model_type"))
    out = {"model_type": DRAFTER_MODEL_TYPE, "text_config": text,
           "tie_word_embeddings": bool(args_dict(config)["tie_word_embeddings"]),
           "block_size": int(block_size or default_block_size(depth))}
    if quantization:
        out["quantization"] = quantization
        out["quantization_config"] = json.loads(json.dumps(quantization))
    return dict(sorted(out.items()))
