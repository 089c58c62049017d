"""DeepSeek-V4 (``model_type: deepseek_v4``, DeepSeek-V4-Flash), with its MTP head.

Trunk: written here in MLX (mlx-lm 0.32 has none) from transformers 5.24's
``modeling_deepseek_v4.py``, blocks in ``blocks/dsv4.py``: sliding-window attention with
CSA / HCA compressed entries, ``hc_mult`` hyper-connection streams, hash-routed MoE in the
first layers. The output is ``norm(hc_head(streams))``. Each layer's cache is a
``CompressedWindowCache`` (none can be trimmed; a verify pass is rolled back by slicing the
state it recorded, ``cache/compressed.py``). A batch keeps its rows' caches apart
(``CompressedRows``) and runs its rows in one pass: each row's window and compressed
entries are read alone and left-padded into one attention (``blocks/dsv4.Attention``).

Weights keep DeepSeek's released names (``embed``, ``head``, ``hc_head_fn``,
``layers.N.attn.wq_a``, ``ffn.experts.E.w1``, ``mtp.0.*``); the experts are stacked for
mlx-lm's ``SwitchGLU``. Configs are read in transformers' form (``layer_types``,
``compress_rates``, nested ``rope_parameters``) or DeepSeek's (``compress_ratios``,
``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling``).

MTP (``mtp.0.*``, DeepSeek's ``MTPBlock``; transformers ignores it): the head takes the
trunk's four streams before ``hc_head``: ``e_proj(enorm(embed(t+1)))`` broadcast over the
streams plus ``h_proj(hnorm(streams))``, then one V4 block (sliding window only, top-k MoE),
then its own ``hc_head`` and ``norm`` before the shared output layer. The layout is the one
mlx-vlm 0.7.10's ``deepseek_v4_mtp`` drafter reads; no public DeepSeek source was found to
confirm it (docs/model-families.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..blocks.dsv4 import Block, HyperHead, inv_freq, stream_input
from ..blocks.expert_split import split_parts
from ..blocks.hybrid_shard import read_share
from ..blocks.stream_shard import shard_dsv4_attention, shard_moe
from ..cache.compressed import CompressedWindowCache
from ..cache.quantized_compressed import QuantizedCompressedWindowCache
from ..interface import Capabilities, MTPModel
from ..io import layout

# Keys the head's window keeps past the window: a step trims at most K - 1 drafted entries
# (K <= decode.MAX_DRAFT_TOKENS, which models/ does not import).
HEAD_SPARE_KEYS = 8
RATIO_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention",
               128: "heavily_compressed_attention"}


@dataclass
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    num_experts_per_tok: int
    n_routed_experts: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    layer_types: List[str]
    mlp_layer_types: List[str]
    compress_rates: Dict[str, int]
    rope_parameters: Dict[str, dict]
    rope_head_dim: int
    sliding_window: int = 128
    routed_scaling_factor: float = 1.5
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-6
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    # set: ``mtp.*`` holds DSpark stages (``drafters/block/dsv4_dspark.py``), not an MTP head
    dspark_target_layer_ids: Optional[List[int]] = None

    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        p = dict(params)
        n = p["num_hidden_layers"]
        rates = dict(p.get("compress_rates") or {})
        if "layer_types" not in p:  # DeepSeek's config: one ratio per layer
            ratios = p["compress_ratios"][:n]
            p["layer_types"] = [RATIO_TYPES[r] for r in ratios]
            rates = {RATIO_TYPES[r]: r for r in ratios if r}
        rates.setdefault("compressed_sparse_attention", 4)
        rates.setdefault("heavily_compressed_attention", 128)
        p["compress_rates"] = rates
        if "mlp_layer_types" not in p:
            hashed = p.get("num_hash_layers", 3)
            p["mlp_layer_types"] = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
        rope_dim = p.get("qk_rope_head_dim") or int(p["head_dim"] * p["partial_rotary_factor"])
        p["rope_head_dim"] = rope_dim
        p["rope_parameters"] = cls.ropes(p)
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in p.items() if k in names})

    @staticmethod
    def ropes(p: dict) -> Dict[str, dict]:
        """``main`` (sliding layers) and ``compress`` (CSA / HCA layers and compressors)."""
        rp = p.get("rope_parameters") or {}
        if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
            return {"main": rp["main"], "compress": rp["compress"]}
        scaling = dict(p.get("rope_scaling") or rp)
        if "type" in scaling:
            scaling["rope_type"] = scaling.pop("type")
        return {"main": {"rope_type": "default", "rope_theta": p.get("rope_theta", 10000.0)},
                "compress": {**scaling, "rope_theta": p.get("compress_rope_theta", 160000.0)}}

    @property
    def csa_ratio(self) -> int:
        return self.compress_rates["compressed_sparse_attention"]

    def compress_ratio(self, layer_type: str) -> int:
        return 0 if layer_type == "sliding_attention" else self.compress_rates[layer_type]


class Trunk(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [Block(args, t, m == "hash_moe")
                       for t, m in zip(args.layer_types, args.mlp_layer_types)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.hc_head = HyperHead(args)


class MTPLayer(nn.Module):
    """DeepSeek's ``MTPBlock`` (module doc)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        H = args.hidden_size
        self.enorm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.hnorm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.e_proj = nn.Linear(H, H, bias=False)
        self.h_proj = nn.Linear(H, H, bias=False)
        self.block = Block(args, "sliding_attention", hashed=False)
        self.hc_head = HyperHead(args)
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)


class MTPStack(nn.Module):
    def __init__(self, layers: List[MTPLayer]):
        super().__init__()
        self.layers = layers


class Model(MTPModel):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Trunk(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.num_nextn_predict_layers > 0 and not args.dspark_target_layer_ids:
            self.mtp = MTPStack([MTPLayer(args)])
        dim = args.rope_head_dim
        self._freqs = {k: inv_freq(dim, v) for k, v in args.rope_parameters.items()}
        # Not a parameter, so loading does not evaluate it: a graph left lazy here cannot be
        # evaluated on another thread (the server's engine: "no Stream(cpu, 0)").
        mx.eval(self._freqs)

    @property
    def capabilities(self) -> Capabilities:
        # Pipeline stages hand on the streams with the ids beside them (hash routing);
        # tensor: ``blocks/stream_shard``; expert: the MoE blocks' ``switch_mlp``.
        return Capabilities(splits=("pipeline", "tensor", "expert"))

    def layer_freqs(self, layer: Block) -> mx.array:
        return self._freqs["compress" if layer.attn.ratio else "main"]

    def embed(self, inputs) -> mx.array:
        if inputs.ndim == 3:
            raise ValueError("DeepSeek-V4 routes its first layers by token id: it takes "
                             "token ids, not hidden states")
        return self.model.embed_tokens(inputs)

    def trunk_layers(self, inputs, cache=None, capture=False, taps=()):
        """The four streams after the last layer; a tap is the mean over the streams."""
        streams = stream_input(self.embed(inputs), self.args.hc_mult)
        return self.stage_layers(inputs, streams, cache, capture, taps)

    def stage_layers(self, ids, hidden, cache=None, capture=False, taps=()):
        """The layers from the streams ``hidden``. All rows run in one pass; each keeps its
        own caches (``CompressedRows``: rows sit at different phases of their windows),
        which the attention reads row by row; a block drafter's context caches ride after
        the layers' (``decode/block_context.py``)."""
        B, L = ids.shape
        rows = [None] * len(self.model.layers) if cache is None else \
            [[c.row(b) for b in range(B)] for c in cache[:len(self.model.layers)]]
        starts = [0] * B if cache is None else [r.lengths()[0] for r in rows[0]]
        positions = mx.array(starts)[:, None, None] + mx.arange(L)
        h, tapped = hidden, {}
        for i, (layer, c) in enumerate(zip(self.model.layers, rows)):
            h = layer(h, ids, positions, c, self.layer_freqs(layer), capture)
            if i in taps:
                tapped[i] = h.mean(axis=2)
        return h, tapped

    def stage_shape(self, B: int, L: int) -> tuple:
        return (B, L, self.args.hc_mult, self.args.hidden_size)

    def output_modules(self) -> list:
        return [self.model.norm, self.model.hc_head]

    def shard(self, group):
        """By query heads and output groups, expert columns (``blocks/stream_shard``); the
        mHC mixers, compressors and indexers whole on every rank. One layer read at a time."""
        for layer in split_parts(self):
            block = layer.block if isinstance(layer, MTPLayer) else layer
            shard_dsv4_attention(block.attn, group)
            shard_moe(block.ffn, group)
            read_share(layer)

    def trunk_outputs(self, h):
        """(``norm(hc_head(streams))``, the streams: what the head takes)."""
        return self.model.norm(self.model.hc_head(h)), h

    def mtp_forward(self, hidden, next_tokens, mtp_cache, depth: int = 0,
                    last_only: bool = False):
        """hidden (B, S, hc_mult, H): the trunk's streams at positions i (or the head's own,
        chained); next_tokens (B, S) = t_{i+1} -> the head's streams (B, S, hc_mult, H), whose
        ``logits`` predict t_{i+2}. Each row runs on its right-aligned positions
        (``prepare``), rows of as many positions in one pass; a row's padding gives zeros."""
        cache = mtp_cache[0] if mtp_cache else None
        if cache is None:
            out = self.head_rows(hidden, next_tokens, None)
        else:
            S = hidden.shape[1]
            lengths = cache.row_lengths(S)
            rows = [mx.zeros((1, S) + hidden.shape[2:], hidden.dtype)] * len(lengths)
            for n in sorted(set(lengths) - {0}):
                group = [b for b, m in enumerate(lengths) if m == n]
                ix = mx.array(group)
                out = self.head_rows(hidden[ix, S - n:], next_tokens[ix, S - n:],
                                     [cache.row(b) for b in group])
                out = mx.pad(out, [(0, 0), (S - n, 0)] + [(0, 0)] * (out.ndim - 2))
                for i, b in enumerate(group):
                    rows[b] = out[i:i + 1]
            out = mx.concatenate(rows)
        return out[:, -1:] if last_only else out

    def head_rows(self, hidden, next_tokens, caches) -> mx.array:
        """The head over rows with a cache each (or none), all at their own positions."""
        layer = self.mtp.layers[0]
        e = layer.e_proj(layer.enorm(self.model.embed_tokens(next_tokens)))
        x = e[:, :, None] + layer.h_proj(layer.hnorm(hidden))
        starts = [c.lengths()[0] for c in caches] if caches else [0] * x.shape[0]
        positions = mx.array(starts)[:, None, None] + mx.arange(x.shape[1])
        return layer.block(x, next_tokens, positions, caches, self._freqs["main"])

    def head_output(self, hidden) -> mx.array:
        """The head's streams (B, S, n, H) -> its post-norm hidden; a post-norm hidden
        (B, S, H) of the trunk as is."""
        if hidden.ndim == 3:
            return hidden
        layer = self.mtp.layers[0]
        return layer.norm(layer.hc_head(hidden))

    def logits(self, hidden):
        return self.lm_head(self.head_output(hidden))

    def draft_logits(self, hidden, any_token: bool = False):
        return super().draft_logits(self.head_output(hidden), any_token)

    def make_cache(self):
        args = self.args
        return [self.window_cache(args.sliding_window, layer.attn.ratio,
                                  self.series_names(layer))
                for layer in self.model.layers]

    def window_cache(self, *settings, **kw) -> CompressedWindowCache:
        """A layer's cache (trunk or head): quantized after ``use_kv_quantization``."""
        q = self.kv_quantization
        return CompressedWindowCache(*settings, **kw) if q is None else \
            QuantizedCompressedWindowCache(*settings, **kw, quant=q)

    @staticmethod
    def series_names(layer: Block) -> tuple:
        if not layer.attn.ratio:
            return ()
        return ("compressor", "indexer") if "indexer" in layer.attn else ("compressor",)

    def make_mtp_cache(self):
        if not self.num_mtp_layers:
            return []
        return [self.window_cache(self.args.sliding_window, spare=HEAD_SPARE_KEYS)]

    def use_kv_quantization(self, quant):
        """The windows' keys and the compressed entries (compressors' and indexers'); the
        compressors' pending raw rows keep their precision."""
        if quant is not None and quant.start:  # no switch to quantized form mid-sequence
            raise ValueError("--quantized-kv-start is not available for deepseek_v4: its "
                             "caches are quantized from the first token")
        csa = any("indexer" in layer.attn for layer in self.model.layers)
        dims = (self.args.head_dim, self.args.index_head_dim) if csa else (self.args.head_dim,)
        self.quantize_attention_caches(quant, *dims)

    @staticmethod
    def cast_predicate(path: str) -> bool:
        """What transformers keeps in float32: mHC weights, sinks, window biases, the router
        bias (the token -> expert table is integer)."""
        return not re.search(r"hc_|attn_sink|\.ape$|gate\.bias$|tid2eid", path)

    # --- weights ----------------------------------------------------------
    def sanitize(self, weights: dict) -> dict:
        """DeepSeek's released names -> ours: the trunk under ``model.``, the head under
        ``mtp.layers.0.`` (whichever one index the checkpoint gives it), experts stacked; an
        MLX conversion (already ours) passes."""
        indices = {m.group(1) for k in weights if (m := re.match(r"mtp\.(\d+)\.", k))}
        head = f"mtp.{indices.pop()}." if len(indices) == 1 else "mtp.0."
        out = {self.our_name("mtp.0." + k[len(head):] if k.startswith(head) else k): v
               for k, v in weights.items()}
        out = self.stack_experts(out, self.args.n_routed_experts)
        if "mtp" not in self:  # no head, or DSpark stages (the drafter reads those)
            return {k: v for k, v in out.items() if not k.startswith(("mtp.", "markov_head."))}
        expected = {k for k, _ in tree_flatten(self.parameters()) if k.startswith("mtp.")}
        missing = sorted(expected - out.keys())
        if missing:
            raise layout.MissingMTPWeightsError(
                f"config.json declares {self.args.num_nextn_predict_layers} MTP layer(s) "
                f"(model_type='deepseek_v4') but the weights lack {len(missing)} of its "
                f"tensors, e.g. {', '.join(missing[:3])} (released as mtp.0.e_proj.weight, "
                "mtp.0.h_proj.weight, mtp.0.hc_head_fn, ...). Fix: graft the head from the "
                "original checkpoint with `mlx-mtp add-mtp --model THIS --source ORIGINAL`, or "
                "run without MTP with --no-mtp.")
        return out

    @staticmethod
    def stack_experts(weights: dict, n_experts: int) -> dict:
        """Per-expert ``experts.E.w1/w2/w3`` -> stacked ``switch_mlp.*`` (in place)."""
        for prefix in {k.split("experts.")[0] for k in weights if ".experts." in k}:
            for ours, theirs in (("gate_proj", "w1"), ("down_proj", "w2"), ("up_proj", "w3")):
                stack = [weights.pop(f"{prefix}experts.{e}.{theirs}.weight")
                         for e in range(n_experts)]
                weights[f"{prefix}switch_mlp.{ours}.weight"] = mx.stack(stack)
        return weights

    @staticmethod
    def our_name(key: str) -> str:
        if key.startswith(("model.", "lm_head.", "mtp.layers.")):
            return key
        key = re.sub(r"^mtp\.(\d+)\.(attn|ffn|attn_norm|ffn_norm|hc_attn|hc_ffn)",
                     r"mtp.layers.\1.block.\2", key)
        key = re.sub(r"^mtp\.(\d+)\.hc_head_", r"mtp.layers.\1.hc_head.", key)
        key = re.sub(r"^mtp\.(\d+)\.", r"mtp.layers.\1.", key)
        key = re.sub(r"^hc_head_", "model.hc_head.", key)
        for theirs, ours in (("embed.", "model.embed_tokens."), ("head.", "lm_head."),
                             ("norm.", "model.norm."), ("layers.", "model.layers.")):
            if key.startswith(theirs):
                return ours + key[len(theirs):]
        return key
