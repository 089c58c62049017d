"""Tiny checkpoints of the stream families (``qwen4_exp``, ``glm5_next``, ``deepseek_v4``) in
the released Hugging Face layout at any width, for the oracle benchmark
(``benchmarks/families_oracle.py``) and tests. The tests' reference fixtures come from
transformers' classes (``tests/fixtures/*``); these are written from our own model, under the
names and in the forms those fixtures hold (``tests/test_families_oracle_fixtures.py`` checks
that each writer gives a fixture's tensors back from the model loaded from it).

``qwen4_exp``: ``model.language_model.*``, per-expert trunk experts, the head's experts fused
(``experts.gate_up_proj``), the n-gram tables in ``split_ngram_parts`` shards beside their hash
buffers, norms zero-centred, convolutions as (C, 1, K); the head at ``mtp.*``.
``glm5_next``: ``model.language_model.*`` with ``hc_{attn,ffn}_{fn,base,scale}``, per-expert
experts, the head as layer ``model.language_model.layers.{N}``, a few vision tensors.
``deepseek_v4``: DeepSeek's names (``embed``, ``head``, ``layers.*``, ``hc_head_*``, experts
``w1``/``w2``/``w3``), the head at ``mtp.0.*``.

Heads: ``random``, or ``oracle``: the model made context-free (every sub-block writes nothing
but the last layer's MoE, embeddings of RMS 1) and the head that last layer on the embedding
of t+1 alone, so its draft is the trunk's own prediction at every chained depth (acceptance
100 %). The compressors, indexers and stream mixers still run and fill their caches.
"""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .tiny_attention import write_tiny

WINDOW, INDEX_TOPK = 8, 8  # the tests' sizes: windows wrap, indexers select within 20 tokens
NGRAM_PARTS = 2  # the n-gram tables' shards, as ``split_ngram_parts`` declares
EXPERTS = ("gate_proj", "up_proj", "down_proj")


def context_free_parameters(model, writes: tuple, kept: str) -> dict:
    """``model``'s parameters (flattened) made context-free for an oracle head, which then
    copies the kept block: every weight ending in one of ``writes`` (what a sub-block writes
    to the residual) zero but those under ``kept``, and embeddings of RMS 1. The caller wires
    the head and applies them (``model.update(tree_unflatten(...))``)."""
    params = dict(tree_flatten(model.parameters()))
    for k, v in list(params.items()):
        if k.endswith(writes) and not k.startswith(kept):
            params[k] = mx.zeros_like(v)
    e = params["model.embed_tokens.weight"]
    params["model.embed_tokens.weight"] = e / mx.sqrt((e * e).mean(axis=-1, keepdims=True))
    return params


def _oracle_model(make):
    """``write_tiny``'s ``oracle`` hook from a recipe ``make(model)`` (no ``noisy`` head)."""
    def oracle(model, trunk_scale: float, proj_noise: float, seed: int):
        if proj_noise:
            raise ValueError(f"{model.model_type}: only a random or an oracle head is built")
        make(model)
        mx.eval(model.parameters())
    return oracle


def _per_expert(out: dict, prefix: str, weights: dict, names=EXPERTS):
    """Stacked ``{prefix}switch_mlp.*`` in ``weights`` -> ``out``'s ``{prefix}experts.{e}.*``."""
    for ours, theirs in zip(EXPERTS, names):
        stacked = weights.pop(f"{prefix}switch_mlp.{ours}.weight", None)
        for e in range(0 if stacked is None else stacked.shape[0]):
            out[f"{prefix}experts.{e}.{theirs}.weight"] = stacked[e]


def _conv(k: str, v):
    return v.moveaxis(2, 1) if k.endswith("conv1d.weight") else v  # MLX (C, K, 1) -> (C, 1, K)


# --- qwen4_exp ---------------------------------------------------------------------------

def qwen4_exp_config(vocab_size: int = 128, hidden: int = 64, num_layers: int = 4,
                     index_budget: int = INDEX_TOPK) -> dict:
    """DeltaNet and indexed attention 3:1 (the last layer indexed), PLE on layers 1, 3 and 6
    (one-indexed) where they are DeltaNet layers, blocks of 2 keys of which ``index_budget``
    keys are kept."""
    types = ["indexed_attention" if (i + 1) % 4 == 0 or i == num_layers - 1
             else "linear_attention" for i in range(num_layers)]
    text = dict(
        model_type="qwen4_exp_text", vocab_size=vocab_size, hidden_size=hidden,
        num_hidden_layers=num_layers, layer_types=types, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=4096,
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=hidden // 2,
        shared_expert_intermediate_size=hidden // 2, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, hc_count=4, hc_lowrank=8,
        ple_layer_ids=[i for i in (1, 3, 6) if i <= num_layers
                       and types[i - 1] == "linear_attention"],
        ple_embed_dim=hidden, ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=2,
        ngram_vocab_size_base=96, make_ngram_vocab_size_divisible_by=16, seed=1234,
        split_ngram_parts=NGRAM_PARTS, indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=8,
        indexer_budget=index_budget, indexer_compress_ratio=2, eos_token_id=1,
        output_gate_type="sigmoid", tie_word_embeddings=False, mtp_num_hidden_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
                         "mrope_interleaved": True})
    return {"architectures": ["Qwen4ExpForConditionalGeneration"], "model_type": "qwen4_exp",
            "text_config": text, "tie_word_embeddings": False, "eos_token_id": 1}


def qwen4_exp_to_hf(model, drop_mtp: bool = False) -> dict:
    from ..models.families.qwen4_exp import ZERO_CENTRED

    flat = dict(tree_flatten(model.parameters()))
    out = {}
    for i, layer in enumerate(model.model.layers):
        _per_expert(out, f"model.layers.{i}.mlp.", flat)
        if "ple" in layer:
            ids, p = layer.ple.ple_embedding.ids, f"model.layers.{i}.ple.ple_embedding."
            table = flat.pop(p + "ngram_embedding.weight")
            for s, shard in enumerate(mx.split(table, NGRAM_PARTS)):
                out[f"{p}ngram_embedding.shard_{s}.weight"] = shard
            out.update({p + "layer_multipliers": ids.multipliers, p + "ngram_heads_offsets":
                        ids.offsets, p + "ngram_heads_vocab_sizes": ids.sizes})
    for prefix in {k.split("switch_mlp.")[0] for k in flat if k.startswith("mtp.layers.")
                   and ".switch_mlp." in k}:  # the head's experts fused
        gate, up, down = (flat.pop(f"{prefix}switch_mlp.{p}.weight") for p in EXPERTS)
        out[prefix + "experts.gate_up_proj"] = mx.concatenate([gate, up], axis=1)
        out[prefix + "experts.down_proj"] = down
    for k, v in flat.items():
        out[k] = v - 1 if v.ndim == 1 and ZERO_CENTRED.search(k) else _conv(k, v)
    out = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
           for k, v in out.items()}
    return {k: v for k, v in out.items() if not (drop_mtp and k.startswith("mtp."))}


def qwen4_exp_oracle(model):
    """The head is the last layer and the trunk's mixer on ``fc_embedding = I``
    (``fc_hidden = 0``)."""
    last = len(model.model.layers) - 1
    silent = ("o_proj.weight", "out_proj.weight", "value_proj.weight", "down_proj.weight",
              "shared_expert_gate.weight")
    params = context_free_parameters(model, silent, f"model.layers.{last}.mlp")
    for k in [k for k in params if k.startswith("mtp.")]:
        src = {"mtp.layers.0.": f"model.layers.{last}.",
               "mtp.hyper_connection_mixer.": "model.hyper_connection_mixer."}
        for a, b in src.items():
            if k.startswith(a):
                params[k] = params[b + k[len(a):]]
    H = model.args.hidden_size
    params["mtp.pre_fc_norm_embedding.weight"] = mx.ones((H,))
    params["mtp.fc_embedding.weight"] = mx.eye(H)
    params["mtp.fc_hidden.weight"] = mx.zeros((H, H))
    model.update(tree_unflatten(list(params.items())))
    return model


def make_tiny_qwen4_exp(path, head: str = "random", **kw) -> Path:
    return write_tiny(path, qwen4_exp_config, qwen4_exp_to_hf, head,
                      oracle=_oracle_model(qwen4_exp_oracle), **kw)


# --- glm5_next ---------------------------------------------------------------------------

GLM5_VISION = {"model.visual.patch_embed.proj.weight": (16, 3, 2, 14, 14),
               "model.visual.merger.proj.weight": (32, 32)}


def glm5_next_config(vocab_size: int = 128, hidden: int = 64, num_layers: int = 3,
                     index_topk: int = INDEX_TOPK) -> dict:
    """KDA and indexed MLA layers (L, I, I repeated: the second indexed layer reuses the
    first one's selection), MoE from layer 1, pools of 4 keys of which ``index_topk`` keys
    are kept; the head an indexed MoE layer after the trunk's."""
    types = [("linear_attention", "indexed_attention", "indexed_attention")[i % 3]
             for i in range(num_layers)]
    indexers = [("full", "full", "shared")[i % 3] for i in range(num_layers)]
    text = dict(
        model_type="glm5_next_text", vocab_size=vocab_size, hidden_size=hidden,
        intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=2,
        n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=16, q_lora_rank=24,
        qk_rope_head_dim=0, qk_nope_head_dim=16, qk_head_dim=16, v_head_dim=16, head_dim=0,
        layer_types=types, indexer_types=indexers,
        mlp_layer_types=["dense"] + ["sparse"] * (num_layers - 1), index_topk=index_topk,
        index_head_dim=16, index_n_heads=16, index_kpool=4, index_kpool_always_select_tail=True,
        linear_head_dim=8, linear_num_heads=2, linear_conv_kernel_dim=4,
        linear_lower_bound=-5.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=10.0,
        pad_token_id=0, eos_token_id=1, rms_norm_eps=1e-5, max_position_embeddings=1048576,
        tie_word_embeddings=False, num_nextn_predict_layers=1)
    return {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
            "text_config": text, "tie_word_embeddings": False,
            "vision_config": {"model_type": "glm5_next_vision", "depth": 1, "hidden_size": 16}}


def glm5_next_to_hf(model, drop_mtp: bool = False) -> dict:
    flat = dict(tree_flatten(model.parameters()))
    n, out = model.args.num_hidden_layers, {}
    for k in {k.split("switch_mlp.")[0] for k in flat if ".switch_mlp." in k}:
        _per_expert(out, k, flat)
    out.update(flat)
    released = {}
    for k, v in out.items():
        if k.startswith("mtp."):
            if drop_mtp:
                continue
            i, rest = re.match(r"mtp\.layers\.(\d+)\.(.*)", k).groups()
            k = f"model.layers.{n + int(i)}.{rest}"
        k = re.sub(r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2", k)
        k = "model.language_model." + k[len("model."):] if k.startswith("model.") else k
        released[k] = _conv(k, v)
    rng = np.random.default_rng(4)
    released.update({k: mx.array(rng.standard_normal(s), mx.float32)
                     for k, s in GLM5_VISION.items()})
    return released


def glm5_next_oracle(model):
    """The head is the last layer's MoE on ``eh_proj = [I | 0]`` (the embedding alone), whose
    stream ``post`` weights are made exactly 1; its final norm the trunk's."""
    last, hc = len(model.model.layers) - 1, model.args.hc_mult
    params = context_free_parameters(model, ("o_proj.weight", "down_proj.weight"),
                                     f"model.layers.{last}.mlp")
    fn, base = f"model.layers.{last}.ffn_hc.fn", f"model.layers.{last}.ffn_hc.base"
    params[fn] = params[fn] * (1 - ((mx.arange(params[fn].shape[0]) // hc) == 1)[:, None])
    params[base] = params[base] * (1 - ((mx.arange(params[base].shape[0]) // hc) == 1))
    for k in [k for k in params if k.startswith("mtp.layers.0.mlp.")
              or k.startswith("mtp.layers.0.post_attention_layernorm.")]:
        params[k] = params[f"model.layers.{last}." + k[len("mtp.layers.0."):]]
    H = model.args.hidden_size
    params["mtp.layers.0.enorm.weight"] = mx.ones((H,))
    params["mtp.layers.0.eh_proj.weight"] = mx.concatenate([mx.eye(H), mx.zeros((H, H))], 1)
    params["mtp.layers.0.shared_head.norm.weight"] = params["model.norm.weight"]
    model.update(tree_unflatten(list(params.items())))
    return model


def make_tiny_glm5_next(path, head: str = "random", **kw) -> Path:
    return write_tiny(path, glm5_next_config, glm5_next_to_hf, head,
                      oracle=_oracle_model(glm5_next_oracle), **kw)


# --- deepseek_v4 -------------------------------------------------------------------------

DSV4_LAYERS = ("sliding_attention", "compressed_sparse_attention",
               "heavily_compressed_attention", "compressed_sparse_attention")


def deepseek_v4_config(vocab_size: int = 128, hidden: int = 64, num_layers: int = 4,
                       window: int = WINDOW, index_topk: int = 2) -> dict:
    """Sliding, compressed-sparse (windows of 4, ``index_topk`` entries kept) and heavily
    compressed (windows of 8) layers; the first MoE routed by token hash."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": vocab_size, "hidden_size": hidden, "moe_intermediate_size": hidden // 2,
        "num_hidden_layers": num_layers, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 32, "qk_rope_head_dim": 8, "q_lora_rank": 16, "o_groups": 2,
        "o_lora_rank": 8, "num_experts_per_tok": 2, "n_routed_experts": 4, "n_shared_experts": 1,
        "norm_topk_prob": True, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus",
        "swiglu_limit": 10.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "compress_rope_theta": 160000.0, "sliding_window": window, "index_n_heads": 16,
        "index_head_dim": 16, "index_topk": index_topk, "partial_rotary_factor": 0.25,
        "layer_types": [DSV4_LAYERS[i % 4] for i in range(num_layers)],
        "mlp_layer_types": ["hash_moe"] + ["moe"] * (num_layers - 1),
        "rope_parameters": {
            "compress": {"attention_factor": 1.0, "beta_fast": 32, "beta_slow": 1,
                         "factor": 4.0, "original_max_position_embeddings": 32,
                         "partial_rotary_factor": 0.25, "rope_theta": 160000.0,
                         "rope_type": "yarn"},
            "main": {"partial_rotary_factor": 0.25, "rope_theta": 10000.0,
                     "rope_type": "default"}},
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 1048576,
        "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1}


def deepseek_v4_to_hf(model, drop_mtp: bool = False) -> dict:
    flat = dict(tree_flatten(model.parameters()))
    out = {}
    for k in {k.split("switch_mlp.")[0] for k in flat if ".switch_mlp." in k}:
        _per_expert(out, k, flat, names=("w1", "w3", "w2"))
    out.update(flat)
    released = {}
    for k, v in out.items():
        if drop_mtp and k.startswith("mtp."):
            continue
        k = re.sub(r"^mtp\.layers\.(\d+)\.(block\.)?", r"mtp.\1.", k)
        k = re.sub(r"(^|\.)hc_head\.", r"\1hc_head_", k.replace("model.hc_head.", "hc_head."))
        for ours, theirs in (("model.embed_tokens.", "embed."), ("lm_head.", "head."),
                             ("model.norm.", "norm."), ("model.layers.", "layers.")):
            if k.startswith(ours):
                k = theirs + k[len(ours):]
        released[k] = v
    return released


def _hash_routes(model):
    """The hash-routed MoE's token -> experts table (zeros in our init): distinct experts."""
    rng = np.random.default_rng(6)
    updates = []
    for k, v in tree_flatten(model.parameters()):
        if k.endswith("tid2eid"):
            rows = [rng.permutation(model.args.n_routed_experts)[:v.shape[1]]
                    for _ in range(v.shape[0])]
            updates.append((k, mx.array(np.stack(rows), v.dtype)))
    model.load_weights(updates, strict=False)


def deepseek_v4_oracle(model):
    """The head's block is the last layer (its attention silent too), its ``hc_head`` and
    norm the trunk's, on ``e_proj = I`` (``h_proj = 0``)."""
    last, H = len(model.model.layers) - 1, model.args.hidden_size
    params = context_free_parameters(model, ("wo_b.weight", "w2.weight", "down_proj.weight"),
                                     f"model.layers.{last}.ffn.")
    block = "mtp.layers.0.block."
    for k in [k for k in params if k.startswith(block) and not k.endswith("wo_b.weight")]:
        params[k] = params[f"model.layers.{last}." + k[len(block):]]
    for part in ("fn", "base", "scale"):
        params[f"mtp.layers.0.hc_head.{part}"] = params[f"model.hc_head.{part}"]
    params["mtp.layers.0.norm.weight"] = params["model.norm.weight"]
    params["mtp.layers.0.enorm.weight"] = mx.ones((H,))
    params["mtp.layers.0.e_proj.weight"] = mx.eye(H)
    params["mtp.layers.0.h_proj.weight"] = mx.zeros((H, H))
    model.update(tree_unflatten(list(params.items())))
    return model


def make_tiny_deepseek_v4(path, head: str = "random", **kw) -> Path:
    return write_tiny(path, deepseek_v4_config, deepseek_v4_to_hf, head, prepare=_hash_routes,
                      oracle=_oracle_model(deepseek_v4_oracle), **kw)
