"""serve --prompt-cache-dir: prompt-prefix states on disk survive a restart and restore exactly.

A restored turn decodes as a cold one (tokens and every cache array), on the dense, MoE
and Qwen3-Next tiny families with MTP on; a restarted server process serves a
conversation from disk with a cold server's output; the directory stays within its
size bound (least recently used out), ignores crashed/truncated writes and other
models' entries.
"""

import os
import signal
import time

import mlx.core as mx
import openai
import pytest

from engine_events import make_engine, run as run_all
from mlx_mtp.decode.speculative import MTPDecoder
from mlx_mtp.models.cache.kv import cache_state_arrays
from mlx_mtp.models.io.loader import load
from mlx_mtp.server.prefix_cache import PrefixCache
from mlx_mtp.server.session_store import SUFFIX, SessionStore, model_fingerprint
from mlx_mtp.testing.tiny import FAMILIES, make_tiny
from server_process import ServerProcess


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("disk-cache")
    # trunk_scale=2: output depends on the context; the noisy head accepts some drafts.
    return {f: make_tiny(root / f, f, "noisy", vocab_size=4096, trunk_scale=2.0, fc_noise=1.0)
            for f in FAMILIES}


@pytest.fixture(scope="module")
def models(ckpts):
    return {f: load(str(p)) for f, p in ckpts.items()}


def run(engine, prompt, **kw):
    return run_all(engine, [prompt], limit=2000, **kw)[0]


def engine(model_tok, k=2, prefix_cache=None):
    return make_engine(model_tok, num_draft_tokens=k, adaptive=False, prefix_cache=prefix_cache,
                       prefill_step_size=64)


def prompt_of(n, seed=0):
    return [(37 * j + 101 * seed) % 4000 + 20 for j in range(n)]


def state_arrays(state):
    out = cache_state_arrays(state.cache) + cache_state_arrays(state.mtp_cache or [])
    out += state.owed.hidden + state.owed.tokens
    return out + ([state.last_hidden] if state.last_hidden is not None else [])


def assert_states_equal(a, b):
    assert a.n_processed == b.n_processed
    assert [c.offset for c in a.cache] == [c.offset for c in b.cache]
    assert [c.offset for c in a.mtp_cache] == [c.offset for c in b.mtp_cache]
    xs, ys = state_arrays(a), state_arrays(b)
    assert len(xs) == len(ys) > 0
    for x, y in zip(xs, ys):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert mx.array_equal(x, y).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_restored_turn_decodes_exactly_as_a_cold_one(models, family, tmp_path):
    model = models[family][0]
    fp = model_fingerprint(model)
    prompt = prompt_of(96)
    longer = prompt + prompt_of(13, seed=1)
    # First "process": prefill with boundaries, states go to memory and disk.
    pc = PrefixCache(8, 1 << 30, disk=SessionStore(tmp_path, fp, min_tokens=16))
    run(engine(models[family], prefix_cache=pc), prompt, boundaries=[40, 95])
    pc.disk.flush()
    assert len(pc.disk) == 2 and len(list(tmp_path.glob("*" + SUFFIX))) == 2
    fresh = pc.entries[tuple(prompt)].state
    assert fresh.mtp_cache[0].offset > 0  # the head saw the prompt: MTP state matters

    # "Restart": a new store on the same directory, nothing in memory.
    key, restored = SessionStore(tmp_path, fp, min_tokens=16).lookup(longer, need_mtp=True)
    assert key == tuple(prompt)
    assert_states_equal(restored, fresh)

    pc2 = PrefixCache(8, 1 << 30, disk=SessionStore(tmp_path, fp, min_tokens=16))
    eng = engine(models[family], prefix_cache=pc2)
    warm = run(eng, longer)
    assert warm.done.usage["prompt_tokens_details"]["cached_tokens"] == 95
    assert pc2.disk.hits == 1
    cold = run(engine(models[family]), longer)
    plain = run(engine(models[family], k=0), longer)
    assert warm.tokens == cold.tokens == plain.tokens
    # The restored state now lives in memory too: the next turn does not read the disk.
    run(eng, longer, cache_prompt=True)
    assert pc2.disk.hits == 1


def put_state(store, model, prompt):
    dec = MTPDecoder(model, 2, prefill_step_size=64)
    dec.prefill(prompt)
    assert store.put(prompt, dec.snapshot(), has_mtp=True)
    store.flush()
    return store.file_for(prompt)


def test_size_bound_evicts_least_recently_used(models, tmp_path):
    model = models["qwen3_5"][0]
    fp = model_fingerprint(model)
    a, b, c = (prompt_of(40, seed=s) for s in range(3))
    probe = SessionStore(tmp_path / "probe", fp, min_tokens=16)
    size = put_state(probe, model, a).stat().st_size
    store = SessionStore(tmp_path / "lru", fp, max_bytes=int(2.5 * size), min_tokens=16)
    fa = put_state(store, model, a)
    time.sleep(0.02)
    fb = put_state(store, model, b)
    time.sleep(0.02)
    assert store.lookup(a + [7], need_mtp=True)[0] == tuple(a)  # a is now the newest use
    time.sleep(0.02)
    fc = put_state(store, model, c)
    assert fa.exists() and fc.exists() and not fb.exists()
    assert store.nbytes == 2 * size <= store.max_bytes
    assert store.lookup(b + [7], need_mtp=True) is None
    # A restart with a smaller bound keeps only the most recently used entry.
    small = SessionStore(tmp_path / "lru", fp, max_bytes=int(1.5 * size), min_tokens=16)
    assert len(small) == 1 and tuple(c) in small and not fa.exists()
    # Short prompts never reach the disk.
    assert not SessionStore(tmp_path / "short", fp, min_tokens=64).put(
        a, MTPDecoder(model, 2).snapshot(), True)


def test_crashed_truncated_and_corrupt_files_are_ignored(models, tmp_path):
    model = models["qwen3_5"][0]
    fp = model_fingerprint(model)
    good, other, third = (prompt_of(40, seed=s) for s in range(3))
    store = SessionStore(tmp_path, fp, min_tokens=16)
    path = put_state(store, model, good)
    data = path.read_bytes()
    # A crashed write leaves only a temp file; a copy cut short; one under a wrong name.
    (tmp_path / (store.file_for(other).name + ".123.4.tmp")).write_bytes(data)
    store.file_for(other).write_bytes(data[: len(data) // 2])
    store.file_for(third).write_bytes(data)
    (tmp_path / ("0" * 40 + SUFFIX)).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    restarted = SessionStore(tmp_path, fp, min_tokens=16)
    assert len(restarted) == 1 and tuple(good) in restarted
    assert restarted.lookup(other + [1], need_mtp=True) is None
    assert restarted.lookup(third + [1], need_mtp=True) is None
    # Corrupted after the scan: dropped (and deleted) at lookup, no exception.
    path.write_bytes(data[:-100])
    assert restarted.lookup(good + [1], need_mtp=True) is None
    assert not path.exists() and len(restarted) == 0
    # Stale temp files are swept at startup.
    stale = next(tmp_path.glob("*.tmp"))
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    SessionStore(tmp_path, fp, min_tokens=16)
    assert not stale.exists()


def test_foreign_model_entries_are_ignored(models, ckpts, tmp_path):
    model = models["qwen3_5"][0]
    fp = model_fingerprint(model)
    assert model_fingerprint(load(str(ckpts["qwen3_5"]))[0]) == fp  # stable across loads
    other = make_tiny(tmp_path / "other", "qwen3_5", "noisy", vocab_size=4096, seed=1)
    assert model_fingerprint(load(str(other))[0]) != fp
    prompt = prompt_of(40)
    path = put_state(SessionStore(tmp_path / "pc", "another-model", min_tokens=16), model,
                     prompt)
    mine = SessionStore(tmp_path / "pc", fp, min_tokens=16)
    assert len(mine) == 0 and mine.lookup(prompt + [1], need_mtp=True) is None
    # Even under this model's file name, the fingerprint inside decides.
    path.rename(mine.file_for(prompt))
    assert len(SessionStore(tmp_path / "pc", fp, min_tokens=16)) == 0


# --- a real restart ---------------------------------------------------------------------
CONVERSATION = [
    {"role": "system", "content": "You are a careful assistant for the disk cache tests. "
                                  "Answer briefly and mention the weather whenever possible."},
    {"role": "user", "content": "Tell me about the long history of the old lighthouse on "
                                "the northern cliffs, and why sailors feared the rocks."},
    {"role": "assistant", "content": "The lighthouse was built after many ships were lost on "
                                     "the rocks below the northern cliffs in winter storms."},
    {"role": "user", "content": "Who kept the light burning during the great storm, and "
                                "what happened to the keeper's family afterwards?"},
]


def chat(srv, messages):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    model = client.models.list().data[0].id
    return client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                          temperature=0)


def test_restarted_server_restores_the_conversation_from_disk(ckpts, tmp_path):
    ckpt = ckpts["qwen3_5"]
    flags = ("--fixed-k", "--num-draft-tokens", "2")
    disk = ("--prompt-cache-dir", str(tmp_path / "pc"), "--prompt-cache-min-tokens", "32")
    first = ServerProcess(ckpt, tmp_path, *flags, *disk)
    try:
        r1 = chat(first, CONVERSATION)
        assert r1.usage.prompt_tokens > 64
    finally:
        assert first.stop(signal.SIGINT) == 0, first.logs()
    assert list((tmp_path / "pc").glob("*" + SUFFIX))

    follow_up = CONVERSATION + [{"role": "assistant", "content": r1.choices[0].message.content},
                                {"role": "user", "content": "And the weather today?"}]
    restarted = ServerProcess(ckpt, tmp_path, *flags, *disk, wait=False)
    cold = ServerProcess(ckpt, tmp_path, *flags, wait=False)
    try:
        restarted.wait()
        cold.wait()
        warm_reply = chat(restarted, follow_up)
        cached = warm_reply.usage.prompt_tokens_details.cached_tokens
        assert cached > 32
        assert restarted.metric("mlx_mtp:prefix_cache_disk_hits_total") == cached
        cold_reply = chat(cold, follow_up)
        assert cold_reply.usage.prompt_tokens_details.cached_tokens == 0
        assert warm_reply.choices[0].message.content == cold_reply.choices[0].message.content
    finally:
        assert restarted.stop(signal.SIGINT) == 0, restarted.logs()
        assert cold.stop(signal.SIGINT) == 0, cold.logs()


def test_bad_flags_exit_2(ckpts, tmp_path, cli):
    for flags in (["--prompt-cache-dir", str(tmp_path), "--prompt-cache-size", "0"],
                  ["--prompt-cache-dir", str(tmp_path), "--prompt-cache-min-tokens", "0"]):
        code, _, err = cli("serve", "--model", ckpts["qwen3_5"], *flags)  # in this process
        assert code == 2 and "Traceback" not in err, err
        assert "--prompt-cache" in err
