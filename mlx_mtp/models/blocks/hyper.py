"""Qwen4-Exp's hyper-connection streams and per-layer n-gram embeddings (PLE).

The residual is ``hc_count`` streams side by side, (B, L, hc·H). Each sub-block reads one
mixture of them (``HyperConnection``) and writes its output back into every stream with its
own weight; the trunk's output is the final mixture (no final norm). PLE adds, on some
Gated DeltaNet layers, hashed 2..n-gram embeddings of the token ids gated by each stream and
passed through a dilated depthwise convolution. Norms here are zero-centred in the
checkpoint, made (1 + w) when loaded; "grouped" ones normalise each stream apart.
transformers 5.24 ``models/qwen4_exp/modeling_qwen4_exp.py`` is the reference.
"""

from __future__ import annotations

import math
from typing import List

import mlx.core as mx
import mlx.nn as nn

from ..cache.short import ShortWindowCache

_MASK64 = (1 << 64) - 1
_SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
_PRIME_1 = 10007


class GroupedRMSNorm(nn.Module):
    """RMSNorm over each ``group``-wide slice of the last axis (one per stream)."""

    def __init__(self, dims: int, group: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.group, self.eps = group, eps

    def __call__(self, x):
        g = x.reshape(*x.shape[:-1], -1, self.group)
        y = mx.fast.rms_norm(g, None, self.eps).reshape(x.shape)
        return y * self.weight


class HyperConnection(nn.Module):
    """Mix the streams into one sub-block input; with ``combine`` also each stream's weight
    for the sub-block's output: (mixed, streams, weights)."""

    def __init__(self, hidden: int, count: int, lowrank: int, eps: float, combine: bool = True):
        super().__init__()
        self.count, self.hidden = count, hidden
        self.hc_norm = GroupedRMSNorm(count * hidden, hidden, eps)
        self.input_mix_weight_down = nn.Linear(count * hidden, lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(lowrank, count * hidden, bias=False)
        if combine:
            self.block_inject_weight = nn.Linear(count * hidden, count, bias=False)

    def __call__(self, streams):
        normed = self.hc_norm(streams)
        w = nn.silu(self.input_mix_weight_down(normed) / self.count)
        w = mx.sigmoid(self.input_mix_weight_up(w))
        split = (*streams.shape[:-1], self.count, self.hidden)
        mixed = (w.reshape(split) * normed.reshape(split)).mean(axis=-2)
        if "block_inject_weight" not in self:
            return mixed
        return mixed, streams, 2 * mx.sigmoid(self.block_inject_weight(normed) / self.count)


def inject(streams, out, weights):
    """Add a sub-block's output (B, L, H) to every stream with its weight (B, L, hc)."""
    return streams + (out[..., None, :] * weights[..., None]).reshape(streams.shape)


# --- hashed n-gram ids (exact: Python integers, then int64 that cannot overflow) ---------

def _splitmix64(value: int) -> int:
    value = (value + _SPLITMIX_GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def layer_multipliers(vocab: int, n: int, ple_index: int, seed: int) -> List[int]:
    """Odd multipliers below (2^63 - 1) / vocab: a token id times one stays below 2^63."""
    half = max(1, ((1 << 63) - 1) // max(vocab, 1) // 2)
    base = seed + _PRIME_1 * ple_index
    return [2 * (_splitmix64((base + _SPLITMIX_GAMMA * (i + 1)) & _MASK64) % half) + 1
            for i in range(n)]


def primes_after(start: int, count: int) -> List[int]:
    """The first ``count`` primes above ``start``."""
    out, p = [], start
    while len(out) < count:
        p += 1
        if p > 1 and all(p % d for d in range(2, math.isqrt(p) + 1)):
            out.append(p)
    return out


class NGramIds:
    """One PLE layer's hash: token history -> (B, L, heads) rows of its embedding table."""

    def __init__(self, vocab: int, n: int, heads_per_ngram: int, base: int, ple_index: int,
                 seed: int, eos: int):
        self.n, self.per, self.eos = n, heads_per_ngram, eos
        heads = (n - 1) * heads_per_ngram
        sizes = primes_after(base - 1, (ple_index + 1) * heads)[ple_index * heads:]
        self.sizes = mx.array(sizes, mx.int64)
        self.offsets = mx.array([sum(sizes[:i]) for i in range(heads)], mx.int64)
        self.table_rows = sum(sizes)
        self.multipliers = mx.array(layer_multipliers(vocab, n, ple_index, seed), mx.int64)

    def __call__(self, history, L: int):
        """``history``: (B, n-1+L) ids, the context before the L new ones first. A token
        after an EOS sees EOS for every earlier position (the context resets)."""
        h = history.astype(mx.int64)
        start = h.shape[1] - L
        mixed = h[:, start:] * self.multipliers[0]
        blocked = mx.zeros(mixed.shape, mx.bool_)
        blocks = []
        for s in range(1, self.n):
            prev = h[:, start - s: h.shape[1] - s]
            shifted = mx.where(blocked, self.eos, prev)
            blocked = blocked | (prev == self.eos)
            mixed = mixed ^ (shifted * self.multipliers[s])
            heads = slice((s - 1) * self.per, s * self.per)
            blocks.append(mx.remainder(mixed[..., None], self.sizes[heads]) + self.offsets[heads])
        return mx.concatenate(blocks, axis=-1)


class NGramEmbedding(nn.Module):
    """The hash and the (padded) table all of a layer's n-gram heads share."""

    def __init__(self, args, ple_index: int):
        super().__init__()
        heads = (args.ngram_size - 1) * args.heads_per_ngram
        self.ids = NGramIds(args.vocab_size, args.ngram_size, args.heads_per_ngram,
                            args.ngram_vocab_size_base, ple_index, args.seed, args.eos_id)
        step = args.make_ngram_vocab_size_divisible_by
        rows = -(-self.ids.table_rows // step) * step
        self.ngram_embedding = nn.Embedding(rows, args.ple_embed_dim // heads)

    def __call__(self, history, L: int):
        B = history.shape[0]
        return self.ngram_embedding(self.ids(history, L)).reshape(B, L, -1)


class PerLayerEmbedding(nn.Module):
    """PLE: hashed n-gram embeddings gated by each stream, plus their dilated convolution."""

    def __init__(self, args, ple_index: int):
        super().__init__()
        H, hc, D = args.hidden_size, args.hc_count, args.ple_embed_dim
        self.ple_embedding = NGramEmbedding(args, ple_index)
        self.start_values = (0, args.eos_id)  # the windows before any token: zeros, EOS
        self.hidden, self.hc = H, hc
        self.context = args.ngram_size - 1
        self.conv_window = (args.ple_conv_kernel_size - 1) * args.ngram_size
        self.key_proj = nn.Linear(D, hc * H, bias=False)
        self.value_proj = nn.Linear(D, H, bias=False)
        eps = args.rms_norm_eps
        self.norm_key = GroupedRMSNorm(hc * H, H, eps)
        self.norm_query = GroupedRMSNorm(hc * H, H, eps)
        self.norm_conv = GroupedRMSNorm(hc * H, H, eps)
        self.conv1d = nn.Conv1d(hc * H, hc * H, args.ple_conv_kernel_size, groups=hc * H,
                                dilation=args.ngram_size, bias=False)

    def __call__(self, streams, ids, cache: ShortWindowCache = None, capture: bool = False):
        B, L, _ = streams.shape
        windows = cache.state if cache is not None else ()
        if not windows:
            conv, token = self.start_values
            windows = (mx.full((B, self.conv_window, streams.shape[-1]), conv, streams.dtype),
                       mx.full((B, self.context), token, ids.dtype))
        history = mx.concatenate([windows[1].astype(ids.dtype), ids], axis=1)
        emb = self.ple_embedding(history, L)
        split = (B, L, self.hc, self.hidden)
        key = self.norm_key(self.key_proj(emb)).reshape(split)
        query = self.norm_query(streams).reshape(split)
        gate = (key * query).sum(axis=-1, keepdims=True) / math.sqrt(self.hidden)
        gate = mx.sqrt(mx.maximum(mx.abs(gate), 1e-6)) * mx.sign(gate)
        gated = (mx.sigmoid(gate) * self.value_proj(emb)[:, :, None]).reshape(B, L, -1)
        conv_input = mx.concatenate([windows[0], self.norm_conv(gated)], axis=1)
        if cache is not None:
            cache.advance((conv_input, history), L, capture)
        return gated + nn.silu(self.conv1d(conv_input))
