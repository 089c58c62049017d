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

from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..convert.checkpoint_io import write_checkpoint
from ..models.io.layout import hf_config, is_mtp_key, to_hf

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
TOKENIZER_DIR = Path(__file__).parent.parent / "assets" / "tokenizer"


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


def save_hf_checkpoint(model, family: str, text: dict, path, *, nested: bool = True,
                       expert_layout: str = "fused", mtp_expert_layout: str = "per_expert",
                       shards: int = 1, dtype=mx.float32, drop_mtp: bool = False,
                       tokenizer_dir: Optional[Path] = None, config: Optional[dict] = None):
    """Write ``model`` as a Hugging Face checkpoint (``config``: config.json to write
    instead of the one built from ``text``)."""
    weights = to_hf(model, family, nested=nested, expert_layout=expert_layout,
                    mtp_expert_layout=mtp_expert_layout)
    if drop_mtp:
        weights = {k: v for k, v in weights.items() if not is_mtp_key(k)}
    src = Path(tokenizer_dir) if tokenizer_dir else TOKENIZER_DIR
    write_checkpoint(path, weights, config or hf_config(family, text, nested),
                     tokenizer_from=src if src.is_dir() else None,
                     tokenizer_files=tuple(f.name for f in src.glob("*") if f.is_file()),
                     dtype=dtype, num_shards=shards if shards > 1 else None, mtp_file=False,
                     fmt="pt")
    return Path(path)


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
