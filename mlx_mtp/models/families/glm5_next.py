"""GLM-5.3-Flash (``model_type: glm5_next``, ``Glm5NextForConditionalGeneration``), with its
MTP head.

mlx-lm 0.32 has no trunk for it; this one is checked against transformers 5.24.0's
``Glm5NextTextModel`` on a tiny checkpoint written by transformers itself
(``tests/fixtures/glm5_next/make_reference.py``).

Layers: KDA and NoPE MLA (3:1 in the release), dense MLPs then MoE (sigmoid routing with a
correction bias, SwiGLU clamped at ``swiglu_limit``), on ``hc_mult`` residual streams
(mHC, ``blocks/mhc.py``); the output is the streams' plain mean, then the final norm.

KDA is Bailing's (``bailing_hybrid.kda``: three short convolutions, the gated delta rule with
a lower-bounded forget gate, replay on rollback) with low-rank forget and output gates.
MLA layers attend to what the k-pool indexer selects (``blocks/kpool.py``); a "shared"
layer reuses the selection of the indexed layer just before it (as transformers does: that
layer must run its own indexer).

The head (mlx-vlm 0.7.10's ``glm5_next_mtp`` layout; transformers ignores it) is layer
``num_hidden_layers``: ``eh_proj([enorm(embed(t+1)), hnorm(h)])`` with ``h`` the trunk's
post-norm hidden (the embedding is zero at position 0), one indexed MLA + MoE block on a
plain residual (no hyper-connections), then ``shared_head.norm``; a chained draft reads that
normed output.

Checkpoint: the text model under ``model.language_model.*``, one tensor per expert (or the
fused form), the three KDA convolutions apart, ``hc_{attn,ffn}_{fn,base,scale}``; the vision
tower is dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import BaseModelArgs
from mlx_lm.models.deepseek_v3 import group_expert_select
from mlx_lm.models.switch_layers import SwitchGLU

from ..blocks.attention_trunk import quantized_latent_attention
from ..blocks.dsv4 import ClampedSwiGLU
from ..blocks.expert_split import split_parts
from ..blocks.hybrid_shard import read_share
from ..blocks.kpool import KPoolIndexer
from ..blocks.mhc import HyperConnection, expand
from ..blocks.stream_shard import shard_kda, shard_mlp, shard_moe, shard_nope_mla
from ..cache.index import pooled_key_cache
from ..cache.kv import KVCache
from ..cache.recurrent import RecurrentCache
from ..interface import Capabilities, MTPModel
from ..io import layout
from ..io.layout import CheckpointError, MissingMTPWeightsError
from .bailing_hybrid import kda

HC_NAMES = re.compile(r"\.hc_(attn|ffn)_(fn|base|scale)$")
LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    layer_types: List[str]
    mlp_layer_types: List[str]
    indexer_types: List[str]
    qk_rope_head_dim: int = 0
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    swiglu_limit: float = 10.0
    linear_head_dim: int = 128
    linear_num_heads: int = 64
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: Optional[float] = -5.0
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    mtp_num_hidden_layers: int = 0

    @classmethod
    def from_dict(cls, params: dict):
        """transformers' ``Glm5NextTextConfig`` defaults for the per-layer schedules."""
        text = dict(layout.text_config(params), model_type=params["model_type"])
        text["tie_word_embeddings"] = layout.tie_word_embeddings(params)
        text["mtp_num_hidden_layers"] = layout.config_mtp_layers(params)
        n = text.get("num_hidden_layers", 45)
        text["mlp_layer_types"] = text.get("mlp_layer_types") or (
            ["dense"] * min(3, n) + ["sparse"] * (n - 3))
        text["layer_types"] = [
            "indexed_attention" if t == "full_attention" else t
            for t in text.get("layer_types") or [
                "indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]]
        text["indexer_types"] = text.get("indexer_types") or indexer_schedule(text, n)
        linear = text.get("linear_attn_config") or {}
        for ours, theirs in (("linear_head_dim", "head_dim"), ("linear_num_heads", "num_heads"),
                             ("linear_conv_kernel_dim", "short_conv_kernel_size"),
                             ("linear_lower_bound", "gate_lower_bound")):
            if theirs in linear:
                text[ours] = linear[theirs]
        return super().from_dict(text)

    def __post_init__(self):
        if self.qk_rope_head_dim:
            raise CheckpointError("glm5_next: its MLA is NoPE (qk_rope_head_dim 0), the config "
                                  f"has {self.qk_rope_head_dim}")
        if self.n_group != 1:
            raise CheckpointError("glm5_next: grouped expert routing (n_group > 1) is not "
                                  "supported")
        if self.linear_lower_bound is None:
            raise CheckpointError("glm5_next: KDA without a gate lower bound is not supported")
        unknown = sorted(set(self.layer_types) - {"linear_attention", "indexed_attention"})
        if unknown:
            raise CheckpointError(f"glm5_next: unknown layer_types {unknown}")
        for i in range(self.num_hidden_layers):
            if self.shares_selection(i) and (
                    i == 0 or self.layer_types[i - 1] != "indexed_attention"
                    or self.indexer_types[i - 1] != "full"):
                raise CheckpointError(f"glm5_next: layer {i} reuses the indexer selection, but "
                                      "the layer before it runs no indexer")

    def shares_selection(self, layer: int) -> bool:
        return (self.layer_types[layer] == "indexed_attention"
                and self.indexer_types[layer] == "shared")


def indexer_schedule(text: dict, n: int) -> List[str]:
    """``index_topk_pattern`` ("FSS..."), else every ``index_topk_freq``-th layer from
    ``index_skip_topk_offset`` runs its indexer (transformers' rule)."""
    pattern = text.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) \
            else list(pattern)
    freq, offset = max(text.get("index_topk_freq", 1), 1), text.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, hidden, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, args.hidden_size, bias=False)
        self.act = ClampedSwiGLU(args.swiglu_limit)

    def __call__(self, x):
        return self.down_proj(self.act(self.up_proj(x), self.gate_proj(x)))


class Router(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.weight = mx.zeros((args.n_routed_experts, args.hidden_size))
        self.e_score_correction_bias = mx.zeros((args.n_routed_experts,))

    def __call__(self, x):
        a = self.args
        logits = x.astype(mx.float32) @ self.weight.astype(mx.float32).T
        return group_expert_select(logits, self.e_score_correction_bias, a.num_experts_per_tok,
                                   a.n_group, a.topk_group, a.routed_scaling_factor,
                                   a.norm_topk_prob)


class MoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = Router(args)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size,
                                    args.n_routed_experts, activation=ClampedSwiGLU(args.swiglu_limit))
        self.shared_experts = MLP(args, args.moe_intermediate_size * args.n_shared_experts)

    def __call__(self, x):
        indices, weights = self.gate(x)
        y = (self.switch_mlp(x, indices) * weights[..., None].astype(x.dtype)).sum(axis=-2)
        return y + self.shared_experts(x)


class KDA(nn.Module):
    """Kimi Delta Attention with low-rank forget (``f_a``/``f_b``) and output (``g_a``/
    ``g_b``) gates; run by ``bailing_hybrid.kda`` (which reads ``f_proj`` and ``g_proj``)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        H, D, heads = args.hidden_size, args.linear_head_dim, args.linear_num_heads
        self.num_heads, self.head_dim = heads, D
        self.projection_size, self.conv_kernel_size = heads * D, args.linear_conv_kernel_dim
        self.lower_bound = args.linear_lower_bound
        P, K = self.projection_size, self.conv_kernel_size
        for name in ("q", "k", "v"):
            setattr(self, f"{name}_proj", nn.Linear(H, P, bias=False))
            setattr(self, f"{name}_conv1d", nn.Conv1d(P, P, K, groups=P, bias=False))
        self.f_a_proj, self.f_b_proj = nn.Linear(H, D, bias=False), nn.Linear(D, P, bias=False)
        self.g_a_proj, self.g_b_proj = nn.Linear(H, D, bias=False), nn.Linear(D, P, bias=False)
        self.A_log = mx.zeros((heads,))
        self.dt_bias = mx.zeros((P,))
        self.b_proj = nn.Linear(H, heads, bias=False)
        self.o_norm = nn.RMSNorm(D, eps=args.rms_norm_eps)
        self.o_proj = nn.Linear(P, H, bias=False)

    def f_proj(self, x):
        return self.f_b_proj(self.f_a_proj(x))

    def g_proj(self, x):
        return self.g_b_proj(self.g_a_proj(x))


class IndexedMLA(nn.Module):
    """NoPE MLA over the keys the indexer selects (its own, or the previous layer's).
    Caches: (latents[, indexer keys])."""

    def __init__(self, args: ModelArgs, shared: bool):
        super().__init__()
        self.heads, self.nope, self.v_dim = (args.num_attention_heads, args.qk_nope_head_dim,
                                             args.v_head_dim)
        H, eps = args.hidden_size, args.rms_norm_eps
        self.q_a_proj = nn.Linear(H, args.q_lora_rank, bias=False)
        self.q_a_layernorm = nn.RMSNorm(args.q_lora_rank, eps=eps)
        self.q_b_proj = nn.Linear(args.q_lora_rank, self.heads * self.nope, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, args.kv_lora_rank, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(args.kv_lora_rank, eps=eps)
        self.kv_b_proj = nn.Linear(args.kv_lora_rank, self.heads * (self.nope + self.v_dim),
                                   bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, H, bias=False)
        if not shared:
            self.indexer = KPoolIndexer(args)

    def __call__(self, x, caches, selection=None):
        """(output, the selection mask (B, 1, L, T) it attended with)."""
        B, L, _ = x.shape
        latent_cache, key_cache = (*caches, None)[:2] if caches else (None, None)
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).reshape(B, L, self.heads, self.nope).transpose(0, 2, 1, 3)
        latent = self.kv_a_layernorm(self.kv_a_proj_with_mqa(x))[:, None]
        if latent_cache is not None:
            latent, _ = latent_cache.update_and_fetch(latent, latent)
        if "indexer" in self:
            selection = self.indexer(x, q_resid, key_cache)
        # Absorbed: queries and outputs go through kv_b_proj's halves, so attention runs on
        # the cached latents (one key/value head) instead of expanding every position.
        w = self.kv_b_weight().reshape(self.heads, self.nope + self.v_dim, -1)
        if isinstance(latent, tuple):  # --kv-bits: the cache's quantized triples
            quant = dict(group_size=latent_cache.group_size, bits=latent_cache.bits)
            dtype = latent[1].dtype  # the scales': the cached latents' dtype
            bias = 0.0 if selection is None else mx.where(
                selection, mx.array(0, dtype), mx.array(mx.finfo(dtype).min, dtype))
            out = quantized_latent_attention(q @ w[:, : self.nope], latent, bias,
                                             self.nope**-0.5, quant)
        else:
            out = mx.fast.scaled_dot_product_attention(q @ w[:, : self.nope], latent, latent,
                                                       scale=self.nope**-0.5, mask=selection)
        out = out @ w[:, self.nope:].swapaxes(-1, -2)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1)), selection

    def kv_b_weight(self):
        """(heads · (nope + v), latent) as floats, dequantized if quantized."""
        proj = self.kv_b_proj
        if not isinstance(proj, nn.QuantizedLinear):
            return proj.weight
        return mx.dequantize(proj.weight, proj.scales, proj.get("biases"), proj.group_size,
                             proj.bits)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        self.is_linear = args.layer_types[index] == "linear_attention"
        self.shared = args.shares_selection(index)
        self.self_attn = KDA(args) if self.is_linear else IndexedMLA(args, self.shared)
        dense = args.mlp_layer_types[index] == "dense"
        self.mlp = MLP(args, args.intermediate_size) if dense else MoE(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.attn_hc = HyperConnection(args)
        self.ffn_hc = HyperConnection(args)

    def make_caches(self, kv_cache=KVCache, quant=None) -> list:
        """``kv_cache``: the latents' cache factory (the model's, quantized with ``--kv-bits``,
        ``quant``, as the k-pool indexer's keys then are)."""
        if self.is_linear:
            return [RecurrentCache()]
        return [kv_cache()] + ([] if self.shared else [pooled_key_cache(quant)])

    def __call__(self, streams, caches, selection, capture: bool = False):
        """streams (B, L, hc, H) -> (streams, the selection a next shared layer reuses)."""
        post, comb, h = self.attn_hc(streams)
        h = self.input_layernorm(h)
        if self.is_linear:
            out, selection = kda(self.self_attn, h, caches[0] if caches else None, capture), None
        else:
            out, selection = self.self_attn(h, caches, selection)
        streams = expand(post, comb, out, streams)
        post, comb, h = self.ffn_hc(streams)
        return expand(post, comb, self.mlp(self.post_attention_layernorm(h)), streams), selection


class Trunk(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.hc = args.hc_mult
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, streams, cache=None, capture=False, taps=()):
        """(the streams after the last layer, {tapped layer: its streams' mean})."""
        tapped, i, selection = {}, 0, None
        for n, layer in enumerate(self.layers):
            width = 1 if layer.is_linear else 1 + (not layer.shared)
            caches = cache[i: i + width] if cache is not None else None
            i += width
            streams, selection = layer(streams, caches, selection, capture)
            if n in taps:
                tapped[n] = streams.mean(axis=2)
        return streams, tapped


class MTPLayer(nn.Module):
    """The checkpoint's layer after the trunk's (see the module doc). Caches: (latents,
    indexer keys)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        H, eps = args.hidden_size, args.rms_norm_eps
        self.enorm, self.hnorm = nn.RMSNorm(H, eps=eps), nn.RMSNorm(H, eps=eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.self_attn = IndexedMLA(args, shared=False)
        self.mlp = MoE(args)
        self.input_layernorm = nn.RMSNorm(H, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=eps)
        self.shared_head = SharedHead(H, eps)

    def __call__(self, hidden, embeds, caches):
        offset = caches[0].offset if caches else 0
        first = (mx.array(offset).reshape(-1, 1) + mx.arange(embeds.shape[1]) == 0)[..., None]
        embeds = mx.where(first, mx.zeros_like(embeds), embeds)
        x = self.eh_proj(mx.concatenate([self.enorm(embeds), self.hnorm(hidden)], axis=-1))
        x = x + self.self_attn(self.input_layernorm(x), caches)[0]
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.shared_head.norm(x)


class SharedHead(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=eps)


class MTPHead(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.layers = [MTPLayer(args) for _ in range(args.mtp_num_hidden_layers)]


class Model(MTPModel):
    # Pipeline stages hand on the streams; tensor: ``blocks/stream_shard``; expert: the MoE
    # blocks' ``switch_mlp`` (``blocks/expert_split``).
    capabilities = Capabilities(splits=("pipeline", "tensor", "expert"), taps=True)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Trunk(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.mtp_num_hidden_layers > 0:
            self.mtp = MTPHead(args)

    def trunk_layers(self, inputs, cache=None, capture=False, taps=()):
        h = self.embed(inputs)
        B, L, H = h.shape
        return self.model(mx.broadcast_to(h[:, :, None], (B, L, self.model.hc, H)), cache,
                          capture, taps)

    def stage_layers(self, ids, hidden, cache=None, capture=False, taps=()):
        return self.model(hidden, cache, capture, taps)

    def stage_shape(self, B: int, L: int) -> tuple:
        return (B, L, self.args.hc_mult, self.args.hidden_size)

    def stage_may_start(self, layer: int) -> bool:
        return not self.args.shares_selection(layer)  # it reads the layer before's selection

    def trunk_outputs(self, streams):
        """The output is the streams' plain mean, then the final norm."""
        return super().trunk_outputs(streams.mean(axis=2))

    def shard(self, group):
        """By KDA and MLA heads, MLP and expert columns (``blocks/stream_shard``); the mHC
        mixers and indexers whole on every rank. One layer read at a time."""
        for layer in split_parts(self):
            attn = layer.self_attn
            (shard_kda if isinstance(attn, KDA) else shard_nope_mla)(attn, group)
            (shard_moe if isinstance(layer.mlp, MoE) else shard_mlp)(layer.mlp, group)
            read_share(layer)

    def mtp_forward(self, hidden, next_tokens, mtp_cache, depth: int = 0,
                    last_only: bool = False):
        """hidden (B,S,H): the trunk's post-norm hidden (or the head's output) at positions
        i; next_tokens (B,S) = t_{i+1}. Every depth runs the checkpoint's one layer."""
        layer = self.mtp.layers[depth % len(self.mtp.layers)]
        i = 2 * (depth % len(self.mtp.layers))
        out = layer(hidden, self.model.embed_tokens(next_tokens),
                    mtp_cache[i: i + 2] if mtp_cache else None)
        return out[:, -1:] if last_only else out

    @property
    def num_mtp_caches(self) -> int:
        return 2 * self.num_mtp_layers  # latents, indexer keys

    def make_cache(self):
        return [c for layer in self.model.layers
                for c in layer.make_caches(self.full_attention_cache, self.kv_quantization)]

    def use_kv_quantization(self, quant):
        """The MLA latents and the k-pool indexer's keys and gates (each a whole number of
        groups); KDA states keep their precision."""
        self.quantize_attention_caches(quant, self.args.kv_lora_rank, self.args.index_head_dim)

    def make_mtp_cache(self):
        return [c for _ in range(self.num_mtp_layers)
                for c in (self.full_attention_cache(), pooled_key_cache(self.kv_quantization))]

    @staticmethod
    def cast_predicate(path: str) -> bool:
        """Kept float32 as transformers keeps them: the router and its bias, KDA's decay,
        mHC's biases and scales."""
        return not path.endswith(("mlp.gate.weight", "e_score_correction_bias", "A_log",
                                  "dt_bias", "hc.base", "hc.scale"))

    def sanitize(self, weights: dict):
        return sanitize(self, layout.text_weight_names(weights))


def is_head_layer(key: str, num_hidden_layers: int) -> bool:
    m = LAYER.match(key)
    return m is not None and int(m.group(1)) >= num_hidden_layers


def sanitize(model: Model, weights: dict) -> dict:
    """Checkpoint names and forms -> ours (see the module doc): the MTP layer
    ``model.layers.{num_hidden_layers + i}`` becomes ``mtp.layers.{i}`` (dropped when the
    head is not loaded), without its copies of the embedding and output projection."""
    n, n_mtp = model.args.num_hidden_layers, model.num_mtp_layers
    if n_mtp and not any(layout.is_mtp_key(k) or is_head_layer(k, n) for k in weights):
        raise MissingMTPWeightsError(layout.missing_mtp_message(model))
    out = {}
    for k, v in weights.items():
        if is_head_layer(k, n):
            m = LAYER.match(k)
            if int(m.group(1)) >= n + n_mtp or k.endswith(("embed_tokens.weight",
                                                            "shared_head.head.weight")):
                continue
            k = f"mtp.layers.{int(m.group(1)) - n}.{k[m.end():]}"
        if (model.args.tie_word_embeddings and k == "lm_head.weight") or (
                not n_mtp and layout.is_mtp_key(k)):
            continue
        if k.endswith("conv1d.weight") and v.shape[-1] != 1:
            v = v.moveaxis(2, 1)  # (C, 1, K) -> MLX's (C, K, 1)
        out[HC_NAMES.sub(lambda m: f".{m.group(1)}_hc.{m.group(2)}", k)] = v
    prefixes = [f"model.layers.{i}.mlp" for i in range(n)]
    for p in prefixes + [f"mtp.layers.{i}.mlp" for i in range(n_mtp)]:
        layout.split_experts(out, p, model.args.n_routed_experts)
    return out
