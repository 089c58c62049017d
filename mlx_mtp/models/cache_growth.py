"""What a model's caches hold per sequence, from the caches themselves (``nbytes``), computed
on shapes alone: the one source of ``inspect``'s KV figures for every family and cache kind.

The model's own ``make_cache``/``make_mtp_cache`` caches take a prompt through ``trunk`` and
the MTP head, in chunks as a prefill writes them, inside an ``mx.compile`` trace:
MLX knows every array's shape and dtype without computing it, and a trace refuses to evaluate
anything, so a 50 GB checkpoint built lazily (``loader.build_model``) is measured without
reading or allocating a weight. A family or cache kind added later is measured like the rest,
with nothing to declare.

The growth is what the caches hold after ``n + 1024`` tokens less after ``n`` (``n`` past
every bounded cache's ``max_positions``, so sliding windows, recurrent states and pending
rows drop out); what they hold after ``n`` tokens beyond ``n`` times the per-token growth is
held per sequence whatever its length. The server's memory budget measures its served
model's caches past their bounds by the same trace (``traced_bytes``, in their batch form).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import mlx.core as mx
from mlx.utils import tree_map_with_path

from .cache.quantized import KVQuantization

GROWTH_TOKENS = 1024  # the figures are per this many tokens
CHUNK = 256  # prompt chunk: a window holds what a chunked prefill leaves, not a whole prompt


@dataclass(frozen=True)
class CacheGrowth:
    """``per_1k_tokens``: bytes each 1024 more tokens add to a sequence's caches (trunk and
    MTP head); ``per_sequence``: bytes held whatever the length, by the cache ``kinds``."""

    per_1k_tokens: int
    per_sequence: int
    kinds: Tuple[str, ...]


def cache_growth(model, quant: Optional[KVQuantization] = None,
                 dtype: mx.Dtype = mx.bfloat16) -> CacheGrowth:
    """The caches of ``model`` (its float weights cast to ``dtype`` as the loader casts them,
    ``quant`` applied through ``use_kv_quantization``, whose ValueError passes through) after
    ``n`` and ``n + 1024`` tokens, on shapes only (ValueError if a pass needs a value). The
    model is left so cast and quantized: pass one built to be measured (``inspect``'s)."""
    model.use_kv_quantization(quant)
    model.update(tree_map_with_path(
        lambda path, v: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating)
        and model.cast_predicate(path) else v, model.parameters()))
    trunk, head = model.make_cache(), model.make_mtp_cache()
    n = past_bounds(trunk + head)
    short, long = traced_bytes(model, trunk, head, (n, n + GROWTH_TOKENS))
    grows = [b - a for a, b in zip(short, long)]
    fixed = [a - g * n // GROWTH_TOKENS for a, g in zip(short, grows)]
    return CacheGrowth(sum(grows), sum(fixed),
                       tuple(dict.fromkeys(c.kind for c, f in zip(trunk + head, fixed) if f)))


def past_bounds(caches: list) -> int:
    """A length in whole ``GROWTH_TOKENS`` past every cache's ``max_positions``."""
    bounds = [b for b in (c.max_positions() for c in caches) if b is not None]
    return GROWTH_TOKENS * -(-max(bounds + [1]) // GROWTH_TOKENS)


def traced_bytes(model, trunk: list, head: list, lengths: Tuple[int, ...],
                 run: Optional[Callable] = None, held: Callable = lambda c: c.nbytes) -> list:
    """``held(c)`` of each cache of ``trunk + head`` after each of ``lengths`` (multiples of
    ``CHUNK``) prompt tokens, on shapes alone inside an ``mx.compile`` trace (ValueError if
    a pass needs a value): ``run(ids, trunk)`` (default ``model.trunk``) takes the chunks,
    and the head's pass reads them (each hidden with the token after it; the depth-0 pass
    writes every MTP layer's committed entries, as a prefill's does)."""
    run = run or model.trunk
    out = []

    def prefill(x):
        ids = (mx.arange(lengths[-1] + 1) % 97 + 1).astype(mx.uint32)[None]
        for start in range(0, lengths[-1], CHUNK):
            h = run(ids[:, start:start + CHUNK], trunk)[1]
            if head:
                model.mtp_forward(h, ids[:, start + 1:start + 1 + CHUNK], head)
            if start + CHUNK in lengths:
                out.append([held(c) for c in trunk + head])
        return x

    mx.compile(prefill)(mx.zeros(1))
    return out
