"""The cache protocol on sliding-window caches (models/window_cache.py): save/load,
snapshot/restore and batch surgery give back exactly the state a sequence decoded alone
holds, also after old entries were dropped (``start`` > 0)."""

import mlx.core as mx
import pytest

from cache_checks import (assert_filter_keeps_rows, assert_rows_are, merged_solos, next_logits,
                          same, solo)

from mlx_mtp.models.cache import window as window_cache
from mlx_mtp.models.cache.kv import (CACHE_KINDS, KVCache, cache_state_arrays, restore_caches,
                                  snapshot_caches)
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.models.cache.window import BatchWindowKVCache, WindowKVCache
from mlx_mtp.testing.tiny_special import WINDOW, make_tiny_step3p5

# Buffers grow by 8 and keep 4 beyond the window (8): a single cache drops old entries
# once it holds 20, a batch row keeps its newest 12 when the buffer grows.
PROMPTS = [[(7 * i + 3) % 128 for i in range(29)],  # dropped alone: start 17
           [(5 * i + 1) % 128 for i in range(17)],  # 17 stored: a batch grow drops 5
           [1]]


@pytest.fixture(autouse=True)
def small_window_buffers(monkeypatch):
    monkeypatch.setattr(WindowKVCache, "step", 8)
    monkeypatch.setattr(BatchWindowKVCache, "step", 8)
    monkeypatch.setattr(window_cache, "ROLLBACK_MARGIN", 4)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_step3p5(tmp_path_factory.mktemp("step3p5")))[0]


def windows(cache):
    return [c for c in cache if isinstance(c, (WindowKVCache, BatchWindowKVCache))]


def test_window_kinds_are_registered_for_loading():
    assert CACHE_KINDS["window_kv"] is WindowKVCache
    assert CACHE_KINDS["batch_window_kv"] is BatchWindowKVCache


def test_state_round_trip_keeps_the_window_and_continues_exactly(model):
    cache = solo(model, PROMPTS[0])
    assert {c.kind for c in cache} == {"kv", "window_kv"}
    assert all(int(c.meta_state[1]) == 17 for c in windows(cache))  # old entries dropped
    loaded = [CACHE_KINDS[c.kind].from_state(c.state, c.meta_state) for c in cache]
    assert [type(c) for c in loaded] == [type(c) for c in cache]
    assert [c.meta_state for c in loaded] == [c.meta_state for c in cache]
    same(cache_state_arrays(loaded), cache_state_arrays(cache))
    same([next_logits(model, loaded, [[42]])], [next_logits(model, cache, [[42]])])


def test_window_from_state_refuses_a_start_that_does_not_fit():
    k = mx.zeros((1, 2, 5, 4))
    assert WindowKVCache.from_state((k, k), ("12", "7", "8", "4")).lengths() == [12]
    with pytest.raises(ValueError, match="start"):
        WindowKVCache.from_state((k, k), ("12", "3", "8", "4"))
    with pytest.raises(ValueError, match="meta_state"):
        WindowKVCache.from_state((k, k), ("12",))  # a plain KV cache's meta
    empty = WindowKVCache.from_state(None, ("0", "0", "8", "4"))
    assert empty.arrays() == [] and empty.window == 8


def test_merge_extract_filter_equal_solo_caches(model):
    solos, merged = merged_solos(model, PROMPTS)
    assert {type(c) for c in windows(merged)} == {BatchWindowKVCache}
    assert all(c.size() == len(PROMPTS) for c in merged)
    assert_rows_are(merged, solos)
    for b, cache in enumerate(solos):  # rows come back with their window and start
        assert [c.extract(b).meta_state for c in merged] == [c.meta_state for c in cache]
    # a saved batch comes back with its window and rows
    loaded = [CACHE_KINDS[c.kind].from_state(c.state, c.meta_state) if c.kind.startswith(
        "batch_window") else c for c in merged]
    assert_rows_are(loaded, solos)
    assert_filter_keeps_rows(merged, solos)


def test_merged_rows_decode_as_each_alone(model):
    solos, merged = merged_solos(model, PROMPTS)
    for c in merged:
        c.prepare(1)
    batch = next_logits(model, merged, [[42]] * len(PROMPTS))
    for b, cache in enumerate(solos):
        want = next_logits(model, cache, [[42]])
        assert mx.allclose(batch[b : b + 1], want, atol=1e-5).item()


def test_windows_batch_only_with_windows_of_the_same_size():
    with pytest.raises(ValueError, match="same window"):
        WindowKVCache.merge([WindowKVCache(WINDOW), KVCache()])
    with pytest.raises(ValueError, match="same window"):
        WindowKVCache.merge([WindowKVCache(WINDOW), WindowKVCache(WINDOW + 1)])
    assert BatchWindowKVCache.empty(3, window=WINDOW).size() == 3
    with pytest.raises(ValueError, match="window"):
        WindowKVCache.empty(1)


@pytest.mark.parametrize("batched", [False, True])
def test_snapshot_restore_undoes_a_pass_that_dropped_old_entries(model, batched):
    """The pass drops old entries (alone: the write crosses 20 stored; batched: the
    buffer grows and row 1 keeps its newest 12); restore brings them all back."""
    prompts = PROMPTS if batched else PROMPTS[1:2]
    solos = [solo(model, p) for p in prompts]
    cache = [type(cs[0]).merge(list(cs)) for cs in zip(*solos)] if batched else solos[0]
    before = cache_state_arrays(cache)
    meta = [c.meta_state for c in cache]
    snap = snapshot_caches(cache)
    for c in cache:
        c.prepare(8)
    model.trunk(mx.array([list(range(8))] * len(prompts), mx.uint32), cache, capture=True)
    mx.eval(cache_state_arrays(cache))
    if batched:  # row 1: its newest 12 of 17 and the 8 new entries
        assert all(c.extract(1).state[0].shape[2] == 20 for c in windows(cache))
    else:
        assert all(int(c.meta_state[1]) == 13 for c in windows(cache))
    restore_caches(snap)
    same(cache_state_arrays(cache), before)
    assert [c.meta_state for c in cache] == meta
    if not batched:
        fresh = solo(model, prompts[0])
        same([next_logits(model, cache, [[42]])], [next_logits(model, fresh, [[42]])])
