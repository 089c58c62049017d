"""The scheduler in-process (no HTTP): batching, chunked prefill, prefix cache, failures."""

import time

import pytest

from engine_events import Sink, drive, make_engine
from mlx_mtp.models.io.loader import load
from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.server.events import Delta, Done, EngineRequest, Failed
from mlx_mtp.server.prefix_cache import PrefixCache
from mlx_mtp.testing.tiny import make_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # trunk_scale=2 makes the output depend on the context; the noisy head
    # accepts about half of the drafts.
    path = make_tiny(tmp_path_factory.mktemp("engine") / "ckpt", "qwen3_5", "noisy",
                     vocab_size=4096, trunk_scale=2.0, fc_noise=1.0)
    return load(str(path))


def request(prompt, max_tokens=16, **kw):
    sink = Sink()
    return EngineRequest(prompt=list(prompt), max_tokens=max_tokens, on_event=sink, **kw), sink


def prompts(n, length=24):
    return [[(37 * i + 11 * j) % 4000 + 20 for j in range(length)] for i in range(n)]


def run_alone(tiny, prompt, **kw):
    eng = make_engine(tiny, **kw)
    req, sink = request(prompt)
    eng.submit(req)
    drive(eng, [sink])
    return sink


def test_batched_equals_alone_and_mtp_accepts(tiny):
    ps = prompts(6)
    alone = [run_alone(tiny, p).tokens for p in ps]
    eng = make_engine(tiny, max_concurrency=16)
    sinks = []
    for p in ps:
        req, sink = request(p)
        eng.submit(req)
        sinks.append(sink)
    drive(eng, sinks)
    assert [s.tokens for s in sinks] == alone
    assert all(isinstance(s.done, Done) and s.done.usage["completion_tokens"] == 16
               for s in sinks)
    assert sum(s.done.mtp["num_accepted_tokens"] for s in sinks) > 0
    assert eng.metrics.spec_accepted.get() > 0
    assert eng.num_running == 0


def test_max_concurrency_bounds_the_batch(tiny):
    eng = make_engine(tiny, max_concurrency=2)
    sinks = []
    for p in prompts(5):
        req, sink = request(p, max_tokens=6)
        eng.submit(req)
        sinks.append(sink)
    peak = 0
    for _ in range(2000):
        if all(s.done for s in sinks):
            break
        eng.step()
        peak = max(peak, eng.num_running)
        assert eng.num_running <= 2
    assert peak == 2 and all(isinstance(s.done, Done) for s in sinks)


def test_long_prompt_is_chunked_and_does_not_stall_streams(tiny):
    eng = make_engine(tiny, prefill_step_size=32)
    short, s_sink = request(prompts(1)[0], max_tokens=40)
    eng.submit(short)
    for _ in range(3):
        eng.step()
    assert s_sink.tokens  # decoding
    long_prompt = [(7 * j) % 3000 + 50 for j in range(400)]
    lreq, l_sink = request(long_prompt, max_tokens=4)
    eng.submit(lreq)
    during = 0
    while l_sink.done is None:
        before = len(s_sink.tokens)
        eng.step()
        seq = next((s for s in eng.running if s.req is lreq), None)
        if seq is not None and seq.prefilling:
            during += len(s_sink.tokens) > before
    # ~13 chunks of 32 tokens: the short request kept producing meanwhile
    assert during >= 8
    assert isinstance(l_sink.done, Done)
    # chunked prefill gives the same tokens as one-shot prefill
    assert l_sink.tokens == run_alone(tiny, long_prompt, prefill_step_size=4096).tokens[:4]


def test_prompt_work_per_step_is_bounded_while_streams_decode(tiny):
    # Defaults: prompt chunks of up to 512 tokens, a step budget of 128 tokens.
    eng = make_engine(tiny, calibrate=False)
    running, r_sink = request(prompts(1)[0], max_tokens=3000)  # outlasts the prefill
    eng.submit(running)
    while not r_sink.tokens:
        eng.step()
    long_prompt = [(7 * j) % 3000 + 50 for j in range(1500)]
    lreq, l_sink = request(long_prompt, max_tokens=4)
    eng.submit(lreq)
    eng.step()
    lseq = next(s for s in eng.running if s.req is lreq)
    late, late_sink = request(prompts(2)[1], max_tokens=4)  # arrives during the prefill
    eng.submit(late)
    chunks, steps_with_tokens, late_done_during_prefill = [], 0, False
    while lseq.prefilling:
        before, n_before = lseq.dec.n_processed, len(r_sink.tokens)
        eng.step()
        chunks.append(lseq.dec.n_processed - before)
        steps_with_tokens += len(r_sink.tokens) > n_before
        late_done_during_prefill |= late_sink.done is not None
    # Each step ran at most the budget of prompt tokens and one decode step for the
    # running stream (before: a whole 512-token chunk per step).
    assert 0 < max(chunks) <= eng.max_batched_tokens
    assert steps_with_tokens == len(chunks)
    # The short prompt went first: it finished while the long one was still in prefill.
    assert late_done_during_prefill and isinstance(late_sink.done, Done)
    drive(eng, [l_sink])
    # Output does not depend on the chunking.
    assert l_sink.tokens == run_alone(tiny, long_prompt, prefill_step_size=4096).tokens[:4]


def test_prefix_cache_reuse_gives_same_output(tiny):
    pc = PrefixCache(max_entries=8, max_bytes=1 << 30)
    eng = make_engine(tiny, prefix_cache=pc)
    p = prompts(1, 40)[0]
    r1, s1 = request(p, boundaries=[20, 39])
    eng.submit(r1)
    drive(eng, [s1])
    assert s1.done.usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert len(pc) == 2
    # same prompt: everything but the last token comes from the cache
    r2, s2 = request(p)
    eng.submit(r2)
    drive(eng, [s2])
    assert s2.done.usage["prompt_tokens_details"]["cached_tokens"] == 39
    assert s2.done.timings["cache_n"] == 39 and s2.done.timings["prompt_n"] == 1
    assert s2.tokens == s1.tokens
    # a longer prompt sharing the first 21 tokens restores the boundary-20 state
    p3 = p[:21] + [5, 6, 7, 8, 9]
    r3, s3 = request(p3)
    eng.submit(r3)
    drive(eng, [s3])
    assert s3.done.usage["prompt_tokens_details"]["cached_tokens"] == 20
    assert s3.tokens == run_alone(tiny, p3).tokens
    # cache_prompt=False neither reads nor writes
    r4, s4 = request(p, cache_prompt=False)
    eng.submit(r4)
    drive(eng, [s4])
    assert s4.done.usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert eng.metrics.prefix_cache_hits.get() == 39 + 20


def test_failure_in_one_request_fails_only_that_one(tiny):
    ps = prompts(3)
    alone = [run_alone(tiny, p).tokens for p in ps]
    eng = make_engine(tiny)
    # The victim samples differently, so its filter is its own work (rows sampling
    # alike share one call).
    reqs = [request(p, sampling=SamplingParams(temperature=0.5, seed=1) if i == 1 else
                    SamplingParams()) for i, p in enumerate(ps)]
    for r, _ in reqs:
        eng.submit(r)
    eng.step()
    drive_until = lambda: len(eng.batch) == 3  # noqa: E731 - all three decoding together
    while not drive_until():
        eng.step()
    victim = next(r for r in eng.batch.rows if r.key == reqs[1][0].request_id)

    def boom(*a, **k):
        raise MemoryError("[malloc] Unable to allocate 1099511627776 bytes")

    victim.sampler.filter = boom
    drive(eng, [s for _, s in reqs])
    failed = reqs[1][1].done
    assert isinstance(failed, Failed) and failed.status == 500 and failed.code == "out_of_memory"
    assert reqs[0][1].tokens == alone[0] and reqs[2][1].tokens == alone[2]
    assert eng.metrics.request_failure.get(reason="error") == 1
    # still serving
    r, s = request(ps[1])
    eng.submit(r)
    drive(eng, [s])
    assert s.tokens == alone[1]


def test_cancel_frees_the_slot(tiny):
    eng = make_engine(tiny)
    r, s = request(prompts(1)[0], max_tokens=1000)
    eng.submit(r)
    for _ in range(3):
        eng.step()
    assert eng.num_running == 1
    eng.cancel(r)
    eng.step()
    assert eng.num_running == 0 and s.done is None
    assert eng.metrics.request_failure.get(reason="abort") == 1
    # a cancelled waiting request is never admitted
    r2, s2 = request(prompts(1)[0])
    eng.submit(r2)
    eng.cancel(r2)
    eng.step()
    assert eng.num_running == 0 and eng.num_waiting == 0


def test_stop_strings_and_eos(tiny):
    model, tok = tiny
    p = prompts(1)[0]
    full = run_alone(tiny, p)
    text = full.text
    stop = text[5:9]
    assert stop and text.find(stop) >= 0
    eng = make_engine(tiny)
    r, s = request(p, stop=[stop, "never-appears"])
    eng.submit(r)
    drive(eng, [s])
    assert s.done.finish_reason == "stop"
    assert s.text == text[: text.find(stop)]
    # eos ends a request with "stop"; force it by making eos the next greedy token
    eng2 = make_engine(tiny)
    eng2.eos = {full.tokens[3]}
    r2, s2 = request(p)
    eng2.submit(r2)
    drive(eng2, [s2])
    assert s2.done.finish_reason == "stop" and s2.done.usage["completion_tokens"] == 4


def test_seeded_sampling_is_reproducible_in_a_batch(tiny):
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    p = prompts(1)[0]
    eng = make_engine(tiny)
    r, s = request(p, sampling=sp)
    eng.submit(r)
    drive(eng, [s])
    eng = make_engine(tiny)
    pairs = [request(q, sampling=sp if i == 2 else SamplingParams()) for i, q in
             enumerate([prompts(4)[1], prompts(4)[2], p, prompts(4)[3]])]
    for req, _ in pairs:
        eng.submit(req)
    drive(eng, [x for _, x in pairs])
    assert pairs[2][1].tokens == s.tokens


def test_logprobs(tiny):
    eng = make_engine(tiny)
    r, s = request(prompts(1)[0], max_tokens=5, logprobs=3)
    eng.submit(r)
    drive(eng, [s])
    lps = [x for e in s.events if isinstance(e, Delta) for x in e.logprobs]
    assert [x.token_id for x in lps] == s.tokens
    for x in lps:
        assert x.logprob <= 0 and len(x.top) == 3
        assert x.top[0].logprob >= x.logprob - 1e-5  # greedy: chosen is the top-1
        assert x.top[0].token_id == x.token_id


def test_threaded_engine_and_shutdown(tiny):
    eng = make_engine(tiny)
    eng.start()
    sink = Sink()
    eng.submit(EngineRequest(prompt=prompts(1)[0], max_tokens=8, on_event=sink))
    assert sink.ended.wait(30) and isinstance(sink.done, Done)
    # a long request is running when the engine shuts down: it fails with 503
    sink2 = Sink()
    eng.submit(EngineRequest(prompt=prompts(1)[0], max_tokens=3000, on_event=sink2))
    t0 = time.time()
    while not sink2.tokens and time.time() - t0 < 30:
        time.sleep(0.01)
    eng.shutdown()
    assert sink2.ended.wait(10) and isinstance(sink2.done, Failed) and sink2.done.status == 503
    assert not eng.alive
    with pytest.raises(RuntimeError):
        eng.submit(EngineRequest(prompt=[1, 2], max_tokens=1))


def test_scheduler_failure_fails_the_batch_and_empties_it(tiny):
    """A bug outside per-request work fails every running request with a 500; their rows
    leave the batch, and the next requests decode exactly as on a fresh engine."""
    ps = prompts(3)
    alone = [run_alone(tiny, p).tokens for p in ps]
    eng = make_engine(tiny)
    reqs = [request(p, max_tokens=64) for p in ps[:2]]
    for r, _ in reqs:
        eng.submit(r)
    while len(eng.batch) < 2:
        eng.step()
    real = eng.batch.step

    def boom(*a, **k):
        raise RuntimeError("a bug in the step")

    eng.batch.step = boom
    eng.start()  # the thread's handler catches the failure and fails the batch
    try:
        for _, sink in reqs:
            for _ in range(500):
                if sink.done is not None:
                    break
                time.sleep(0.01)
            assert isinstance(sink.done, Failed) and sink.done.status == 500
        assert len(eng.batch) == 0 and not eng.running
        eng.batch.step = real
        r, sink = request(ps[2])
        eng.submit(r)
        assert sink.ended.wait(60) and isinstance(sink.done, Done)
        assert sink.tokens == alone[2]
    finally:
        eng.shutdown()
