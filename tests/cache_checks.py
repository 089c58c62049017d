"""What the cache-protocol tests share: a sequence's caches decoded alone, exact array
equality, and merged batches whose rows must equal those solo caches."""

import mlx.core as mx

from mlx_mtp.models.cache.kv import cache_state_arrays


def solo(model, prompt):
    """Caches after running ``prompt`` through the trunk alone."""
    cache = model.make_cache()
    model.trunk(mx.array([prompt], mx.uint32), cache)
    mx.eval(cache_state_arrays(cache))
    return cache


def same(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert x.shape == y.shape and mx.array_equal(x, y).item()


def next_logits(model, cache, tokens):
    """Logits after feeding ``tokens`` (one list of ids per row)."""
    h, _ = model.trunk(mx.array(tokens, mx.uint32), cache)
    return model.logits(h)


def merged_solos(model, prompts):
    """Each prompt's solo caches, and every layer's caches merged into one batch."""
    solos = [solo(model, p) for p in prompts]
    return solos, [type(cs[0]).merge(list(cs)) for cs in zip(*solos)]


def assert_rows_are(merged, solos, order=None):
    """Row ``b`` of the merged caches holds exactly ``solos[order[b]]``."""
    for b, src in enumerate(range(len(solos)) if order is None else order):
        same(cache_state_arrays([c.extract(b) for c in merged]), cache_state_arrays(solos[src]))


def assert_filter_keeps_rows(merged, solos, rows=(2, 0)):
    for c in merged:
        c.filter(list(rows))
    assert_rows_are(merged, solos, rows)


def watch_pooling(monkeypatch):
    """Every pass of a pooling indexer with a cache (Qwen4-Exp's QSA, GLM-5.3's k-pool):
    each row's complete blocks equal those pooled again from its keys (bit for bit), and
    the pass is recorded as (blocks it scores, blocks it pooled per row)."""
    from mlx_mtp.models.cache import index

    passes, original = [], index._PooledBlocks.pooled_blocks

    def pooled_blocks(cache, n_blocks, ratio, pool):
        widths = []
        got = original(cache, n_blocks, ratio,
                       lambda first, width: widths.append(width) or pool(first, width))
        again = pool(mx.zeros((cache.size(), 1), mx.int32), n_blocks)
        complete = mx.array(cache.lengths())[:, None, None] // ratio
        own = mx.arange(n_blocks)[None, :, None] < complete
        assert mx.array_equal(mx.where(own, got, 0), mx.where(own, again, 0)).item()
        passes.append((n_blocks, sum(widths)))
        return got

    monkeypatch.setattr(index._PooledBlocks, "pooled_blocks", pooled_blocks)
    return passes
