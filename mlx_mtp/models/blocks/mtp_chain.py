"""Several distinct MTP layers chained by depth (MiMo-V2-Flash ships three).

Layer j at position p takes layer j-1's output at p and the embedding of t_{p+j+1}
(layer 0: the trunk's hidden and t_{p+1}); each layer keeps its own KV cache, and drafting
depth j (from the newest position q) runs layer j. A layer's cache must hold its entries
for the committed positions, so every depth-0 call (the head's pass over the step's new
trunk hiddens) also *catches up* layers 1.. on the positions whose tokens are now known:
layer j lags j positions behind layer 0, and each layer's cache (``cache.chain.ChainCache``)
keeps layer j-1's newest output (the one whose token is not known yet) as its pending input.

The depth-j draft then runs layer j over positions q-j+1 .. q (the pending output and the
depth-(j-1) call's outputs, with drafts d_1..d_j as tokens): j speculative entries, rolled
back after the step (``drafted_entries``). Depth j >= the number of layers reuses the last
layer on one position. The pending output travels with its row through snapshots, copies,
batch joins and saved sessions.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import List, Optional

import mlx.core as mx

from ..io import layout
from .attention_trunk import MTPLayer, MTPStack
from ..cache.chain import ChainCache


def drafted_entries(n_layers: int, k: int) -> List[int]:
    """Entries each layer's cache gets from a step's k - 1 chained draft calls."""
    counts = [0] * n_layers
    for j in range(1, k):
        if j < n_layers:
            counts[j] += j
        else:
            counts[-1] += 1
    return counts


def catch_up(run_layer, out: mx.array, tokens: mx.array, caches: List[ChainCache]):
    """After layer 0 ran on a chunk (out (B,S,H), tokens (B,S) right-aligned with per-row
    lengths), run layers 1.. on the positions each can now take; keep their pending."""
    lengths = caches[0].chunk_lengths(tokens.shape[1])
    for j in range(1, len(caches)):
        x, lengths = caches[j].take(out, lengths)
        if max(lengths) == 0:
            return
        x, tokens = caches[j].chunk(x[:, :-1], tokens, lengths)
        out = run_layer(j, x, tokens, caches[j])


def draft_at_depth(run_layer, depth: int, hidden: mx.array, token: mx.array,
                   caches: Optional[list]):
    """Depth ``depth`` >= 1 draft call: ``hidden`` is the previous depth's output, ``token``
    (B,1) the newest draft. Returns the layer's outputs (the newest last)."""
    n = len(caches) if caches else 1
    if caches is None or depth >= n:
        j = min(depth, n - 1)
        return run_layer(j, hidden[:, -1:], token, caches[j] if caches else None)
    tokens = caches[0].note_draft(depth, token)  # d_1 .. d_depth
    cache = caches[depth]
    pend = cache.pending_rows(hidden.shape[0], hidden.shape[-1], hidden.dtype)
    x = pend if depth == 1 else mx.concatenate([pend, hidden[:, -(depth - 1):]], axis=1)
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

    def make_mtp_cache(self):
        caches = super().make_mtp_cache()
        return [ChainCache(c) for c in caches] if len(caches) > 1 else caches

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
