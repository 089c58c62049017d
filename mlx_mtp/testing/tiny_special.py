"""Tiny checkpoints of the families with special caches, in the released Hugging Face
layout, for tests. ``step3p5``: full-attention and sliding-window layers (a window of 8
so short prompts wrap it), MoE with a shared expert stored as released (3-D
``moe.{gate,up,down}_proj``, ``moe.gate``, ``moe.router_bias``, ``share_expert``), every
norm zero-centred, the MTP layer at ``model.layers.{N}.*`` with its block under
``transformer.`` and the output layer's copy as ``shared_head.output``.

Heads as in ``tiny_attention``: ``random``, ``oracle`` (acceptance 100 % at every depth),
``noisy`` (partial acceptance).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .tiny_attention import _unsplit, make_oracle, tiny_config, to_hf, write_tiny

WINDOW = 8


def step3p5_config(vocab_size: int = 128, hidden: int = 64, num_layers: int = 3,
                   mtp_layers: int = 1, window: int = WINDOW) -> dict:
    types = (["sliding_attention", "full_attention"] * num_layers)[:num_layers]
    return {"model_type": "step3p5", "architectures": ["Step3p5ForCausalLM"],
            "vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "num_hidden_layers": num_layers, "num_attention_heads": 4,
            "num_attention_groups": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "max_position_embeddings": 4096,
            "sliding_window": window,
            # Released configs list the MTP layers' types after the trunk's.
            "layer_types": types + ["sliding_attention"] * mtp_layers,
            "attention_other_setting": {"num_attention_heads": 2, "num_attention_groups": 1},
            "partial_rotary_factors": [0.5, 1.0] * num_layers,
            "use_head_wise_attn_gate": True, "moe_num_experts": 4, "moe_top_k": 2,
            "moe_intermediate_size": hidden // 2, "share_expert_dim": hidden // 2,
            "moe_router_scaling_factor": 3.0, "norm_expert_weight": True,
            "tie_word_embeddings": False, "num_nextn_predict_layers": mtp_layers}


# Our (mlx-lm's) names of the MoE tensors -> the released ones.
RELEASED_MOE = [(".mlp.switch_mlp.gate_proj.", ".moe.gate_proj."),
                (".mlp.switch_mlp.up_proj.", ".moe.up_proj."),
                (".mlp.switch_mlp.down_proj.", ".moe.down_proj."),
                (".mlp.gate.gate.", ".moe.gate."), (".mlp.gate.router_bias", ".moe.router_bias"),
                (".mlp.share_expert.", ".share_expert.")]


def step3p5_to_hf(model, drop_mtp: bool = False) -> dict:
    """Released names and forms: MoE names, norms zero-centred (w - 1)."""
    flat = dict(tree_flatten(model.parameters()))
    out = {}
    for k, v in flat.items():
        if k.startswith("mtp."):
            continue
        for ours, theirs in RELEASED_MOE:
            k = k.replace(ours, theirs)
        out[k] = v - 1 if k.endswith("norm.weight") else v
    if model.num_mtp_layers and not drop_mtp:
        out.update(model.checkpoint_mtp_names(
            {k: v for k, v in flat.items() if k.startswith("mtp.")}))
        prefix = model.family.mtp_prefix(model.args, 0)
        out[prefix + "embed_tokens.weight"] = flat["model.embed_tokens.weight"]
        out[prefix + "shared_head.output.weight"] = flat["lm_head.weight"]
    return out


def make_tiny_step3p5(path, head: str = "random", *, broken: tuple = (), **kw) -> Path:
    """``mtp_layers=3`` ships three MTP layers (as Step-3.5-Flash does); ``broken``: see
    ``chain_oracle``. Other options: ``tiny_attention.write_tiny``."""
    return write_tiny(path, step3p5_config, step3p5_to_hf, head, oracle=chained_oracle(broken),
                      **kw)


def mimo_v2_flash_config(vocab_size: int = 128, hidden: int = 64, num_layers: int = 3,
                         window: int = WINDOW) -> dict:
    """Full attention in layer 0, windowed layers (with sink bias) after it; MoE from
    layer 1; value heads narrower than query/key heads, as released. No MTP count key."""
    return {"model_type": "mimo_v2_flash", "architectures": ["MiMoV2FlashForCausalLM"],
            "vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "moe_intermediate_size": hidden // 2, "num_hidden_layers": num_layers,
            "hybrid_layer_pattern": [0] + [1] * (num_layers - 1),
            "moe_layer_freq": [0] + [1] * (num_layers - 1),
            "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
            "sliding_window_size": window, "num_attention_heads": 4, "num_key_value_heads": 2,
            "swa_num_attention_heads": 4, "swa_num_key_value_heads": 1, "head_dim": 16,
            "v_head_dim": 8, "swa_head_dim": 16, "swa_v_head_dim": 8,
            "partial_rotary_factor": 0.5, "attention_value_scale": 0.7,
            "rope_theta": 10000.0, "swa_rope_theta": 5000.0, "layernorm_epsilon": 1e-5,
            "max_position_embeddings": 4096, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "n_shared_experts": None, "routed_scaling_factor": None, "topk_method": "noaux_tc",
            "scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": 1, "topk_group": 1,
            "tie_word_embeddings": False}


# Per-expert experts; the MTP layers (dense, no duplicated embedding or head) at
# ``model.mtp.layers.{i}.*``: what ``to_hf`` writes for the attention families.
mimo_v2_flash_to_hf = to_hf


def chain_oracle(model, proj_noise: float, seed: int, broken: tuple = ()):
    """Every MTP layer j passes the embedding of t_{p+j+1} through (as ``make_oracle`` does
    for layer 0), with its own noise; layers in ``broken`` get a random projection."""
    rng = np.random.default_rng(seed + 2)
    H = model.args.hidden_size
    updates = []
    for j in range(1, model.num_mtp_layers):
        proj = np.zeros((H, 2 * H), np.float32)
        proj[:, :H] = np.eye(H)
        proj += proj_noise * rng.standard_normal(proj.shape) / np.sqrt(H)
        updates.append((f"mtp.layers.{j}.eh_proj.weight", proj))
        updates += [(f"mtp.layers.{j}.{n}.weight", np.ones(H)) for n in ("enorm", "hnorm", "norm")]
    updates = dict(updates)
    for j in broken:
        updates[f"mtp.layers.{j}.eh_proj.weight"] = rng.standard_normal((H, 2 * H))
    model.load_weights([(k, mx.array(v, mx.float32)) for k, v in updates.items()],
                       strict=False)
    mx.eval(model.parameters())


def chained_oracle(broken: tuple = ()):
    """``make_oracle`` for the trunk and MTP layer 0, then ``chain_oracle`` for the rest."""
    def oracle(model, trunk_scale: float, proj_noise: float, seed: int):
        make_oracle(model, trunk_scale, proj_noise, seed)
        chain_oracle(model, proj_noise, seed, broken)
    return oracle


def make_tiny_mimo_v2_flash(path, head: str = "random", *, broken: tuple = (), **kw) -> Path:
    """``broken``: MTP layers given a random projection (their depth's drafts fail)."""
    return write_tiny(path, mimo_v2_flash_config, mimo_v2_flash_to_hf, head,
                      oracle=chained_oracle(broken), **kw)


def nemotron_h_config(vocab_size: int = 128, hidden: int = 64, repeats: int = 1) -> dict:
    """Mamba-2, attention, MLP and MoE blocks (the pattern ``M*M-ME``, ``repeats`` times);
    an attention + MoE MTP layer."""
    return {"model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"],
            "vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "max_position_embeddings": 4096, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "attention_bias": False,
            "mamba_num_heads": 4, "mamba_head_dim": 16, "mamba_proj_bias": False,
            "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 2, "mlp_bias": False,
            "layer_norm_epsilon": 1e-5, "use_bias": False, "use_conv_bias": True,
            "hybrid_override_pattern": "M*M-ME" * repeats, "mtp_hybrid_override_pattern": "*E",
            "time_step_limit": [0.0, 1e9], "moe_intermediate_size": hidden // 2,
            "moe_shared_expert_intermediate_size": hidden // 2, "n_routed_experts": 4,
            "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
            "norm_topk_prob": True, "routed_scaling_factor": 1.0,
            "num_nextn_predict_layers": 1, "tie_word_embeddings": False}


def nemotron_oracle(model, trunk_scale: float, proj_noise: float, seed: int):
    """``make_oracle`` for Nemotron-H's names (Mamba ``out_proj``, experts' ``fc2``)."""
    scaled = [(k, v * trunk_scale) for k, v in tree_flatten(model.parameters())
              if k.endswith(("out_proj.weight", "switch_mlp.fc2.weight"))]
    model.load_weights(scaled, strict=False)
    return make_oracle(model, trunk_scale, proj_noise, seed)


def nemotron_h_to_hf(model, drop_mtp: bool = False) -> dict:
    """``backbone.*``, per-expert ``experts.{e}.{up,down}_proj``, conv weights as (C, 1, K)."""
    flat = dict(tree_flatten(model.parameters()))
    if drop_mtp:
        flat = {k: v for k, v in flat.items() if not k.startswith("mtp.")}
    out = {}
    for k, v in model.checkpoint_mtp_names(flat).items():
        if k.endswith("conv1d.weight"):
            v = v.moveaxis(2, 1)
        for ours, theirs in (("switch_mlp.fc1.", "up_proj."), ("switch_mlp.fc2.", "down_proj.")):
            if ours in k:
                for e in range(v.shape[0]):
                    out[k.replace(ours, f"experts.{e}.{theirs}")] = v[e]
                break
        else:
            out[k] = v
    return out


def _random_routers(model):
    gates = [(k, mx.random.normal(v.shape)) for k, v in tree_flatten(model.parameters())
             if k.endswith("mixer.gate.weight")]  # mlx-lm starts routers at zero
    model.load_weights(gates, strict=False)


def make_tiny_nemotron_h(path, head: str = "random", **kw) -> Path:
    return write_tiny(path, nemotron_h_config, nemotron_h_to_hf, head, prepare=_random_routers,
                      oracle=nemotron_oracle, **kw)


def longcat_flash_config(vocab_size: int = 128, hidden: int = 64, num_layers: int = 2) -> dict:
    """``num_layers`` layers of two MLA sublayers each (q/kv LoRA scaling on), a shortcut MoE with
    four experts and two zero-compute ones. No MTP count key, as released."""
    return {"model_type": "longcat_flash", "architectures": ["LongcatFlashForCausalLM"],
            "attention_method": "MLA", "zero_expert_type": "identity",
            "vocab_size": vocab_size, "hidden_size": hidden, "ffn_hidden_size": 2 * hidden,
            "expert_ffn_hidden_size": hidden // 2, "moe_topk": 2, "n_routed_experts": 4,
            "zero_expert_num": 2, "num_layers": num_layers, "max_position_embeddings": 4096,
            "num_attention_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 48,
            "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
            "routed_scaling_factor": 1.0, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "mla_scale_q_lora": True, "mla_scale_kv_lora": True, "attention_bias": False,
            "norm_topk_prob": False, "tie_word_embeddings": False}


def _unsplit_mla(weights: dict, prefix: str):
    """mlx-lm's ``embed_q`` / ``unembed_out`` under ``prefix`` -> the released ``kv_b_proj``."""
    wk = weights.pop(prefix + "embed_q.weight", None)
    if wk is not None:
        wv = weights.pop(prefix + "unembed_out.weight")
        kv_b = mx.concatenate([wk.swapaxes(-1, -2), wv], axis=1)
        weights[prefix + "kv_b_proj.weight"] = kv_b.reshape(-1, kv_b.shape[-1])


def longcat_flash_to_hf(model, drop_mtp: bool = False) -> dict:
    flat = dict(tree_flatten(model.parameters()))
    out = {k: v for k, v in flat.items() if not k.startswith("mtp.")}
    for layer in range(len(model.model.layers)):
        _unsplit(out, f"model.layers.{layer}.", model.args)  # experts
        for i in range(2):
            _unsplit_mla(out, f"model.layers.{layer}.self_attn.{i}.")
    if model.num_mtp_layers and not drop_mtp:
        mtp = model.checkpoint_mtp_names({k: v for k, v in flat.items()
                                          if k.startswith("mtp.")})
        _unsplit_mla(mtp, "model.mtp.layers.0.self_attn.")
        mtp["model.mtp.embed_tokens.weight"] = flat["model.embed_tokens.weight"]
        out.update(mtp)
    return out


def make_tiny_longcat_flash(path, head: str = "random", **kw) -> Path:
    return write_tiny(path, longcat_flash_config, longcat_flash_to_hf, head, **kw)


def dsa_config(family: str = "deepseek_v32", index_topk: int = 6, **kw) -> dict:
    """DeepSeek-V3's tiny MLA + MoE shape with a sparse-attention indexer whose top-k is
    small, so short contexts cross it."""
    cfg = dict(tiny_config("deepseek_v3", **kw), model_type=family, index_head_dim=16,
               index_n_heads=2, index_topk=index_topk)
    if family == "glm_moe_dsa":
        return dict(cfg, architectures=["GlmMoeDsaForCausalLM"], indexer_rope_interleave=True,
                    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    return dict(cfg, architectures=["DeepseekV32ForCausalLM"], indexer_rope_interleave=False)


def make_tiny_dsa(path, family: str = "deepseek_v32", head: str = "random", **kw) -> Path:
    """``fp8=True``: the projections in the FP8 release form (as ``tiny_attention.make_tiny``)."""
    return write_tiny(path, lambda **c: dsa_config(family, **c), to_hf, head, **kw)
