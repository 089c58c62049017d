"""The server's memory budget (``serve --memory-budget``, ``server/memory_budget.py``) and the
cache protocol's ``nbytes`` it is accounted from.

``nbytes`` is checked against byte counts worked out from what each test wrote (shapes and
dtypes), for every cache kind after prefill, a verify pass and its rollback, and batch
merge/filter. The engine tests run a tiny checkpoint: a budget below what 8 concurrent
requests need finishes all of them with the tokens an unbudgeted engine gives, the cache
bytes the engine holds never pass the budget, and requests that can never fit (or wait too
long) get 429 with ``Retry-After``; the server test checks that 429 in each API's shape.
"""

import time

import httpx
import mlx.core as mx
import pytest

from cache_checks import solo
from engine_events import Sink, drive, make_engine
from mlx_mtp.decode.sequence import Sequence
from mlx_mtp.models.cache.chain import ChainCache
from mlx_mtp.models.cache.index import IndexKeyCache
from mlx_mtp.models.cache.kv import BatchKVCache, KVCache, cache_state_arrays
from mlx_mtp.models.cache.window import BatchWindowKVCache, WindowKVCache
from mlx_mtp.models.cache import window as window_cache
from mlx_mtp.models.io.loader import load, load_model
from mlx_mtp.server.events import Done, EngineRequest, Failed
from mlx_mtp.server.memory_budget import (MAX_WAIT_SECONDS, RETRY_AFTER_SECONDS, Footprint,
                                          MemoryBudget, OverBudget, parse_memory_budget)
from mlx_mtp.server.prefix_cache import PrefixCache
from mlx_mtp.testing.tiny import make_tiny
from mlx_mtp.testing.tiny_special import WINDOW, make_tiny_mimo_v2_flash

H, D = 2, 4  # heads and head width of the hand-written caches (float32: 4 bytes)


def kv_bytes(rows, positions, heads=H, width=D, itemsize=4):
    """Keys and values of ``rows`` rows of ``positions`` positions."""
    return 2 * rows * heads * positions * width * itemsize


def written(n, start=0, rows=1):
    k = mx.arange(rows * H * n * D, dtype=mx.float32).reshape(rows, H, n, D) + start
    return k, -k


def single(n):
    c = KVCache()
    c.update_and_fetch(*written(n))
    return c


# -- nbytes: every kind, by hand ---------------------------------------------------------
def test_kv_nbytes_after_prefill_verify_and_trim():
    c = single(5)
    assert c.nbytes == kv_bytes(1, 5) and c.row_nbytes == c.nbytes
    c.update_and_fetch(*written(4, 5))  # a verify pass of 4 positions
    assert c.nbytes == kv_bytes(1, 9)
    c.accept([2])  # two kept, two rolled back: the buffer stays, the state shrinks
    assert c.nbytes == kv_bytes(1, 7)
    c.trim(3)
    assert c.nbytes == kv_bytes(1, 4)
    assert KVCache().nbytes == 0


def test_batch_kv_nbytes_counts_the_padding_holes_and_row_masks():
    batch = BatchKVCache.merge([single(3), single(6)])
    # both rows are as long as the longest (left padding), plus a (B, L) bool mask
    assert batch.nbytes == kv_bytes(2, 6) + 2 * 6
    assert batch.row_nbytes == batch.nbytes // 2
    batch.prepare(3)
    batch.update_and_fetch(*written(3, rows=2))
    assert batch.nbytes == kv_bytes(2, 9) + 2 * 9
    batch.accept([1, 3])  # row 0 rejects two drafts: holes, held until the buffer grows
    assert batch.nbytes == kv_bytes(2, 9) + 2 * 9
    batch.filter([1])
    assert batch.nbytes == kv_bytes(1, 9) + 9
    assert BatchKVCache.empty(3).nbytes == 0


def test_window_nbytes_stays_bounded_and_follows_rollback():
    c = WindowKVCache(window=4, margin=2)
    c.update_and_fetch(*written(300))
    assert c.nbytes == kv_bytes(1, 6)  # old entries dropped: window + margin
    c.update_and_fetch(*written(2, 300))
    c.accept([1])
    assert c.nbytes == kv_bytes(1, 7)
    other = WindowKVCache(window=4, margin=2)
    other.update_and_fetch(*written(3))
    batch = WindowKVCache.merge([c, other])
    assert isinstance(batch, BatchWindowKVCache)
    assert batch.nbytes == kv_bytes(2, 7) + 2 * 7
    batch.filter([1])  # the longer row's leading columns (row 1's padding) are given back
    assert batch.nbytes == kv_bytes(1, 3) + 3


def test_a_window_caches_bound_is_the_most_it_holds(monkeypatch):
    """``max_positions`` is exact: a window cache, one row or a batch, holds at most that
    many positions and reaches it (buffers of 8: a short test)."""
    monkeypatch.setattr(WindowKVCache, "step", 8)
    monkeypatch.setattr(BatchWindowKVCache, "step", 8)
    monkeypatch.setattr(window_cache, "ROLLBACK_MARGIN", 4)
    c = WindowKVCache(window=4, margin=4)
    held = []
    for i in range(40):
        c.update_and_fetch(*written(1, i))
        held.append(c.state[0].shape[2])
    assert max(held) == c.max_positions()
    for width in (1, 3):  # plain steps reach it; verify passes of 3 stay within it
        batch = WindowKVCache.merge([c, WindowKVCache(window=4, margin=4)])
        held = []
        for i in range(20):
            batch.prepare(width)
            batch.update_and_fetch(*written(width, i, rows=2))
            held.append(batch.state[0].shape[2])
        bound = batch.max_positions()
        assert max(held) == bound if width == 1 else max(held) <= bound


def test_chain_nbytes_is_its_inner_cache_and_pending_inputs():
    width = 8
    c = ChainCache(single(5), mx.zeros((1, 1, width)), [True])
    assert c.nbytes == kv_bytes(1, 5) + width * 4
    bare = ChainCache(single(2))  # no pending input yet: its state's zero placeholder is not held
    assert bare.nbytes == kv_bytes(1, 2)
    batch = ChainCache.merge([c, bare])
    assert batch.nbytes == kv_bytes(2, 5) + 2 * 5 + 2 * width * 4
    batch.filter([0])
    assert batch.nbytes == kv_bytes(1, 5) + 5 + width * 4


def test_index_nbytes_counts_its_keys_and_placeholder_values():
    rows = []
    for n in (3, 5):
        c, latent = IndexKeyCache(), KVCache()
        k = mx.ones((1, 1, n, D))
        latent.update_and_fetch(k, k)
        c.update_keys(k, latent)
        assert c.nbytes == kv_bytes(1, n, heads=1)
        rows.append(c)
    batch = type(rows[0]).merge(rows)
    assert batch.nbytes == kv_bytes(2, 5, heads=1) + 2 * 5
    batch.filter([0])  # the 5-position row's leading columns (row 0's padding) are given back
    assert batch.nbytes == kv_bytes(1, 3, heads=1) + 3


def state_bytes(caches):
    return sum(a.size * a.dtype.size for a in cache_state_arrays(caches))


def test_model_caches_nbytes_after_prefill_verify_and_batch_surgery(tiny_model):
    """The tiny Qwen3.5's KV and recurrent caches, driven by the model itself."""
    args = tiny_model.text.args
    prompts = [[5, 9, 200, 31, 7, 64, 3], [11, 400]]
    caches = solo(tiny_model, prompts[0])
    kv = [c for c in caches if c.is_trimmable()]
    rec = [c for c in caches if not c.is_trimmable()]
    assert kv and rec
    item = kv[0].state[0].dtype.size
    one_kv = kv_bytes(1, 7, args.num_key_value_heads, args.head_dim, item)
    assert all(c.nbytes == one_kv for c in kv)
    for c in rec:  # a convolution window and an SSM state, whatever the length
        conv, ssm = c.state
        assert c.nbytes == conv.size * conv.dtype.size + ssm.size * ssm.dtype.size > 0
    batch = [type(a).merge([a, b]) for a, b in zip(caches, solo(tiny_model, prompts[1]))]
    for c in batch:
        c.prepare(4)
    tiny_model.trunk(mx.array([[7, 8, 9, 10]] * 2, mx.uint32), batch, capture=True)
    for c in batch:
        c.accept([1, 4])
    mx.eval(cache_state_arrays(batch))
    padded = kv_bytes(2, 11, args.num_key_value_heads, args.head_dim, item) + 2 * 11
    assert all(c.nbytes == padded for c in batch if c.is_trimmable())
    assert sum(c.nbytes for c in batch) == state_bytes(batch)
    for c in batch:
        c.filter([1])
    # row 1 (2 + 4 positions) keeps its 6 columns; the 5 it was padded by beside row 0 go
    kept = kv_bytes(1, 6, args.num_key_value_heads, args.head_dim, item) + 6
    assert all(c.nbytes == kept for c in batch if c.is_trimmable())
    assert sum(c.nbytes for c in batch) == state_bytes(batch)
    assert sum(c.nbytes for c in rec) == sum(c.nbytes for c in batch if not c.is_trimmable())


def test_footprint_predicts_a_longer_sequence(tiny_model):
    """Measured on 4 and 8 tokens, it gives the bytes a 50-token sequence's batch caches hold."""
    fp = Footprint.measure(tiny_model)
    assert not fp.bounded and fp.row_bytes(50) == held_after(tiny_model, 50)


def held_after(model, n):
    """Bytes a sequence's caches hold after ``n`` tokens, in their batch form (one row)."""
    seq = Sequence(model, 1, adaptive=False)
    seq.prefill(list(range(n + 1)))
    return (sum(type(c).merge([c]).nbytes for c in seq.cache + seq.mtp_cache)
            + sum(h.nbytes for h in seq.owed.hidden))


def test_footprint_bounds_sliding_window_layers(tmp_path, monkeypatch):
    """MiMo-V2-Flash's window layers hold at most ``max_positions``: a long sequence is
    counted at that, not as if every layer grew (buffers of 8 so the test stays short)."""
    monkeypatch.setattr(WindowKVCache, "step", 8)
    monkeypatch.setattr(BatchWindowKVCache, "step", 8)
    monkeypatch.setattr(window_cache, "ROLLBACK_MARGIN", 4)
    model = load_model(make_tiny_mimo_v2_flash(tmp_path / "mimo", "noisy"))[0]
    fp = Footprint.measure(model)
    keys = model.text.window  # what a window layer attends to (W + 1 for MiMo-V2-Flash)
    assert fp.bounded and all(cap == keys + 4 + 8 for _, cap in fp.bounded)  # a step of room
    assert fp.row_bytes(6) == held_after(model, 6)  # within the windows: exact
    n = 12 * WINDOW
    assert held_after(model, n) <= fp.row_bytes(n)
    as_if_growing = fp.per_sequence + (fp.per_token + sum(b for b, _ in fp.bounded)) * n
    assert fp.row_bytes(n) < as_if_growing


def test_parse_memory_budget():
    assert parse_memory_budget("12") == 12 << 30
    assert parse_memory_budget("512M") == 512 << 20
    assert 0 < parse_memory_budget("0.5") < parse_memory_budget("1")
    for bad in ("0", "-3", "lots", "nan", "inf", "2X"):
        with pytest.raises(ValueError, match="--memory-budget"):
            parse_memory_budget(bad)


def test_serve_flag_and_its_bad_values(capsys):
    import argparse

    from mlx_mtp.options import UserError
    from mlx_mtp.server.main import _check_args, add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["--memory-budget", "512M"]).memory_budget == 512 << 20
    assert p.parse_args([]).memory_budget is None  # no budget: today's behaviour
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--memory-budget", "lots"])
    assert e.value.code == 2 and "--memory-budget takes GB" in capsys.readouterr().err
    with pytest.raises(UserError, match="--memory-budget needs a single process"):
        _check_args(p.parse_args(["--memory-budget", "8", "--distributed", "pipeline"]))
    assert p.parse_args(["--memory-budget-wait", "900"]).memory_budget_wait == 900.0
    assert p.parse_args([]).memory_budget_wait == MAX_WAIT_SECONDS
    for bad in ("0", "-5", "inf", "soon"):
        with pytest.raises(SystemExit) as e:
            p.parse_args(["--memory-budget-wait", bad])
        assert e.value.code == 2 and "not a positive number of seconds" in capsys.readouterr().err


def test_an_engine_429_carries_retry_after_to_the_response():
    from mlx_mtp.server.choices import failed_error

    err = failed_error(OverBudget("full", retry_after=7).event())
    assert (err.status, err.code, err.headers) == (429, "memory_budget_exceeded",
                                                   {"Retry-After": "7"})
    assert err.body()["error"]["type"] == "rate_limit_error"
    assert failed_error(Failed(500, "boom")).headers == {}


# -- the engine --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny(tmp_path_factory.mktemp("budget") / "ckpt", "qwen3_5", "noisy",
                     vocab_size=4096, trunk_scale=2.0, fc_noise=1.0)
    return load(str(path))


def prompts(n, length=24):
    return [[(37 * i + 11 * j) % 4000 + 20 for j in range(length)] for i in range(n)]


def held(engine) -> int:
    """Cache bytes the engine holds now, counted from its caches (not from its account)."""
    caches = list(engine.batch.cache or []) + list(engine.batch.mtp_cache or [])
    prefilling = [c for s in engine.running if s.prefilling
                  for c in s.dec.cache + (s.dec.mtp_cache or [])]
    return sum(c.nbytes for c in caches + prefilling) + engine.prefix_cache.nbytes


def submit_all(engine, ps, max_tokens, **kw):
    sinks = [Sink() for _ in ps]
    for p, s in zip(ps, sinks):
        engine.submit(EngineRequest(prompt=list(p), max_tokens=max_tokens, on_event=s, **kw))
    return sinks


def test_a_budget_below_eight_requests_queues_them_and_finishes_all(tiny):
    ps, max_tokens = prompts(8), 40
    unbudgeted = make_engine(tiny, max_concurrency=8)
    free = [s.tokens for s in drive(unbudgeted, submit_all(unbudgeted, ps, max_tokens))]
    fp = Footprint.measure(tiny[0])
    budget = MemoryBudget(3 * fp.row_bytes(24 + max_tokens + 4 + 256) + 1000, footprint=fp)
    eng = make_engine(tiny, max_concurrency=8, memory=budget)
    sinks = submit_all(eng, ps, max_tokens)
    peak_rows, peak_held = 0, 0
    for _ in range(5000):
        if all(s.done is not None for s in sinks):
            break
        eng.step()
        peak_rows = max(peak_rows, eng.num_running)
        peak_held = max(peak_held, held(eng))
        assert held(eng) <= budget.reserved + eng.prefix_cache.nbytes
        assert budget.reserved + eng.prefix_cache.nbytes <= 1.05 * budget.limit
    assert all(isinstance(s.done, Done) for s in sinks), [s.done for s in sinks]
    assert [s.tokens for s in sinks] == free  # none lost, greedy output unchanged
    assert peak_rows == 3 and 0 < peak_held <= budget.limit
    assert eng.metrics.memory_budget.get() == budget.limit
    assert eng.metrics.request_failure.get(reason="error") == 0


def test_the_prefix_cache_gives_back_room_before_a_request_waits(tiny):
    fp = Footprint.measure(tiny[0])
    row = fp.row_bytes(40 + 4 + 4 + 256)
    pc = PrefixCache(32, 1 << 30)
    eng = make_engine(tiny, prefix_cache=pc, memory=MemoryBudget(2 * row + 50_000, footprint=fp))
    sinks = []
    for p in prompts(4, length=40):  # one at a time, each leaving prompt-prefix entries
        sinks += submit_all(eng, [p], 4, boundaries=[10, 20, 30, 39])
        drive(eng, sinks)
    assert all(isinstance(s.done, Done) for s in sinks)
    stored = list(pc.entries)
    assert pc.nbytes > 50_000 and eng.memory.reserved + pc.nbytes <= eng.memory.limit
    late = submit_all(eng, [p[::-1] for p in prompts(2, length=40)], 4)
    eng.step()
    assert eng.num_running == 2  # both admitted at once: the entries made room
    kept = list(pc.entries)
    assert len(kept) < len(stored) and kept == stored[len(stored) - len(kept):]  # LRU out
    assert eng.memory.reserved + pc.nbytes <= eng.memory.limit
    drive(eng, late)
    assert all(isinstance(s.done, Done) for s in late)


def test_a_request_that_can_never_fit_gets_429_at_once(tiny):
    fp = Footprint.measure(tiny[0])
    eng = make_engine(tiny, memory=MemoryBudget(fp.row_bytes(300)))  # footprint: not yet known
    big = Sink()
    eng.submit(EngineRequest(prompt=prompts(1)[0], max_tokens=400, on_event=big))
    drive(eng, [big])  # the first iteration measures the footprint and refuses it
    assert eng.memory.footprint == fp
    assert isinstance(big.done, Failed) and big.done.status == 429
    assert big.done.code == "memory_budget_exceeded" and big.done.retry_after > 0
    assert not big.tokens and eng.num_running == eng.num_waiting == 0
    assert eng.metrics.request_failure.get(reason="memory_budget") == 1
    with pytest.raises(OverBudget, match="whole memory budget") as e:  # now at submit
        eng.submit(EngineRequest(prompt=prompts(1)[0], max_tokens=400))
    assert e.value.retry_after > 0 and eng.num_waiting == 0
    fits = Sink()
    eng.submit(EngineRequest(prompt=prompts(1)[0], max_tokens=8, on_event=fits))
    drive(eng, [fits])
    assert isinstance(fits.done, Done)


def test_a_request_that_waits_too_long_gets_429_and_the_running_one_finishes(tiny):
    fp = Footprint.measure(tiny[0])
    max_tokens = 60
    budget = MemoryBudget(fp.row_bytes(24 + max_tokens + 4 + 256) + 100, max_wait=0.2,
                          footprint=fp)
    eng = make_engine(tiny, memory=budget)
    first, second = submit_all(eng, prompts(2), max_tokens)
    eng.step()
    assert eng.num_running == 1 and eng.num_waiting == 1
    time.sleep(0.3)
    drive(eng, [first, second])
    assert isinstance(first.done, Done) and first.done.usage["completion_tokens"] == max_tokens
    assert isinstance(second.done, Failed) and second.done.status == 429
    assert second.done.retry_after == RETRY_AFTER_SECONDS and not second.tokens


# -- the server --------------------------------------------------------------------------
@pytest.mark.slow
def test_server_answers_429_with_retry_after_in_each_apis_shape(tiny_ckpt, tmp_path):
    from server_process import ServerProcess

    ckpt = tiny_ckpt("qwen3_5", "noisy", vocab_size=4096, trunk_scale=2.0, fc_noise=1.0)
    srv = ServerProcess(ckpt, tmp_path, "--max-kv-size", "4096", "--memory-budget", "1M")
    try:
        model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        msg = [{"role": "user", "content": "Hi"}]
        ok = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                        json={"model": model, "messages": msg, "max_tokens": 4})
        assert ok.status_code == 200, ok.text
        calls = {"/v1/chat/completions": {"model": model, "messages": msg, "max_tokens": 3000},
                 "/v1/messages": {"model": model, "messages": msg, "max_tokens": 3000},
                 "/v1/responses": {"model": model, "input": "Hi", "max_output_tokens": 3000}}
        for path, body in calls.items():
            r = httpx.post(srv.url + path, json=body, timeout=60)
            assert r.status_code == 429, (path, r.text)
            assert int(r.headers["retry-after"]) > 0
            err = r.json()
            if path == "/v1/messages":
                assert err["type"] == "error" and err["error"]["type"] == "rate_limit_error"
                assert "memory budget" in err["error"]["message"]
            else:
                assert err["error"]["type"] == "rate_limit_error"
                assert err["error"]["code"] == "memory_budget_exceeded"
        gauges = {line.split("{")[0]: float(line.split()[-1])
                  for line in httpx.get(srv.url + "/metrics").text.splitlines()
                  if line.startswith("mlx_mtp:memory_")}
        assert gauges["mlx_mtp:memory_budget_bytes"] == 1 << 20
        assert set(gauges) == {"mlx_mtp:memory_budget_bytes", "mlx_mtp:memory_sequences_bytes",
                               "mlx_mtp:memory_reserved_bytes",
                               "mlx_mtp:memory_prefix_cache_bytes"}
        assert gauges["mlx_mtp:memory_prefix_cache_bytes"] > 0  # the first chat's prompt
    finally:
        assert srv.stop() == 0, srv.logs()
