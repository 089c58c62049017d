"""Building blocks shared by the Qwen hybrid families (Qwen3.5/3.6, Qwen3-Next).

Trunk: Gated DeltaNet layers and gated full-attention layers (3:1 by default).
MTP head: ``fc([norm(embed(t+1)) || norm(h_t)])`` -> full-attention decoder
layer(s) with their own KV cache -> ``mtp.norm`` -> the trunk's ``lm_head``.

The model class over these blocks is ``hybrid_model.HybridModel``. Family files differ
only in how a Gated DeltaNet layer projects its input and in ``sanitize``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.gated_delta import compute_g, gated_delta_update, normalize_qk
from mlx_lm.models.qwen3_next import Qwen3NextRMSNormGated as RMSNormGated
from mlx_lm.models.rope_utils import initialize_rope
from mlx_lm.models.switch_layers import SwitchGLU

from ..cache.kv import KVCache
from ..cache.recurrent import RecurrentCache, VerifyRecord
from .mrope import MultimodalRoPE

# Longer GDN inputs go through the chunked (matmul-form) recurrence when available.
CHUNKED_MIN_TOKENS = 64
# Compiled decode steps (set_compiled) cover plain steps and verify passes up to K = 8.
MAX_COMPILED_TOKENS = 9
# On the CPU every longer input takes the chunked rule: ~60-90 primitives for any length up
# to 64, against ~7 a position for the per-position loop, compiled whole or in pieces
# (benchmarks/recurrence_routes.py). The Metal kernel is one dispatch whatever the length.
CPU_CHUNKED_MIN_TOKENS = MAX_COMPILED_TOKENS + 1
# CPU decode steps and verify passes run the recurrence as one compiled graph (False:
# mlx-lm's per-position op loop; benchmarks/verify_cost.py compares the two).
COMPILE_RECURRENCE = True


@dataclass
class HybridArgs:
    model_type: str = ""
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    intermediate_size: int = 14336
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-6
    vocab_size: int = 151936
    max_position_embeddings: int = 131072
    linear_num_value_heads: int = 64
    linear_num_key_heads: int = 16
    linear_key_head_dim: int = 192
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    full_attention_interval: int = 4
    # Per-layer "linear_attention" / "full_attention" (transformers 5); wins over the interval.
    layer_types: Optional[List[str]] = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # MoE
    num_experts: int = 0
    num_experts_per_tok: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: List[int] = field(default_factory=list)
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # RoPE (flat fields, or Qwen3.5's rope_parameters dict)
    rope_theta: float = 100000.0
    partial_rotary_factor: float = 0.25
    rope_scaling: Optional[Dict[str, Any]] = None
    rope_parameters: Optional[Dict[str, Union[float, str, bool, List[int]]]] = None
    # MTP
    mtp_num_hidden_layers: int = 0
    mtp_use_dedicated_embeddings: bool = False
    # Which trunk hidden state feeds the MTP head: "post_norm" (the output of the
    # trunk's final norm, as vLLM/SGLang/llama.cpp and HF's generic MTP path do,
    # and measured to accept more) or "pre_norm" (PR #990's choice).
    mtp_hidden: str = "post_norm"

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.rope_parameters:
            params = dict(self.rope_parameters)
            if "type" not in params and "rope_type" in params:
                params["type"] = params.pop("rope_type")
            self.partial_rotary_factor = params.get("partial_rotary_factor", 0.25)
            self.rope_theta = params.get("rope_theta", self.rope_theta)
            self.rope_scaling = params
        if self.mtp_hidden not in ("post_norm", "pre_norm"):
            raise ValueError(
                f"mtp_hidden must be 'post_norm' or 'pre_norm', got {self.mtp_hidden!r}"
            )

    @classmethod
    def from_dict(cls, params: dict):
        names = inspect.signature(cls).parameters
        return cls(**{k: v for k, v in params.items() if k in names})

    def is_linear(self, layer_idx: int) -> bool:
        if self.layer_types is not None:
            return self.layer_types[layer_idx] == "linear_attention"
        return (layer_idx + 1) % self.full_attention_interval != 0

    def is_moe(self, layer_idx: int) -> bool:
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


class GatedAttention(nn.Module):
    """Full attention with an output gate, q/k RMSNorm and partial RoPE."""

    def __init__(self, args: HybridArgs):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = hd = args.head_dim
        self.scale = hd**-0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * hd * 2, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, args.hidden_size, bias=bias)
        self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.rope = initialize_rope(
            int(hd * args.partial_rotary_factor),
            base=args.rope_theta,
            traditional=False,
            scaling_config=args.rope_scaling,
            max_position_embeddings=args.max_position_embeddings,
        )
        sections = (args.rope_scaling or {}).get("mrope_section")
        self.mrope = None if not sections else MultimodalRoPE(
            int(hd * args.partial_rotary_factor), args.rope_theta, sections)

    def __call__(self, x: mx.array, mask=None, cache: Optional[KVCache] = None, positions=None):
        """``positions``: (3, L) multimodal positions of the rows (a prompt chunk with
        images, see ``mrope``); None: text positions from the cache offset."""
        B, L, _ = x.shape
        q, gate = mx.split(self.q_proj(x).reshape(B, L, self.n_heads, -1), 2, axis=-1)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1)
        q = self.q_norm(q).transpose(0, 2, 1, 3)
        k = self.k_norm(k).transpose(0, 2, 1, 3)
        v = v.transpose(0, 2, 1, 3)
        if positions is not None:
            q, k = self.mrope(q, positions), self.mrope(k, positions)
        else:
            offset = cache.offset if cache is not None else 0
            q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache, scale=self.scale, mask=mask)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(out * mx.sigmoid(gate.reshape(B, L, -1)))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def __call__(self, x):
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class SparseMoeBlock(nn.Module):
    """Routed top-k experts plus a sigmoid-gated shared expert."""

    def __init__(self, args: HybridArgs):
        super().__init__()
        dim = args.hidden_size
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = nn.Linear(dim, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(dim, args.moe_intermediate_size, args.num_experts)
        self.shared_expert = MLP(dim, args.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False)

    def __call__(self, x):
        gates = mx.softmax(self.gate(x), axis=-1, precise=True)
        k = self.top_k
        inds = mx.stop_gradient(mx.argpartition(gates, kth=-k, axis=-1)[..., -k:])
        scores = mx.take_along_axis(gates, inds, axis=-1)
        if self.norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        # MLX's CPU gather_mm is float32-only; load() upcasts float experts there.
        expert_dtype = self.switch_mlp.gate_proj.weight.dtype
        if expert_dtype == mx.float32 and x.dtype != mx.float32:
            y = self.switch_mlp(x.astype(mx.float32), inds).astype(x.dtype)
        else:
            y = self.switch_mlp(x, inds)
        y = (y * scores[..., None].astype(y.dtype)).sum(axis=-2)
        shared = mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y + shared


def _chunked_min_tokens() -> int:
    return CPU_CHUNKED_MIN_TOKENS if mx.default_device() == mx.cpu else CHUNKED_MIN_TOKENS


def _chunked_impl():
    try:
        from ..kernels.gated_delta_chunked import gated_delta_chunked
    except ImportError:  # pragma: no cover - module is optional during bring-up
        return None
    return gated_delta_chunked


@mx.compile
def _compiled_recurrence(q, k, v, a, b, A_log, dt_bias, state):
    """``gated_delta_update``'s op loop traced once per shape (all layers share it): the
    same arithmetic per position, without a dozen dispatches per position and layer."""
    return gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, use_kernel=False)


class GatedDeltaNetBase(nn.Module):
    """Gated DeltaNet mixer. Subclasses define the input projections."""

    def __init__(self, args: HybridArgs):
        super().__init__()
        self.num_v_heads = args.linear_num_value_heads
        self.num_k_heads = args.linear_num_key_heads
        self.head_k_dim = args.linear_key_head_dim
        self.head_v_dim = args.linear_value_head_dim
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.num_v_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.num_k_heads})"
            )
        self.conv_kernel_size = args.linear_conv_kernel_dim
        self.conv_dim = self.key_dim * 2 + self.value_dim
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            kernel_size=self.conv_kernel_size,
            groups=self.conv_dim,
            bias=False,
        )
        self.dt_bias = mx.ones(self.num_v_heads)
        self.A_log = mx.zeros(self.num_v_heads)
        self.norm = RMSNormGated(self.head_v_dim, eps=args.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, args.hidden_size, bias=False)

    def empty_state(self, B: int, dtype):
        """Zero (conv, recurrent) state: what a sequence that has seen no tokens holds."""
        conv = mx.zeros((B, self.conv_kernel_size - 1, self.conv_dim), dtype)
        ssm = mx.zeros((B, self.num_v_heads, self.head_v_dim, self.head_k_dim), mx.float32)
        return conv, ssm

    def project(self, x):
        """Return qkv (B,S,conv_dim), z (B,S,Hv,Dv), b (B,S,Hv), a (B,S,Hv)."""
        raise NotImplementedError

    def recurrence(self, q, k, v, a, b, state, mask=None):
        """The per-token recurrence: mlx-lm's entry point, the fused kernel on Metal. On
        the CPU a decode step or verify pass (a few positions, a state, no mask) runs it
        as one compiled graph instead of mlx-lm's per-position op loop."""
        if (COMPILE_RECURRENCE and mask is None and state is not None and not self.training
                and q.shape[1] <= MAX_COMPILED_TOKENS and mx.default_device() == mx.cpu):
            return _compiled_recurrence(q, k, v, a, b, self.A_log, self.dt_bias, state)
        return gated_delta_update(
            q, k, v, a, b, self.A_log, self.dt_bias, state, mask, use_kernel=not self.training
        )

    def inputs(self, x, conv_state, mask=None):
        """Projection and short convolution: (conv_input, (q, k, v, a, b), z)."""
        B, S, _ = x.shape
        qkv, z, b, a = self.project(x)
        if conv_state is None:
            conv_state = mx.zeros((B, self.conv_kernel_size - 1, self.conv_dim), dtype=x.dtype)
        if mask is not None:
            qkv = mx.where(mask[..., None], qkv, 0)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        conv_out = nn.silu(self.conv1d(conv_input))
        q, k, v = mx.split(conv_out, [self.key_dim, 2 * self.key_dim], axis=-1)
        q = q.reshape(B, S, self.num_k_heads, self.head_k_dim)
        k = k.reshape(B, S, self.num_k_heads, self.head_k_dim)
        v = v.reshape(B, S, self.num_v_heads, self.head_v_dim)
        q, k = normalize_qk(q, k, inv_scale=self.head_k_dim**-0.5, eps=1e-6)
        return conv_input, (q, k, v, a, b), z

    def output(self, out, z):
        B, S = out.shape[:2]
        return self.out_proj(self.norm(out, z).reshape(B, S, -1))

    def commit(self, cache, conv_input, state, new_state, inputs, mask, capture):
        """Advance the cache by the pass (keeping what a verify pass needs to replay)."""
        record = VerifyRecord(conv_input, state, inputs, mask, self.recurrence) if capture else None
        cache.advance(conv_input, new_state, conv_input.shape[1] - self.conv_kernel_size + 1,
                      record)

    def __call__(self, x, mask=None, cache: Optional[RecurrentCache] = None, capture=False):
        S = x.shape[1]
        conv_state, state = cache.state if cache is not None else (None, None)
        conv_input, (q, k, v, a, b), z = self.inputs(x, conv_state, mask)

        # A verify pass (capture) makes the same call as plain decoding; the cache
        # keeps what it needs to replay the accepted prefix (see RecurrentCache).
        if (not capture and S >= _chunked_min_tokens()
                and (chunked := _chunked_impl()) is not None):
            g = compute_g(self.A_log, a, self.dt_bias)
            out, new_state = chunked(q, k, v, g, mx.sigmoid(b), state, mask)
        else:
            out, new_state = self.recurrence(q, k, v, a, b, state, mask)
        if cache is not None:
            self.commit(cache, conv_input, state, new_state, (q, k, v, a, b), mask, capture)
        return self.output(out, z)


class DecoderLayer(nn.Module):
    def __init__(self, args: HybridArgs, layer_idx: int, linear_cls, linear: bool, moe: bool):
        super().__init__()
        self.is_linear = linear
        if linear:
            self.linear_attn = linear_cls(args)
        else:
            self.self_attn = GatedAttention(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.mlp = SparseMoeBlock(args) if moe else MLP(args.hidden_size, args.intermediate_size)
        self.compiled_steps = None  # set_compiled: (plain, verify) decode steps of a linear layer

    def set_compiled(self, on: bool):
        """Compile a Gated DeltaNet layer's decode step (state in, state out). MLX keeps one
        trace per input shape (per K and batch size); a plain step returns only the new
        state, a verify pass also what replay needs. Weights are captured at trace time:
        call after loading. Switching on when already on keeps the traces."""
        if not on or not self.is_linear:
            self.compiled_steps = None
        elif self.compiled_steps is None:
            self.compiled_steps = (mx.compile(lambda x, c, s: self._linear_step(x, c, s)[:3]),
                                   mx.compile(self._linear_step))

    def _linear_step(self, x, conv_state, state):
        mix = self.linear_attn
        conv_input, inputs, z = mix.inputs(self.input_layernorm(x), conv_state)
        out, new_state = mix.recurrence(*inputs, state)
        h = x + mix.output(out, z)
        return h + self.mlp(self.post_attention_layernorm(h)), conv_input, new_state, *inputs

    def __call__(self, x, mask=None, cache=None, capture=False, positions=None):
        conv_state, state = cache.state if self.is_linear and cache is not None else (None, None)
        if (self.compiled_steps is not None and state is not None
                and x.shape[1] <= MAX_COMPILED_TOKENS):
            h, conv_input, new_state, *inputs = self.compiled_steps[capture](x, conv_state, state)
            self.linear_attn.commit(cache, conv_input, state, new_state, tuple(inputs),
                                    None, capture)
            return h
        if self.is_linear:
            r = self.linear_attn(self.input_layernorm(x), mask, cache, capture)
        else:
            r = self.self_attn(self.input_layernorm(x), mask, cache, positions)
        h = x + r
        return h + self.mlp(self.post_attention_layernorm(h))

    def last_row(self, x, mask=None, cache=None):
        """The (attention) layer's output at the last row only: attention still runs on
        every row (their keys and values fill ``cache``, the last row attends to them all);
        the MLP / MoE runs on the last row alone."""
        h = x[:, -1:] + self.self_attn(self.input_layernorm(x), mask, cache)[:, -1:]
        return h + self.mlp(self.post_attention_layernorm(h))


class Trunk(nn.Module):
    def __init__(self, args: HybridArgs, linear_cls):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [
            DecoderLayer(args, i, linear_cls, args.is_linear(i), args.is_moe(i))
            for i in range(args.num_hidden_layers)
        ]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs, cache=None, capture=False, input_embeddings=None, taps=(),
                 positions=None):
        """(the last layer's residual, {layer id in ``taps``: the residual after it}).
        ``positions``: the rows' multimodal positions (3, L), for attention layers."""
        h = self.embed_tokens(inputs) if input_embeddings is None else input_embeddings
        if cache is None:
            cache = [None] * len(self.layers)
        L = h.shape[1]
        # Full-attention layers share one mask, made by the first one's cache.
        kv = next((c for layer, c in zip(self.layers, cache)
                   if not layer.is_linear and c is not None), None)
        fa_mask = kv.make_mask(L) if kv is not None else ("causal" if L > 1 else None)
        tapped = {}
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            h = layer(h, None if layer.is_linear else fa_mask, c, capture, positions)
            if i in taps:
                tapped[i] = h
        return h, tapped


class MTPHead(nn.Module):
    """Qwen-style MTP module: predicts t+2 from the trunk hidden at t and embed(t+1)."""

    def __init__(self, args: HybridArgs):
        super().__init__()
        H = args.hidden_size
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        # The MTP layers are always full attention (no recurrent state).
        self.layers = [
            DecoderLayer(args, i, None, linear=False, moe=args.num_experts > 0)
            for i in range(args.mtp_num_hidden_layers)
        ]
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)

    def __call__(self, hidden, embeds, cache, last_only: bool = False):
        """``last_only``: the output at the last row only (the earlier rows still fill the
        caches); only the last layer's output leaves the head, so only it is cut."""
        x = mx.concatenate(
            [self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        x = self.fc(x)
        L = x.shape[1]
        mask = cache[0].make_mask(L) if cache else ("causal" if L > 1 else None)
        n = len(self.layers)
        for i, (layer, c) in enumerate(zip(self.layers, cache or [None] * n)):
            x = layer.last_row(x, mask, c) if last_only and i == n - 1 else layer(x, mask, c)
        return self.norm(x)
