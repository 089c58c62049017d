"""DeepSeek-V4's blocks in MLX, read from transformers 5.24's ``modeling_deepseek_v4.py``
and named as DeepSeek's released checkpoints name them (``attn.wq_a``, ``hc_attn_fn``, ...).

* Attention: shared-KV MQA (one head read as key and value) over a sliding window of
  ``sliding_window`` keys (the current one included), plus, on compressed layers, entries
  pooling every ``ratio`` positions: CSA (ratio 4, two overlapping series, an indexer keeping
  the top ``index_topk`` entries per query) or HCA (ratio 128, all entries). Interleaved
  RoPE on the trailing ``rope_dim`` channels, undone on the output; a learned sink logit
  per head; a grouped low-rank output projection.
* mHC: ``hc_mult`` residual streams, collapsed into a block's input and expanded from its
  output by weights from a one-layer perceptron (the residual mix made doubly stochastic
  by Sinkhorn iterations).
* MoE: sqrt-softplus scores; the first layers route by a frozen ``tid2eid[token]`` table,
  the others by top-k of score plus bias; clamped SwiGLU experts and a shared expert.
"""

from __future__ import annotations

import math
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU


def rms(x: mx.array, eps: float) -> mx.array:
    """Unweighted RMS norm, its scale computed in float32."""
    scale = mx.rsqrt(mx.mean(mx.square(x.astype(mx.float32)), axis=-1, keepdims=True) + eps)
    return x * scale.astype(x.dtype)


def inv_freq(dim: int, rope: dict) -> mx.array:
    """The rotary frequencies of ``rope`` (transformers' ``default`` or ``yarn`` with
    attention factor 1, as V4 uses it), one per channel pair."""
    base = rope["rope_theta"]
    freqs = 1.0 / base ** (mx.arange(0, dim, 2, dtype=mx.float32) / dim)
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        return freqs
    if rope.get("rope_type", rope.get("type")) != "yarn":
        raise ValueError(f"DeepSeek-V4 rope type {rope.get('rope_type')!r} is not supported")
    factor, original = rope["factor"], rope["original_max_position_embeddings"]

    def correction(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction(rope.get("beta_fast") or 32), correction(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = mx.clip((mx.arange(dim // 2, dtype=mx.float32) - low) / max(high - low, 1e-3), 0, 1)
    return freqs / factor * ramp + freqs * (1 - ramp)


def rope(x: mx.array, positions: mx.array, freqs: mx.array, inverse: bool = False) -> mx.array:
    """Interleaved RoPE on the trailing ``2 * len(freqs)`` channels of ``x`` (..., L, D) at
    ``positions`` (L,) or per row (B, 1, L); ``inverse``: the conjugate rotation."""
    angles = positions.astype(mx.float32)[..., None] * freqs
    cos, sin = mx.cos(angles).astype(x.dtype), mx.sin(angles).astype(x.dtype)
    sin = -sin if inverse else sin
    rd = 2 * freqs.shape[0]
    nope, r = x[..., :-rd], x[..., -rd:].astype(mx.float32)
    x1, x2 = r[..., 0::2], r[..., 1::2]
    rotated = mx.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    rotated = rotated.reshape(r.shape).astype(x.dtype)
    return mx.concatenate([nope, rotated], axis=-1)


def visible_entries(positions: mx.array, count: int, ratio: int) -> mx.array:
    """(..., L, count): whether the query at each position (..., L) may read each entry (its
    window is complete by then)."""
    return mx.arange(count) < ((positions + 1) // ratio)[..., None]


class Compressor(nn.Module):
    """One series of compressed entries: softmax-gated pooling of each window's projections
    (CSA's ``overlap``: window ``w - 1``'s first half with window ``w``'s second), normed and
    rotated at the window's first position."""

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float):
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        self.wkv = nn.Linear(hidden, width, bias=False)
        self.wgate = nn.Linear(hidden, width, bias=False)
        self.ape = mx.zeros((ratio, width))
        self.norm = nn.RMSNorm(dim, eps=eps)

    def __call__(self, x, caches, name: str, freqs: mx.array) -> mx.array:
        """(B, L', d): each row's entries so far, a row with fewer right-padded with zeros
        (entries no query of it sees). ``caches``: each row's (None: one pass without a
        cache). The projections run over all rows at once, each row's raw rows go through
        its own cache, and rows completing as many windows are pooled together."""
        B, L, _ = x.shape
        kv, gate = self.wkv(x), self.wgate(x)
        if caches is None:
            usable = L // self.ratio * self.ratio
            return self.entries(kv[:, :usable], gate[:, :usable], 0, (None, None), freqs)
        pending = [c.pending(name, kv[b:b + 1], gate[b:b + 1]) for b, c in enumerate(caches)]
        groups, new = {}, [None] * B
        for b, p in enumerate(pending):  # only an overlapping series reads the prior window
            groups.setdefault((p.kv.shape[1], self.overlap and p.prior_kv is not None),
                              []).append(b)
        for (_, with_prior), rows in groups.items():
            ps = [pending[b] for b in rows]
            prior = (mx.concatenate([p.prior_kv for p in ps]),
                     mx.concatenate([p.prior_gate for p in ps])) if with_prior else (None, None)
            first = mx.array([p.first for p in ps])[:, None]
            out = self.entries(mx.concatenate([p.kv for p in ps]),
                               mx.concatenate([p.gate for p in ps]), first, prior, freqs)
            for i, b in enumerate(rows):
                new[b] = out[i:i + 1]
        entries = [c.add_entries(name, e) for c, e in zip(caches, new)]
        T = max(e.shape[1] for e in entries)
        return mx.concatenate([mx.pad(e, [(0, 0), (0, T - e.shape[1]), (0, 0)])
                               for e in entries])

    def entries(self, kv, gate, first, prior, freqs) -> mx.array:
        """(b, n, d): the entries of rows' whole windows ``kv``/``gate`` (b, n · ratio,
        width), whose first windows start at ``first`` (b, 1) (or one int for all)."""
        B, n = kv.shape[0], kv.shape[1] // self.ratio
        if n == 0:
            return mx.zeros((B, 0, self.dim), kv.dtype)
        entries = self.pool(kv.reshape(B, n, self.ratio, -1),
                            gate.reshape(B, n, self.ratio, -1) + self.ape, prior)
        return rope(entries, mx.arange(n) * self.ratio + first, freqs)

    def pool(self, kv, gate, prior) -> mx.array:
        if self.overlap:
            d = self.dim
            prior_kv, prior_gate = prior
            if prior_kv is None:
                prior_kv = mx.zeros_like(kv[:, :1, :, :d])
                prior_gate = mx.full(prior_kv.shape, -mx.inf, gate.dtype)
            else:
                prior_gate = (prior_gate + self.ape)[:, None, :, :d]
                prior_kv = prior_kv[:, None, :, :d]
            prev_kv = mx.concatenate([prior_kv, kv[:, :-1, :, :d]], axis=1)
            prev_gate = mx.concatenate([prior_gate, gate[:, :-1, :, :d]], axis=1)
            kv = mx.concatenate([prev_kv, kv[..., d:]], axis=2)
            gate = mx.concatenate([prev_gate, gate[..., d:]], axis=2)
        weights = mx.softmax(gate.astype(mx.float32), axis=2).astype(kv.dtype)
        return self.norm((kv * weights).sum(axis=2))


class Indexer(nn.Module):
    """CSA's lightning indexer: scores ``sum_h w_h relu(q_h . k)`` of each query against its
    own compressed keys; a query reads the top ``topk`` entries it may see."""

    def __init__(self, args):
        super().__init__()
        self.heads, self.dim, self.topk = args.index_n_heads, args.index_head_dim, args.index_topk
        self.wq_b = nn.Linear(args.q_lora_rank, self.heads * self.dim, bias=False)
        self.weights_proj = nn.Linear(args.hidden_size, self.heads, bias=False)
        self.compressor = Compressor(args.hidden_size, self.dim, args.csa_ratio, True,
                                     args.rms_norm_eps)

    def __call__(self, x, q_residual, positions, caches, freqs) -> mx.array:
        """(B, L, T) additive bias over the compressor's T entries: 0 where read.
        ``positions`` (B, 1, L); ``caches``: each row's (or None)."""
        B, L, _ = x.shape
        keys = self.compressor(x, caches, "indexer", freqs)
        q = self.wq_b(q_residual).reshape(B, L, self.heads, self.dim).transpose(0, 2, 1, 3)
        q = rope(q, positions, freqs)
        scores = mx.maximum(q.astype(mx.float32) @ keys.astype(mx.float32)[:, None]
                            .swapaxes(-1, -2), 0) * self.dim**-0.5
        weights = self.weights_proj(x).astype(mx.float32) * self.heads**-0.5
        scores = (scores * weights.transpose(0, 2, 1)[..., None]).sum(axis=1)  # (B, L, T)
        T = keys.shape[1]
        scores = mx.where(visible_entries(positions[:, 0], T, self.compressor.ratio), scores,
                          -mx.inf)
        if T == 0:
            return scores
        kth = mx.topk(scores, min(self.topk, T), axis=-1).min(axis=-1, keepdims=True)
        return mx.where((scores >= kth) & (scores > -mx.inf), 0.0, -mx.inf)


class Attention(nn.Module):
    def __init__(self, args, layer_type: str):
        super().__init__()
        H, D = args.hidden_size, args.head_dim
        self.heads, self.head_dim, self.window = args.num_attention_heads, D, args.sliding_window
        self.groups, self.eps = args.o_groups, args.rms_norm_eps
        self.wq_a = nn.Linear(H, args.q_lora_rank, bias=False)
        self.q_norm = nn.RMSNorm(args.q_lora_rank, eps=args.rms_norm_eps)
        self.wq_b = nn.Linear(args.q_lora_rank, self.heads * D, bias=False)
        self.wkv = nn.Linear(H, D, bias=False)
        self.norm = nn.RMSNorm(D, eps=args.rms_norm_eps)
        self.wo_a = nn.Linear(self.heads * D // self.groups, self.groups * args.o_lora_rank,
                              bias=False)
        self.wo_b = nn.Linear(self.groups * args.o_lora_rank, H, bias=False)
        self.attn_sink = mx.zeros((self.heads,))
        self.ratio = args.compress_ratio(layer_type)
        if self.ratio:
            csa = layer_type == "compressed_sparse_attention"
            self.compressor = Compressor(H, D, self.ratio, csa, args.rms_norm_eps)
            if csa:
                self.indexer = Indexer(args)

    def __call__(self, x, positions, caches, freqs) -> mx.array:
        """``positions`` (B, 1, L): each row's; ``caches``: each row's cache (None: one
        pass without a cache, every row at the same positions)."""
        q, q_residual = self.queries(x, positions, freqs)
        kv = self.keys_values(x, positions, freqs)
        keys, bias = self.keys_and_bias(x, q_residual, kv, positions, caches, freqs)
        return self.output(self.attend(q, keys, bias), positions, freqs)

    def queries(self, x, positions, freqs) -> tuple:
        """(roped queries (B, heads, L, D), the low-rank residual the indexer reads)."""
        B, L, _ = x.shape
        q_residual = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_residual).reshape(B, L, self.heads, self.head_dim).transpose(0, 2, 1, 3)
        return rope(rms(q, self.eps), positions, freqs), q_residual

    def keys_values(self, x, positions, freqs) -> mx.array:
        """The single shared key/value head (B, 1, L, D), roped."""
        return rope(self.norm(self.wkv(x))[:, None], positions, freqs)

    def output(self, out, positions, freqs) -> mx.array:
        """Attention output (B, heads, L, D) -> (B, L, H): un-roped, grouped low-rank out."""
        B, _, L, _ = out.shape
        out = rope(out, positions, freqs, inverse=True).transpose(0, 2, 1, 3)
        out = out.reshape(B, L, self.groups, -1)
        w = self.wo_a.weight.reshape(self.groups, -1, out.shape[-1])
        out = mx.einsum("blgi,gri->blgr", out, w).reshape(B, L, -1)
        return self.wo_b(out)

    def keys_and_bias(self, x, q_residual, kv, positions, caches, freqs) -> tuple:
        """The keys the rows read (B, 1, K, D) and the additive bias over them (B, 1, L, K):
        each row's window (its own cache's: rows sit at different phases, so each is read
        alone and left-padded to the longest), then its compressed entries (right-padded);
        padding is masked, so each row attends as it would alone. The bias, the compressors'
        pooling and the indexer's scores run over all rows at once."""
        L = x.shape[1]
        if caches is None:
            keys, pad = kv, mx.zeros((1, 1), mx.int32)
        else:
            keys, pad = left_padded([c.window_keys(kv[b:b + 1]) for b, c in enumerate(caches)])
        K, pos = keys.shape[2], positions[:, 0]
        kpos = pos[:, :1] - (K - L) + mx.arange(K)  # (B, K): each column's position
        near = pos[..., None] - kpos[:, None]
        seen = (near >= 0) & (near < self.window) & (mx.arange(K) >= pad)[:, None]
        bias = mx.where(seen, 0.0, -mx.inf)[:, None]
        if self.ratio:
            entries = self.compressor(x, caches, "compressor", freqs)[:, None]
            seen = visible_entries(pos, entries.shape[2], self.ratio)
            extra = mx.where(seen, 0.0, -mx.inf)[:, None]
            if "indexer" in self:
                extra = extra + self.indexer(x, q_residual, positions, caches, freqs)[:, None]
            keys = mx.concatenate([keys, entries.astype(keys.dtype)], axis=2)
            bias = mx.concatenate([bias, extra], axis=-1)
        return keys, bias

    def attend(self, q, keys, bias) -> mx.array:
        """Softmax over the keys and a per-head sink logit (whose value is dropped)."""
        scores = (q @ keys.swapaxes(-1, -2)) * self.head_dim**-0.5 + bias.astype(q.dtype)
        sink = mx.broadcast_to(self.attn_sink.astype(scores.dtype)[None, :, None, None],
                               scores.shape[:-1] + (1,))
        probs = mx.softmax(mx.concatenate([scores, sink], axis=-1).astype(mx.float32), axis=-1)
        return probs[..., :-1].astype(keys.dtype) @ keys


def left_padded(windows) -> tuple:
    """Rows' window keys (1, 1, K_b, D) left-padded with zeros to the longest: (keys
    (B, 1, K, D), each row's padding columns (B, 1))."""
    K = max(k.shape[2] for k in windows)
    keys = [mx.pad(k, [(0, 0), (0, 0), (K - k.shape[2], 0), (0, 0)]) for k in windows]
    return mx.concatenate(keys), mx.array([K - k.shape[2] for k in windows])[:, None]


class ClampedSwiGLU(nn.Module):
    """silu(min(gate, limit)) * clip(up, -limit, limit), as transformers' experts apply it."""

    def __init__(self, limit: float):
        super().__init__()
        self.limit = limit

    def __call__(self, up, gate):
        return nn.silu(mx.minimum(gate, self.limit)) * mx.clip(up, -self.limit, self.limit)


class SharedExpert(nn.Module):
    def __init__(self, hidden: int, inner: int, limit: float):
        super().__init__()
        self.w1 = nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inner, bias=False)
        self.act = ClampedSwiGLU(limit)

    def __call__(self, x):
        return self.w2(self.act(self.w3(x), self.w1(x)))


class Gate(nn.Module):
    def __init__(self, args, hashed: bool):
        super().__init__()
        self.top_k, self.scale = args.num_experts_per_tok, args.routed_scaling_factor
        self.weight = mx.zeros((args.n_routed_experts, args.hidden_size))
        if hashed:
            self.tid2eid = mx.zeros((args.vocab_size, self.top_k), mx.int32)
        else:
            self.bias = mx.zeros((args.n_routed_experts,))

    def __call__(self, x, tokens) -> tuple:
        scores = mx.sqrt(nn.softplus((x @ self.weight.T).astype(mx.float32)))
        if "tid2eid" in self:
            experts = self.tid2eid[tokens]
        else:
            experts = mx.argpartition(-(scores + self.bias), self.top_k - 1, axis=-1)
            experts = experts[..., : self.top_k]
        weights = mx.take_along_axis(scores, experts, axis=-1)
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20) * self.scale
        return experts, weights


class MoE(nn.Module):
    def __init__(self, args, hashed: bool):
        super().__init__()
        limit = args.swiglu_limit
        self.gate = Gate(args, hashed)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size,
                                    args.n_routed_experts, activation=ClampedSwiGLU(limit))
        self.shared_experts = SharedExpert(args.hidden_size, args.moe_intermediate_size, limit)

    def __call__(self, x, tokens):
        experts, weights = self.gate(x, tokens)
        routed = (self.switch_mlp(x, experts) * weights[..., None].astype(x.dtype)).sum(axis=-2)
        return routed + self.shared_experts(x)


def hc_collapse(streams, fn, base, scale, eps: float, norm_eps: float, n: int):
    """The mHC perceptron over the flattened streams: (pre-weighted collapse, mixes)."""
    B, L, N, H = streams.shape
    flat = rms(streams.reshape(B, L, N * H).astype(mx.float32), norm_eps)
    mixes = flat @ fn.astype(mx.float32).T
    pre = mx.sigmoid(mixes[..., :n] * scale[0] + base[:n]) + eps
    collapsed = (pre[..., None] * streams).sum(axis=2).astype(streams.dtype)
    return collapsed, mixes


def hc_block(streams, fn, base, scale, args, block):
    """One mHC site (``hc_attn_*`` or ``hc_ffn_*``) around ``block``: the block runs on the
    collapsed streams; its output, expanded, is added to the doubly stochastic mix of the
    streams."""
    n, eps = args.hc_mult, args.hc_eps
    collapsed, mixes = hc_collapse(streams, fn, base, scale, eps, args.rms_norm_eps, n)
    post = 2 * mx.sigmoid(mixes[..., n:2 * n] * scale[1] + base[n:2 * n])
    comb = mixes[..., 2 * n:].reshape(*mixes.shape[:-1], n, n) * scale[2]
    comb = mx.softmax(comb + base[2 * n:].reshape(n, n), axis=-1) + eps
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    for _ in range(args.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    y = block(collapsed)
    dtype = streams.dtype
    return (post.astype(dtype)[..., None] * y[:, :, None]
            + comb.astype(dtype).swapaxes(-1, -2) @ streams)


class Block(nn.Module):
    """One V4 decoder layer over (B, L, hc_mult, H) streams."""

    def __init__(self, args, layer_type: str, hashed: bool):
        super().__init__()
        n, H = args.hc_mult, args.hidden_size
        self.args = args
        self.attn = Attention(args, layer_type)
        self.ffn = MoE(args, hashed)
        self.attn_norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.ffn_norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", mx.zeros(((2 + n) * n, n * H)))
            setattr(self, f"hc_{site}_base", mx.zeros(((2 + n) * n,)))
            setattr(self, f"hc_{site}_scale", mx.ones((3,)))

    def __call__(self, streams, tokens, positions, caches, freqs, capture: bool = False):
        """``positions`` (B, 1, L); ``caches``: each row's (or None); ``capture``: a verify
        pass, whose caches keep what ``accept`` rolls back to."""
        for c in caches or ():
            c.begin(streams.shape[1], capture)
        streams = hc_block(
            streams, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, self.args,
            lambda x: self.attn(self.attn_norm(x), positions, caches, freqs))
        return hc_block(
            streams, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, self.args,
            lambda x: self.ffn(self.ffn_norm(x), tokens))


class HyperHead(nn.Module):
    """The final stream collapse (``hc_head_*``)."""

    def __init__(self, args):
        super().__init__()
        n = args.hc_mult
        self.fn = mx.zeros((n, n * args.hidden_size))
        self.base = mx.zeros((n,))
        self.scale = mx.ones((1,))
        self.eps, self.norm_eps, self.n = args.hc_eps, args.rms_norm_eps, n

    def __call__(self, streams):
        return hc_collapse(streams, self.fn, self.base, self.scale, self.eps, self.norm_eps,
                           self.n)[0]


def stream_input(x: mx.array, n: int) -> mx.array:
    """(B, L, H) -> (B, L, n, H): every stream starts as the input."""
    return mx.broadcast_to(x[:, :, None], (x.shape[0], x.shape[1], n, x.shape[2]))

