"""Qwen4-Exp / "Qwen3.8-Flash-Next" (``model_type: qwen4_exp``), with its MTP head.

mlx-lm 0.32 has no trunk for it; this one is built from Qwen3.5's pieces
(``blocks/hybrid``: Gated DeltaNet, gated attention, the MoE block) and two of its own:
``blocks/hyper`` (hyper-connection streams, PLE) and ``blocks/qsa`` (indexed attention).
Checked against transformers 5.24.0's ``Qwen4ExpForCausalLM``.

Layers: Gated DeltaNet and indexed attention (3:1), every one MoE, on ``hc_count`` residual
streams; some DeltaNet layers add PLE. The output layer reads the streams' final mixture
(``hyper_connection_mixer``, no final norm): that is the "post-norm" hidden.

The head (mlx-vlm 0.7.10's ``qwen4_exp_mtp`` layout, which transformers ignores) takes the
**streams before the final mixture** (B, L, hc·H), not the mixed hidden, and has no PLE:
``fc_embedding(norm(embed(t+1)))`` is added to ``fc_hidden`` of each stream (the streams
normed together, one norm over hc·H), then one indexed decoder layer on the streams. Its
output is streams too: a chained draft reads them, ``draft_logits`` mixes them with the
head's own ``hyper_connection_mixer`` first.

Checkpoint: the text model under ``model.language_model.*`` (or ``model.*``), one tensor per
expert in the trunk, the head's experts fused (``experts.gate_up_proj``), the n-gram table
in ``split_ngram_parts`` shards (concatenated here), norms zero-centred (made 1 + w here,
except the DeltaNet's gated norm).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..blocks import hybrid
from ..blocks.expert_split import split_parts
from ..blocks.hybrid_shard import read_share, shard_layer
from ..blocks.hyper import HyperConnection, PerLayerEmbedding, inject
from ..blocks.qsa import IndexedAttention
from ..cache.index import pooled_key_cache
from ..cache.recurrent import RecurrentCache
from ..cache.short import ShortWindowCache
from ..interface import Capabilities, MTPModel
from ..io import layout
from ..io.layout import CheckpointError, MissingMTPWeightsError
from . import qwen3_5

LAYER_TYPES = ("linear_attention", "indexed_attention", "full_attention")
# Stored zero-centred: the weight applied is 1 + w (all norms but the DeltaNet's gated one).
ZERO_CENTRED = re.compile(r"(hc_norm|q_norm|k_norm|q_layernorm|k_layernorm|norm_key|norm_query|"
                          r"norm_conv|pre_fc_norm_embedding|pre_fc_norm_hidden)\.weight$")
HASH_BUFFERS = ("layer_multipliers", "ngram_heads_offsets", "ngram_heads_vocab_sizes")
SHARD = re.compile(r"(.*\.ngram_embedding)\.shard_(\d+)\.weight$")


@dataclass
class ModelArgs(hybrid.HybridArgs):
    hc_count: int = 4
    hc_lowrank: int = 320
    ple_layer_ids: List[int] = field(default_factory=list)
    ple_embed_dim: Optional[int] = None
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    seed: int = 1234
    indexer_n_heads: int = 0
    indexer_head_dim: int = 0
    indexer_budget: int = 0
    indexer_compress_ratio: int = 1
    eos_id: int = 0
    output_gate_type: Optional[str] = None

    @classmethod
    def from_dict(cls, params: dict):
        text = dict(layout.text_config(params), model_type=params["model_type"])
        text["tie_word_embeddings"] = layout.tie_word_embeddings(params)
        counted = any(k in c for c in (text, params) for k in layout.MTP_LAYER_COUNT_KEYS)
        text["mtp_num_hidden_layers"] = layout.config_mtp_layers(params) if counted else 1
        eos = text.get("eos_token_id", params.get("eos_token_id"))
        text["eos_id"] = eos[0] if isinstance(eos, list) else eos
        n = text.get("num_hidden_layers", 0)
        text["layer_types"] = text.get("layer_types") or [
            "linear_attention" if (i + 1) % text.get("full_attention_interval", 4)
            else "indexed_attention" for i in range(n)]
        return super().from_dict(text)

    def __post_init__(self):
        super().__post_init__()
        self.ple_embed_dim = self.ple_embed_dim or self.hidden_size
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise CheckpointError(f"qwen4_exp: unknown layer_types {unknown}")
        if (self.output_gate_type or "silu") not in ("silu", "sigmoid"):
            raise CheckpointError(f"qwen4_exp: output_gate_type {self.output_gate_type!r} is "
                                  "not supported (silu or sigmoid)")
        if self.ple_layer_ids and self.eos_id is None:
            raise CheckpointError("qwen4_exp: PLE layers need eos_token_id in the config")
        if (self.rope_scaling or {}).get("type", "default") != "default":
            raise CheckpointError("qwen4_exp: only the default RoPE is supported")
        if not self.indexer_n_heads:
            raise CheckpointError("qwen4_exp: the config has no QSA indexer "
                                  "(indexer_n_heads and its fields)")

    def is_linear(self, layer_idx: int) -> bool:
        return self.layer_types[layer_idx] == "linear_attention"


class SigmoidGatedNorm(hybrid.RMSNormGated):
    """The DeltaNet's gated output norm with ``output_gate_type: sigmoid``."""

    def __call__(self, x, gate):
        y = mx.fast.rms_norm(x, self.weight, self.eps).astype(mx.float32)
        return (y * mx.sigmoid(gate.astype(mx.float32))).astype(x.dtype)


class GatedDeltaNet(qwen3_5.GatedDeltaNet):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        if args.output_gate_type == "sigmoid":
            self.norm = SigmoidGatedNorm(self.head_v_dim, eps=args.rms_norm_eps)


class DecoderLayer(nn.Module):
    """PLE (some DeltaNet layers), then attention and MoE sub-blocks on the streams. Its
    caches: (DeltaNet state[, PLE windows]) or (KV, indexer keys)."""

    def __init__(self, args: ModelArgs, linear: bool, ple_index: Optional[int] = None):
        super().__init__()
        self.is_linear = linear
        if linear:
            self.linear_attn = GatedDeltaNet(args)
        else:
            self.self_attn = IndexedAttention(args)
        self.mlp = hybrid.SparseMoeBlock(args)
        if ple_index is not None:
            self.ple = PerLayerEmbedding(args, ple_index)
        H, hc, eps = args.hidden_size, args.hc_count, args.rms_norm_eps
        self.attn_hyper_connection = HyperConnection(H, hc, args.hc_lowrank, eps)
        self.mlp_hyper_connection = HyperConnection(H, hc, args.hc_lowrank, eps)

    @property
    def num_caches(self) -> int:
        return 1 + ("ple" in self) if self.is_linear else 2

    def make_caches(self, kv_cache, quant=None) -> list:
        """``kv_cache``: the model's attention cache factory; ``quant``: its ``--kv-bits``
        (the indexer's keys too)."""
        if not self.is_linear:
            return [kv_cache(), pooled_key_cache(quant)]
        if "ple" not in self:
            return [RecurrentCache()]
        return [RecurrentCache(), ShortWindowCache(fills=self.ple.start_values)]

    def __call__(self, x, ids, caches, capture=False):
        if "ple" in self:
            x = x + self.ple(x, ids, caches[1] if caches else None, capture)
        mixed, streams, weights = self.attn_hyper_connection(x)
        if self.is_linear:
            out = self.linear_attn(mixed, None, caches[0] if caches else None, capture)
        else:
            out = self.self_attn(mixed, None, caches)
        x = inject(streams, out, weights)
        mixed, streams, weights = self.mlp_hyper_connection(x)
        return inject(streams, self.mlp(mixed), weights)


class Trunk(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        ple = {layer_id - 1: i for i, layer_id in enumerate(args.ple_layer_ids)}  # one-indexed
        self.layers = [DecoderLayer(args, args.is_linear(i), ple.get(i))
                       for i in range(args.num_hidden_layers)]
        self.hyper_connection_mixer = HyperConnection(
            args.hidden_size, args.hc_count, args.hc_lowrank, args.rms_norm_eps, combine=False)

    def __call__(self, x, ids, cache=None, capture=False, taps=()):
        """(the streams after the last layer, {tapped layer: its streams' mixture})."""
        tapped, i = {}, 0
        for n, layer in enumerate(self.layers):
            caches = cache[i: i + layer.num_caches] if cache is not None else None
            i += layer.num_caches
            x = layer(x, ids, caches, capture)
            if n in taps:
                tapped[n] = self.hyper_connection_mixer(x)
        return x, tapped


class MTPHead(nn.Module):
    """Streams at t and embed(t+1) -> one indexed decoder layer -> streams (see the doc)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        H, hc, eps = args.hidden_size, args.hc_count, args.rms_norm_eps
        self.hc = hc
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hc * H, eps=eps)
        self.fc_embedding = nn.Linear(H, H, bias=False)
        self.fc_hidden = nn.Linear(H, H, bias=False)
        self.layers = [DecoderLayer(args, linear=False) for _ in range(args.mtp_num_hidden_layers)]
        self.hyper_connection_mixer = HyperConnection(H, hc, args.hc_lowrank, eps,
                                                      combine=False)

    def __call__(self, streams, embeds, cache):
        B, L, _ = streams.shape
        e = self.fc_embedding(self.pre_fc_norm_embedding(embeds))
        h = self.fc_hidden(self.pre_fc_norm_hidden(streams).reshape(B, L, self.hc, -1))
        x = (e[:, :, None] + h).reshape(B, L, -1)
        for i, layer in enumerate(self.layers):
            x = layer(x, None, cache[2 * i: 2 * i + 2] if cache else None)
        return x


class Model(MTPModel):
    # Pipeline stages hand on the streams and read the ids beside them (PLE); tensor: Qwen3.5's
    # split (``blocks/hybrid_shard``); expert: the MoE blocks' ``switch_mlp``.
    capabilities = Capabilities(splits=("pipeline", "tensor", "expert"), taps=True)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.mtp_hidden = args.mtp_hidden
        self.model = Trunk(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.mtp_num_hidden_layers > 0:
            self.mtp = MTPHead(args)

    def trunk_layers(self, inputs, cache=None, capture=False, taps=()):
        streams = mx.tile(self.embed(inputs), (1, 1, self.args.hc_count))
        return self.model(streams, inputs, cache, capture, taps)

    def stage_layers(self, ids, hidden, cache=None, capture=False, taps=()):
        return self.model(hidden, ids, cache, capture, taps)

    def stage_shape(self, B: int, L: int) -> tuple:
        return (B, L, self.args.hc_count * self.args.hidden_size)

    def output_modules(self) -> list:
        return [self.model.hyper_connection_mixer]

    def tap_modules(self) -> list:
        return [self.model.hyper_connection_mixer]  # a tap is the streams' mixture

    def shard(self, group):
        """Qwen3.5's split by heads and columns, one layer read at a time; the stream mixers,
        PLE and the QSA indexers whole on every rank."""
        for layer in split_parts(self):
            shard_layer(layer, group)
            read_share(layer)

    def trunk_outputs(self, streams):
        """(the streams' final mixture, the streams: what the head reads)."""
        return self.model.hyper_connection_mixer(streams), streams

    def draft_logits(self, hidden, any_token: bool = False):
        """``hidden``: the head's output streams, mixed by its own mixer first."""
        return super().draft_logits(self.mtp.hyper_connection_mixer(hidden), any_token)

    def mtp_forward(self, hidden, next_tokens, mtp_cache, depth: int = 0,
                    last_only: bool = False):
        """hidden (B,S,hc·H): the trunk's (or the head's) streams at positions i;
        next_tokens (B,S) = t_{i+1}. Returns the head's streams (B,S,hc·H), the last row's
        only with ``last_only``."""
        out = self.mtp(hidden, self.model.embed_tokens(next_tokens), mtp_cache)
        return out[:, -1:] if last_only else out

    @property
    def num_mtp_caches(self) -> int:
        return 2 * self.num_mtp_layers  # KV, indexer keys

    def make_cache(self):
        return [c for layer in self.model.layers
                for c in layer.make_caches(self.full_attention_cache, self.kv_quantization)]

    def make_mtp_cache(self):
        return [c for layer in (self.mtp.layers if "mtp" in self else [])
                for c in layer.make_caches(self.full_attention_cache, self.kv_quantization)]

    def use_kv_quantization(self, quant):
        """The gated attention's K/V (read by mlx-lm's attention under the QSA selection mask)
        and the QSA indexer's keys (pooled from their dequantized rows); DeltaNet states and
        the short windows keep their precision."""
        self.quantize_attention_caches(quant, self.args.head_dim, self.args.indexer_head_dim)

    def sanitize(self, weights: dict):
        return sanitize(self, layout.text_weight_names(weights))


def sanitize(model: Model, weights: dict) -> dict:
    """Checkpoint names and forms -> ours (see the module doc)."""
    n_mtp = model.num_mtp_layers
    if n_mtp and not any(layout.is_mtp_key(k) for k in weights):
        raise MissingMTPWeightsError(layout.missing_mtp_message(model))
    weights = {k: v for k, v in weights.items()
               if (n_mtp or not layout.is_mtp_key(k)) and k.rsplit(".", 1)[-1] not in HASH_BUFFERS}
    if model.args.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    shards = {}
    for k in [k for k in weights if SHARD.match(k)]:
        m = SHARD.match(k)
        shards.setdefault(m.group(1), []).append((int(m.group(2)), weights.pop(k)))
    for name, parts in shards.items():
        weights[f"{name}.weight"] = mx.concatenate([v for _, v in sorted(parts)])
    prefixes = [f"model.layers.{i}.mlp" for i in range(model.args.num_hidden_layers)]
    for p in prefixes + [f"mtp.layers.{i}.mlp" for i in range(n_mtp)]:
        layout.split_experts(weights, p, model.args.num_experts)
    # An MLX conversion (ours) moved the conv axes and shifted the norms in the same pass.
    raw = any(k.endswith("conv1d.weight") and v.shape[-1] != 1 for k, v in weights.items())
    out = {}
    for k, v in weights.items():
        if raw and k.endswith("conv1d.weight"):
            v = v.moveaxis(2, 1)  # (C, 1, K) -> MLX's (C, K, 1)
        elif raw and v.ndim == 1 and ZERO_CENTRED.search(k):
            v = v + 1.0
        out[k] = v
    if n_mtp:
        expected = {k for k, _ in tree_flatten(model.parameters()) if k.startswith("mtp.")}
        missing = sorted(expected - out.keys())
        if missing:
            raise MissingMTPWeightsError(layout.missing_mtp_message(model, missing))
    return out
