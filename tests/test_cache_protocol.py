"""The cache protocol (models/cache.py): save/load, snapshot/restore and batch
surgery give back exactly the state a sequence decoded alone holds."""

import mlx.core as mx
import pytest

from cache_checks import (assert_filter_keeps_rows, assert_rows_are, merged_solos, next_logits,
                          same, solo)

from mlx_mtp.models.cache.kv import BatchKVCache, KVCache, cache_state_arrays, restore_caches, snapshot_caches
from mlx_mtp.models.cache.recurrent import RecurrentCache

PROMPTS = [[5, 9, 200, 31, 7, 64, 3], [11, 400], [1]]


def test_state_round_trip_continues_exactly(tiny_model):
    cache = solo(tiny_model, PROMPTS[0])
    loaded = [type(c).from_state(c.state if c.arrays() else None, c.meta_state) for c in cache]
    same(cache_state_arrays(loaded), cache_state_arrays(cache))
    assert [c.meta_state for c in loaded] == [c.meta_state for c in cache]
    same([next_logits(tiny_model, loaded, [[42]])], [next_logits(tiny_model, cache, [[42]])])


def test_empty_state_round_trip():
    for cls in (KVCache, RecurrentCache):
        c = cls.from_state(None, ("0",))
        assert c.arrays() == [] and c.size() == 1
    with pytest.raises(ValueError, match="offset"):
        k = mx.zeros((1, 2, 3, 4))
        KVCache.from_state((k, k), ("5",))


def test_batch_kv_state_round_trip():
    singles = []
    for n in (3, 6):
        c = KVCache()
        k = mx.arange(2 * n * 4, dtype=mx.float32).reshape(1, 2, n, 4) + n
        c.update_and_fetch(k, -k)
        singles.append(c)
    batch = BatchKVCache.merge(singles)
    loaded = BatchKVCache.from_state(batch.state, batch.meta_state)
    assert loaded.lengths() == [3, 6]
    for b in range(2):
        same(loaded.extract(b).state, singles[b].state)


def test_merge_extract_filter_equal_solo_caches(tiny_model):
    solos, merged = merged_solos(tiny_model, PROMPTS)
    assert all(c.size() == len(PROMPTS) for c in merged)
    assert_rows_are(merged, solos)
    assert_filter_keeps_rows(merged, solos)


def test_merge_of_an_empty_recurrent_cache_is_the_zero_state():
    filled = RecurrentCache()
    filled.state = (mx.ones((1, 3, 8)), mx.ones((1, 2, 4, 4)))
    out = RecurrentCache.merge([RecurrentCache.empty(2), filled])
    assert out.size() == 3
    conv, ssm = out.state
    assert conv.shape == (3, 3, 8) and ssm.shape == (3, 2, 4, 4)
    assert not mx.any(conv[:2]).item() and mx.all(conv[2] == 1).item()
    assert RecurrentCache.merge([RecurrentCache.empty(2), RecurrentCache()]).size() == 3


@pytest.mark.parametrize("batched", [False, True])
def test_snapshot_restore_undoes_a_verify_pass(tiny_model, batched):
    cache = solo(tiny_model, PROMPTS[0])
    if batched:
        cache = [type(c).merge([c, d]) for c, d in zip(cache, solo(tiny_model, PROMPTS[1]))]
    B = len(cache[0].lengths()) if cache[0].is_trimmable() else cache[1].size()
    before = [a for a in cache_state_arrays(cache)]
    snap = snapshot_caches(cache)
    for c in cache:
        if hasattr(c, "prepare"):
            c.prepare(4)
    tiny_model.trunk(mx.array([[7, 8, 9, 10]] * B, mx.uint32), cache, capture=True)
    mx.eval(cache_state_arrays(cache))
    restore_caches(snap)
    same(cache_state_arrays(cache), before)
    # and decoding goes on as if the pass never ran
    fresh = solo(tiny_model, PROMPTS[0])
    if not batched:
        same([next_logits(tiny_model, cache, [[42]])], [next_logits(tiny_model, fresh, [[42]])])


def test_every_cache_kind_is_registered_by_importing_any_cache_module():
    """The session store imports ``kv`` alone: the package brings every kind in."""
    import subprocess
    import sys

    code = "from mlx_mtp.models.cache.kv import CACHE_KINDS; print(' '.join(sorted(CACHE_KINDS)))"
    kinds = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout.split()
    assert {"kv", "rec", "window_kv", "batch_window_kv", "chain", "index_kv",
            "batch_index_kv"} <= set(kinds)


def test_index_key_cache_keeps_its_kind_through_batch_surgery_and_ties_the_latents():
    from mlx_mtp.models.cache.index import BatchIndexKeyCache, IndexKeyCache

    rows, latents = [], []
    for n in (3, 5):
        c, latent = IndexKeyCache(), KVCache()
        k = mx.arange(n * 4, dtype=mx.float32).reshape(1, 1, n, 4) + n
        latent.update_and_fetch(k, k)
        assert c.update_keys(k, latent).shape == (1, 1, n, 4)
        assert not mx.any(c.values).item()
        rows.append(c)
        latents.append(latent)
    batch = type(rows[0]).merge(rows)
    assert isinstance(batch, BatchIndexKeyCache) and batch.kind == "batch_index_kv"
    loaded = BatchIndexKeyCache.from_state(batch.state, batch.meta_state)
    for b, single in enumerate(rows):
        out = loaded.extract(b)
        assert isinstance(out, IndexKeyCache) and out.offset == single.offset
        same(out.state, single.state)
    batch.filter([1])
    same(batch.extract(0).state, rows[1].state)
    batch.prepare(1)
    batch.update_keys(mx.ones((1, 1, 1, 4)), BatchKVCache.merge(latents[1:]))
    assert batch.lengths() == [6]
