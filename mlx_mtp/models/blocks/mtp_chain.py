"""Several distinct MTP layers chained by depth (MiMo-V2-Flash ships three).

Layer j at position p takes layer j-1's output at p and the embedding of t_{p+j+1}
(layer 0: the trunk's hidden and t_{p+1}); each layer keeps its own KV cache, and drafting
depth j (from the newest position q) runs layer j. A layer's cache must hold its entries
for the committed positions, so every depth-0 call (the head's pass over the step's new
trunk hiddens) also *catches up* layers 1.. on the positions whose tokens are now known:
layer j lags j positions behind layer 0, and each layer keeps layer j-1's newest output
(the one whose token is not known yet) as ``chain_pending`` on its cache.

The depth-j draft then runs layer j over positions q-j+1 .. q (the pending output and the
depth-(j-1) call's outputs, with drafts d_1..d_j as tokens): j speculative entries, rolled
back after the step (``drafted_entries``). Depth j >= the number of layers reuses the last
layer on one position. MTP caches only shape drafts: anything that loses a pending output
(a cache copy, a batch join) lowers acceptance for a step, never changes output.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import List, Optional

import mlx.core as mx

from ..io import layout
from .attention_trunk import MTPLayer, MTPStack
from ..cache.kv import BatchKVCache


def drafted_entries(n_layers: int, k: int) -> List[int]:
    """Entries each layer's cache gets from a step's k - 1 chained draft calls."""
    counts = [0] * n_layers
    for j in range(1, k):
        if j < n_layers:
            counts[j] += j
        else:
            counts[-1] += 1
    return counts


def _lengths(cache, B: int, S: int) -> List[int]:
    lengths = getattr(cache, "_lengths", None) if isinstance(cache, BatchKVCache) else None
    return list(lengths) if lengths is not None else [S] * B


def _pending(cache, B: int, H: int, dtype):
    pending = getattr(cache, "chain_pending", None)
    if pending is None or pending[0].shape[0] != B:  # a new cache, or rows joined or left
        return mx.zeros((B, 1, H), dtype), [False] * B
    return pending


def catch_up(run_layer, out: mx.array, tokens: mx.array, caches: list):
    """After layer 0 ran on a chunk (out (B,S,H), tokens (B,S) right-aligned with per-row
    lengths), run layers 1.. on the positions each can now take; keep their pending."""
    B, S = tokens.shape
    lengths = _lengths(caches[0], B, S)
    for j in range(1, len(caches)):
        cache = caches[j]
        pend, valid = _pending(cache, B, out.shape[-1], out.dtype)
        x = mx.concatenate([pend, out], axis=1)  # (B, S+1, H)
        if any(n < S for n in lengths):  # move each row's pending next to its new outputs
            i = mx.arange(S + 1)[None]
            ix = mx.where(i >= (S + 1 - mx.array(lengths))[:, None], i, 0)
            x = mx.take_along_axis(x, ix[..., None], axis=1)
        has_new = [n > 0 for n in lengths]
        keep_new = mx.array(has_new)[:, None, None]
        cache.chain_pending = (mx.where(keep_new, x[:, S:], pend),
                               [v or h for v, h in zip(valid, has_new)])
        lengths = [n + v - 1 if n else 0 for n, v in zip(lengths, valid)]
        if max(lengths) == 0:
            return
        if isinstance(cache, BatchKVCache):
            cache.prepare(S, lengths)
            out = run_layer(j, x[:, :S], tokens, cache)
        else:  # one row: no padding
            S = lengths[0]
            tokens = tokens[:, tokens.shape[1] - S:]
            out = run_layer(j, x[:, x.shape[1] - 1 - S : -1], tokens, cache)


def draft_at_depth(run_layer, depth: int, hidden: mx.array, token: mx.array,
                   caches: Optional[list]):
    """Depth ``depth`` >= 1 draft call: ``hidden`` is the previous depth's output, ``token``
    (B,1) the newest draft. Returns the layer's outputs (the newest last)."""
    n = len(caches) if caches else 1
    if caches is None or depth >= n:
        j = min(depth, n - 1)
        return run_layer(j, hidden[:, -1:], token, caches[j] if caches else None)
    chain = caches[0]
    chain.chain_drafts = (getattr(chain, "chain_drafts", [])[: depth - 1]) + [token]
    cache = caches[depth]
    B, H = hidden.shape[0], hidden.shape[-1]
    pend, _ = _pending(cache, B, H, hidden.dtype)
    x = pend if depth == 1 else mx.concatenate([pend, hidden[:, -(depth - 1):]], axis=1)
    tokens = mx.concatenate(chain.chain_drafts, axis=1)  # d_1 .. d_depth
    cache.prepare(depth)  # the step announced one position; this call writes ``depth``
    return run_layer(depth, x, tokens, cache)


class ChainedMTP:
    """Mixin for an ``attention_trunk`` model whose release ships several MTP layers, one
    per depth: builds, loads, names and drafts with all of them."""

    def __init__(self, args):
        super().__init__(args)
        if self.declared_mtp_layers > 1:
            a, n = self.args, self.args.num_hidden_layers
            self.mtp = MTPStack([MTPLayer(a.hidden_size, a.rms_norm_eps,
                                          self.family.block(a, n + i))
                                 for i in range(self.declared_mtp_layers)])

    def released_prefix(self, i: int) -> str:
        """Where MTP layer ``i`` lives in the release."""
        return self.family.mtp_prefix(self.args, i)

    # --- drafting -----------------------------------------------------------
    def run_mtp_layer(self, i: int, hidden, tokens, cache):
        layer = self.mtp.layers[i]
        e, h = layer.enorm(self.model.embed_tokens(tokens)), layer.hnorm(hidden)
        x = layer.eh_proj(mx.concatenate([h, e] if self.family.hidden_first else [e, h], -1))
        mask = cache.make_mask(x.shape[1]) if cache is not None else (
            "causal" if x.shape[1] > 1 else None)
        return layer.norm(layer.block(x, mask, cache))

    def mtp_forward(self, hidden, next_tokens, mtp_cache, depth: int = 0,
                    last_only: bool = False):
        """``last_only``: only the last row's output. One layer: the shared block's pass
        (its MLP runs on that row alone); several: every row's layer-0 output is computed,
        layer 1 catches up on them."""
        if depth:
            return draft_at_depth(self.run_mtp_layer, depth, hidden, next_tokens, mtp_cache)
        if self.num_mtp_layers == 1:  # the same call as ``run_mtp_layer(0, ...)``
            return super().mtp_forward(hidden, next_tokens, mtp_cache, 0, last_only)
        out = self.run_mtp_layer(0, hidden, next_tokens, mtp_cache[0] if mtp_cache else None)
        if mtp_cache and len(mtp_cache) > 1:
            catch_up(self.run_mtp_layer, out, next_tokens, mtp_cache)
        return out[:, -1:] if last_only else out

    def drafted_entries(self, k: int) -> List[int]:
        return drafted_entries(self.num_mtp_layers, k)

    # --- weights ------------------------------------------------------------
    def sanitize(self, weights: dict) -> dict:
        """The shared sanitize reads and checks layer 0; the later layers are read here."""
        later = {}
        for i in range(1, self.num_mtp_layers):
            prefix = self.family.mtp_prefix(self.args, i)
            raw = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
            if not raw:
                raise layout.MissingMTPWeightsError(self.missing_mtp_message(
                    [self.released_prefix(i) + "eh_proj.weight"]))
            later.update({f"mtp.layers.{i}." + k[len("mtp.layers.0."):]: v
                          for k, v in self.mtp_weights(raw).items()})
        with self._first_mtp_layer_only():
            out = super().sanitize(weights)
        out.update(later)
        return out

    @contextmanager
    def _first_mtp_layer_only(self):
        if "mtp" not in self:
            yield
            return
        layers = self.mtp.layers
        self.mtp.layers = layers[:1]
        try:
            yield
        finally:
            self.mtp.layers = layers

    def checkpoint_name(self, key: str) -> str:
        later = re.match(r"mtp\.layers\.([1-9]\d*)\.", key)
        if not later:
            return super().checkpoint_name(key)
        name = self.checkpoint_name("mtp.layers.0." + key[later.end():])
        i = int(later.group(1))
        return self.released_prefix(i) + name[len(self.released_prefix(0)):]
