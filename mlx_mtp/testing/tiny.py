"""Tiny checkpoints in the real Hugging Face layout, for tests and benchmarks.

No model hub is reachable where mlx-mtp is built, so tests make their own
Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoints: random or "oracle" weights,
written exactly as the released checkpoints store them (``mtp.*`` at top level,
zero-centred norms, HF conv1d axis order, fused or per-expert experts, nested
or flat config, one file or sharded with an index).

Heads:
* ``random``: random MTP head (acceptance ~ 1/V by chance).
* ``oracle``: trunk and head follow a fixed token cycle, so every draft is
  accepted (sub-layer outputs scaled by ``trunk_scale``: 0 makes the residual
  stream the embedding; small values keep the trunk's state in play).
* ``noisy``: oracle plus noise on ``mtp.fc`` (partial acceptance).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def tiny_text_config(family: str, vocab_size: int = 512, num_layers: int = 4, moe: bool = None,
                     tie: bool = False, mtp_layers: int = 1, hidden: int = 64) -> dict:
    moe = family != "qwen3_5" if moe is None else moe
    cfg = {
        "hidden_size": hidden,
        "num_hidden_layers": num_layers,
        "intermediate_size": 2 * hidden,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 2,
        "tie_word_embeddings": tie,
        "attention_bias": False,
    }
    if moe:
        cfg.update(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                   moe_intermediate_size=hidden // 2, shared_expert_intermediate_size=hidden,
                   norm_topk_prob=True, mlp_only_layers=[])
    if family == "qwen3_next":
        cfg.update(model_type="qwen3_next", rope_theta=10000.0, partial_rotary_factor=0.25,
                   rope_scaling=None, architectures=["Qwen3NextForCausalLM"])
        if mtp_layers != 1:
            cfg["num_nextn_predict_layers"] = mtp_layers
    else:
        cfg.update(
            model_type=f"{family}_text",
            mtp_num_hidden_layers=mtp_layers,
            mtp_use_dedicated_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
                             "mrope_interleaved": True},
        )
    return cfg


def hf_config(family: str, text: dict, nested: bool = True) -> dict:
    if family == "qwen3_next":
        return dict(text)
    arch = "Qwen3_5MoeForConditionalGeneration" if family == "qwen3_5_moe" else \
        "Qwen3_5ForConditionalGeneration"
    if not nested:
        flat = dict(text, model_type=family, architectures=[arch.replace("ConditionalGeneration", "CausalLM")])
        return flat
    return {"architectures": [arch], "model_type": family, "text_config": text,
            "tie_word_embeddings": text["tie_word_embeddings"]}


def build_model(family: str, text: dict, seed: int = 0):
    """Our model (float32) with random weights, norms scattered around 1."""
    from ..models import get_model_module

    mx.random.seed(seed)
    module = get_model_module(family)
    model = module.Model(module.ModelArgs.from_dict(hf_config(family, text)))
    rng = np.random.default_rng(seed)
    updates = []
    for k, v in tree_flatten(model.parameters()):
        if k.endswith("norm.weight") and "linear_attn.norm" not in k:
            updates.append((k, mx.array(1 + 0.1 * rng.standard_normal(v.shape), mx.float32)))
        elif k.endswith("A_log"):
            updates.append((k, mx.array(np.log(rng.uniform(1, 8, v.shape)), mx.float32)))
        elif k.endswith("conv1d.weight") or "embed_tokens" in k:
            updates.append((k, mx.array(rng.standard_normal(v.shape) * 0.5, mx.float32)))
    model.load_weights(updates, strict=False)
    mx.eval(model.parameters())
    return model


def make_oracle(model, trunk_scale: float = 0.0, fc_noise: float = 0.0, seed: int = 0):
    """Make trunk and MTP head follow the cycle t -> (t + 1) mod V (see module doc)."""
    text = model.text
    args = text.args
    rng = np.random.default_rng(seed + 1)
    H = args.hidden_size
    out_proj_suffixes = ("o_proj.weight", "out_proj.weight", "down_proj.weight")
    updates = [(k, v * trunk_scale) for k, v in tree_flatten(text.parameters())
               if k.endswith(out_proj_suffixes)]
    text.load_weights(updates, strict=False)
    emb = np.array(text.model.embed_tokens.weight)
    lm = np.roll(emb, 1, axis=0) * 4.0  # row t+1 = embedding of t
    text.load_weights([("lm_head.weight", mx.array(lm, mx.float32))], strict=False)
    if text.num_mtp_layers:
        fc = np.zeros((H, 2 * H), np.float32)
        fc[:, :H] = np.eye(H)  # pick the embedding half: predict succ(t+1)
        fc += fc_noise * rng.standard_normal(fc.shape) / np.sqrt(H)
        # Neutral norms in the head so it passes the embedding through.
        ups = [("mtp.fc.weight", mx.array(fc))]
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            ups.append((f"mtp.{name}.weight", mx.ones((H,))))
        text.load_weights(ups, strict=False)
    mx.eval(model.parameters())
    return model


def _to_hf(model, family: str, expert_layout: str, mtp_expert_layout: str) -> dict:
    """Our parameter tree -> the weight names and forms released checkpoints use."""
    text = model.text
    out = {}
    for k, v in tree_flatten(text.parameters()):
        if "conv1d.weight" in k:
            v = v.moveaxis(1, 2)  # (C, K, 1) -> HF (C, 1, K)
        if v.ndim == 1 and k.endswith(_shifted()):
            v = v - 1.0  # zero-centred (1 + w) norms
        if family != "qwen3_next" and k.startswith("model."):
            k = "model.language_model." + k[len("model."):]
        out[k] = v
    # Experts: switch_mlp -> fused 3-D or per-expert Linear weights.
    for k in [k for k in out if ".switch_mlp.gate_proj.weight" in k]:
        prefix = k[: -len(".switch_mlp.gate_proj.weight")]
        gate = out.pop(k)
        up = out.pop(f"{prefix}.switch_mlp.up_proj.weight")
        down = out.pop(f"{prefix}.switch_mlp.down_proj.weight")
        layout = mtp_expert_layout if prefix.startswith("mtp.") else expert_layout
        if layout == "fused":
            out[f"{prefix}.experts.gate_up_proj"] = mx.concatenate([gate, up], axis=1)
            out[f"{prefix}.experts.down_proj"] = down
        else:
            for e in range(gate.shape[0]):
                out[f"{prefix}.experts.{e}.gate_proj.weight"] = gate[e]
                out[f"{prefix}.experts.{e}.up_proj.weight"] = up[e]
                out[f"{prefix}.experts.{e}.down_proj.weight"] = down[e]
    return out


def _shifted():
    from ..models.hybrid import SHIFTED_NORM_SUFFIXES

    return SHIFTED_NORM_SUFFIXES


def save_hf_checkpoint(model, family: str, text: dict, path, *, nested: bool = True,
                       expert_layout: str = "fused", mtp_expert_layout: str = "per_expert",
                       shards: int = 1, dtype=mx.float32, drop_mtp: bool = False,
                       tokenizer_dir: Optional[Path] = None):
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if family == "qwen3_next":
        expert_layout = mtp_expert_layout = "per_expert"
    weights = _to_hf(model, family, expert_layout, mtp_expert_layout)
    if drop_mtp:
        weights = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    if text["tie_word_embeddings"]:
        weights.pop("lm_head.weight", None)
    weights = {k: v.astype(dtype) if v.dtype in (mx.float32, mx.bfloat16, mx.float16)
               and not k.endswith("A_log") else v for k, v in weights.items()}
    _write_shards(weights, path, shards)
    with open(path / "config.json", "w") as f:
        json.dump(hf_config(family, text, nested), f, indent=2)
    copy_tokenizer(path, tokenizer_dir)
    return path


def _write_shards(weights: dict, path: Path, shards: int):
    keys = sorted(weights)
    if shards <= 1:
        mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
        return
    # Put mtp.* in the last shard, as the released checkpoints tend to.
    keys = [k for k in keys if not k.startswith("mtp.")] + [k for k in keys if k.startswith("mtp.")]
    per = (len(keys) + shards - 1) // shards
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: weights[k] for k in keys[i * per:(i + 1) * per]}
        mx.save_safetensors(str(path / name), part, metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    total = sum(v.nbytes for v in weights.values())
    with open(path / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def copy_tokenizer(path: Path, tokenizer_dir: Optional[Path] = None):
    import shutil

    src = Path(tokenizer_dir) if tokenizer_dir else Path(__file__).parent.parent / "assets" / "tokenizer"
    if src.exists():
        for f in src.iterdir():
            if f.is_file():
                shutil.copy(f, path / f.name)


def make_tiny(path, family: str = "qwen3_5", head: str = "random", *, vocab_size: int = 512,
              seed: int = 0, trunk_scale: float = 0.0, fc_noise: float = 1.5, tie: bool = False,
              moe: bool = None, hidden: int = 64, num_layers: int = 4,
              **save_kwargs) -> Path:
    """Build and save a tiny checkpoint in the Hugging Face layout; returns its path."""
    text = tiny_text_config(family, vocab_size=vocab_size, tie=tie, moe=moe, hidden=hidden,
                            num_layers=num_layers)
    model = build_model(family, text, seed)
    if head in ("oracle", "noisy"):
        make_oracle(model, trunk_scale, fc_noise if head == "noisy" else 0.0, seed)
    return save_hf_checkpoint(model, family, text, path, **save_kwargs)
