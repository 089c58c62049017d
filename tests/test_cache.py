"""Cache operations on their own: a verify write followed by ``accept`` equals a plain
decode of the kept tokens, row by row, and holes never leak into attention."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_mtp.models.cache.kv import BatchKVCache, KVCache

H, D = 2, 4


def kv(rng, n, B=1):
    """Distinct keys/values (B, H, n, D) so any misplaced slot shows."""
    k = mx.array(rng.standard_normal((B, H, n, D)).astype(np.float32))
    return k, k + 100.0


def plain(chunks):
    """A single-row cache fed ``chunks`` [(k, v)] one token at a time (a plain decode)."""
    c = KVCache()
    for k, v in chunks:
        for t in range(k.shape[2]):
            c.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
    return c


def assert_same(a, b):
    assert a[0].shape == b[0].shape
    assert mx.array_equal(a[0], b[0]).item() and mx.array_equal(a[1], b[1]).item()


@pytest.mark.parametrize("n_keep", [1, 2, 4])
def test_kv_accept_keeps_exactly_the_plain_decode_of_the_kept_tokens(n_keep):
    rng = np.random.default_rng(n_keep)
    prefix, verify, after = kv(rng, 5), kv(rng, 4), kv(rng, 2)
    c = KVCache()
    c.update_and_fetch(*prefix)
    c.update_and_fetch(*verify)
    c.accept([n_keep])
    kept = (verify[0][:, :, :n_keep], verify[1][:, :, :n_keep])
    assert c.offset == 5 + n_keep
    assert_same(c.state, plain([prefix, kept]).state)
    c.update_and_fetch(*after)  # the next write lands right after the kept tokens
    assert_same(c.state, plain([prefix, kept, after]).state)


def test_kv_cache_rejects_a_padded_chunk():
    c = KVCache()
    c.prepare(3, [3])
    with pytest.raises(ValueError, match="single-row"):
        c.prepare(3, [2])


def test_batch_accept_gives_each_row_its_own_plain_decode():
    rng = np.random.default_rng(0)
    prefixes = [kv(rng, n) for n in (3, 7, 1)]
    singles = []
    for k, v in prefixes:
        s = KVCache()
        s.update_and_fetch(k, v)
        singles.append(s)
    batch = BatchKVCache.from_single(singles)
    history = [[p] for p in prefixes]
    for n_keep in ([1, 4, 2], [4, 4, 4], [3, 1, 1]):
        k, v = kv(rng, 4, B=3)
        batch.prepare(4)
        batch.update_and_fetch(k, v)
        batch.accept(n_keep)
        for b, n in enumerate(n_keep):
            history[b].append((k[b : b + 1, :, :n], v[b : b + 1, :, :n]))
    for b in range(3):
        ref = plain(history[b])
        assert_same(batch.row_state(b), ref.state)
        assert batch.pos[b] == ref.offset


def test_batch_trim_drops_every_rows_last_tokens():
    rng = np.random.default_rng(1)
    batch = BatchKVCache([0, 0])
    k, v = kv(rng, 3, B=2)
    batch.prepare(3)
    batch.update_and_fetch(k, v)
    for _ in range(2):  # chained single-token writes, as drafting makes
        k1, v1 = kv(rng, 1, B=2)
        batch.prepare(1)
        batch.update_and_fetch(k1, v1)
    assert batch.trim(2) == 2
    assert batch.pos == [3, 3]
    for b in range(2):
        assert_same(batch.row_state(b), (k[b : b + 1], v[b : b + 1]))


def test_holes_and_padding_do_not_change_attention():
    """A row's attention over the batch buffer (holes, left padding, masked) equals
    attention over its compact plain-decode cache."""
    rng = np.random.default_rng(2)
    singles = []
    for n in (2, 6):
        s = KVCache()
        s.update_and_fetch(*kv(rng, n))
        singles.append(s)
    batch = BatchKVCache.from_single(singles)
    history = [[singles[0].state], [singles[1].state]]
    k, v = kv(rng, 3, B=2)
    batch.prepare(3)
    batch.update_and_fetch(k, v)
    batch.accept([1, 3])
    history[0].append((k[0:1, :, :1], v[0:1, :, :1]))
    history[1].append((k[1:2], v[1:2]))
    q = mx.array(rng.standard_normal((2, H, 1, D)).astype(np.float32))
    kn, vn = kv(rng, 1, B=2)
    batch.prepare(1)
    mask = batch.make_mask(1)
    keys, values = batch.update_and_fetch(kn, vn)
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=1.0, mask=mask)
    for b in range(2):
        ref = plain(history[b] + [(kn[b : b + 1], vn[b : b + 1])])
        rk, rv = ref.state
        want = mx.fast.scaled_dot_product_attention(q[b : b + 1], rk, rv, scale=1.0)
        assert mx.allclose(out[b : b + 1], want, atol=1e-5).item()


def test_growth_squeezes_holes_and_keeps_order():
    c = BatchKVCache([0, 0])
    c.step = 8
    for i in range(12):
        c.prepare(2)
        k = mx.full((2, 1, 2, 4), float(i))
        c.update_and_fetch(k, k)
        c.accept([1, 2])  # row 0 keeps one of every two tokens
    k0, _ = c.row_state(0)
    k1, _ = c.row_state(1)
    assert k0.shape[2] == 12 and k1.shape[2] == 24
    assert k0[0, 0, :, 0].tolist() == [float(i) for i in range(12)]
    assert c.pos == [12, 24]


def test_filter_and_extend_keep_rows_intact():
    rng = np.random.default_rng(3)
    singles = []
    for n in (4, 2, 5):
        s = KVCache()
        s.update_and_fetch(*kv(rng, n))
        singles.append(s)
    batch = BatchKVCache.from_single(singles[:2])
    batch.extend(BatchKVCache.from_single(singles[2:]))
    batch.filter([2, 0])
    assert batch.pos == [5, 4]
    assert_same(batch.row_state(0), singles[2].state)
    assert_same(batch.row_state(1), singles[0].state)
