"""A forged disk-session entry never hurts a neighbour (issue 43).

Anyone who can write the session directory can re-encode an entry and recompute its
digest. Such an entry is refused when it is restored (NaN or infinite values, caches of
the wrong kind) or when its row joins the batch (caches of the wrong shape): the join is
atomic, the entry is deleted after that one failure and the request is computed cold,
while the rows already decoding go on untouched.
"""

import logging

import mlx.core as mx
import numpy as np
import pytest

from mlx_mtp.decode.batch import BatchDecoder, BatchJoinError
from mlx_mtp.decode.sequence import Sequence, reference_state
from mlx_mtp.models.cache.kv import KVCache
from mlx_mtp.models.io.loader import load
from mlx_mtp.server.engine import Engine
from mlx_mtp.server.events import Delta, Done, EngineRequest, Failed
from mlx_mtp.server.prefix_cache import PrefixCache
from mlx_mtp.server.session_store import _CODES, SessionStore, model_fingerprint, read_entry
from mlx_mtp.server.session_store import write_safetensors
from mlx_mtp.server.session_proof import load_key
from mlx_mtp.testing.tiny import make_tiny

MIN = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("forgery") / "m", "qwen3_5", "noisy",
                     vocab_size=4096, trunk_scale=2.0, fc_noise=1.0)


@pytest.fixture(scope="module")
def model_tok(ckpt):
    return load(str(ckpt))


def prompt_of(n, seed=0):
    return [(37 * j + 101 * seed) % 4000 + 20 for j in range(n)]


PROMPT = prompt_of(48)
NEIGHBOURS = [prompt_of(20, seed=2), prompt_of(27, seed=3)]


def make_engine(model_tok, directory=None, reference=False, **store_kw):
    """``reference``: the store checks entries against a state computed here, as ``serve``
    does (without it, the shapes are checked at the join)."""
    model, tok = model_tok
    pc = None
    if directory is not None:
        store = SessionStore(directory, model_fingerprint(model), min_tokens=MIN,
                             reference=reference_state(model) if reference else None,
                             **store_kw)
        pc = PrefixCache(8, 1 << 30, disk=store)
    return Engine(model, tok, num_draft_tokens=2, adaptive=False, log_interval=0,
                  prefix_cache=pc, prefill_step_size=64, calibrate=False)


def submit(engine, prompt, max_tokens=12, boundaries=()):
    events = []
    engine.submit(EngineRequest(prompt=list(prompt), max_tokens=max_tokens,
                                on_event=events.append, boundaries=list(boundaries)))
    return events


def outcome(events):
    return next((e for e in events if isinstance(e, (Done, Failed))), None)


def tokens(events):
    return [t for e in events if isinstance(e, Delta) for t in e.token_ids]


def drive(engine, *streams):
    for _ in range(3000):
        if all(outcome(s) is not None for s in streams):
            return
        engine.step()
    raise AssertionError("the engine did not finish")


def solo(model_tok, prompt, max_tokens=12, directory=None, boundaries=(), **store_kw):
    engine = make_engine(model_tok, directory, **store_kw)
    events = submit(engine, prompt, max_tokens, boundaries)
    drive(engine, events)
    assert isinstance(outcome(events), Done), outcome(events)
    if directory is not None:
        engine.prefix_cache.disk.flush()
    return tokens(events)


def cached(events) -> int:
    return outcome(events).usage["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def cold(model_tok):
    return solo(model_tok, PROMPT)


@pytest.fixture
def entry(model_tok, tmp_path):
    """A directory holding one good entry (PROMPT's whole state); its path."""
    solo(model_tok, PROMPT, directory=tmp_path, boundaries=[len(PROMPT) - 1])
    files = list(tmp_path.glob("*.safetensors"))
    assert len(files) == 1
    return files[0]


def reencode(path, edit=lambda arrays: None, key=None, key_to_write=None):
    """Rewrite an entry with ``edit`` applied to its arrays and a recomputed digest, as
    anyone with write access to the directory can (without the server's key)."""
    arrays, meta = read_entry(path, key)
    edit(arrays)
    write_entry(path, arrays, meta, key_to_write)


def write_entry(path, arrays, meta, key=None):
    views = {k: a.view(mx.uint16) if a.dtype == mx.bfloat16 else a for k, a in arrays.items()}
    with open(path, "wb") as f:
        write_safetensors(f, {k: np.array(v) for k, v in views.items()},
                          {k: _CODES[a.dtype] for k, a in arrays.items()}, meta, key)


def widen(a: mx.array) -> mx.array:
    """The array with a last axis half as wide again (a model of another head size)."""
    return mx.concatenate([a, a[..., : a.shape[-1] // 2]], axis=-1)


def with_nan(a: mx.array) -> mx.array:
    x = np.array(a.astype(mx.float32))
    x.reshape(-1)[x.size // 2] = np.nan
    return mx.array(x).astype(a.dtype)


def prompt_cache_warnings(caplog):
    # Warnings only: another test may have left the mlx_mtp logger at INFO, whose
    # "entries restorable" line says "Prompt cache" too.
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and "Prompt cache" in r.getMessage()]


def _wide_mtp_cache(arrays):
    for name in ("m.0.k", "m.0.v"):
        arrays[name] = widen(arrays[name])


def _wide_owed_hidden(arrays):
    arrays["o.h.0"] = widen(arrays["o.h.0"])


def _owed_token_past_the_vocabulary(arrays):
    arrays["o.t.0"] = mx.full(arrays["o.t.0"].shape, 10**6, arrays["o.t.0"].dtype)


@pytest.mark.parametrize("forge,why,reference", [
    (_wide_mtp_cache, "cannot join the batch", False),
    (_wide_mtp_cache, "does not fit beside", True),  # refused on reading, as ``serve`` does
    (_wide_owed_hidden, "owed MTP pairs", False),
    (_owed_token_past_the_vocabulary, "owed MTP pairs", True)])
def test_a_forged_entry_fails_alone_is_dropped_and_served_cold(model_tok, entry, cold, forge,
                                                               why, reference, caplog):
    """The probe: two neighbours streaming, then a request whose entry was re-encoded with
    the wrong width (or ids past the vocabulary), its digest recomputed."""
    lone = [solo(model_tok, p, 24) for p in NEIGHBOURS]
    reencode(entry, forge)
    engine = make_engine(model_tok, entry.parent, reference)
    neighbours = [submit(engine, p, 24) for p in NEIGHBOURS]
    while not all(tokens(s) for s in neighbours):
        engine.step()
    with caplog.at_level(logging.WARNING, logger="mlx_mtp.server"):
        forged = submit(engine, PROMPT)
        drive(engine, forged, *neighbours)
    assert [tokens(s) for s in neighbours] == lone  # 2/2 finish with their lone-run text
    assert all(isinstance(outcome(s), Done) for s in neighbours)
    assert isinstance(outcome(forged), Done), outcome(forged)
    assert tokens(forged) == cold and cached(forged) == 0
    assert not entry.exists()  # dropped after its one failure
    lines = prompt_cache_warnings(caplog)
    assert len(lines) == 1 and why in lines[0], lines
    # A restart finds nothing to restore: the same prompt is served cold again.
    assert solo(model_tok, PROMPT, directory=entry.parent) == cold


@pytest.mark.parametrize("name", ["c.0.conv", "c.0.ssm", "c.1.k", "m.0.v", "o.h.0"])
def test_a_nan_state_is_never_served(model_tok, entry, cold, name, caplog):
    def forge(arrays):
        arrays[name] = with_nan(arrays[name])

    reencode(entry, forge)
    store = SessionStore(entry.parent, model_fingerprint(model_tok[0]), min_tokens=MIN)
    with caplog.at_level(logging.WARNING, logger="mlx_mtp.server"):
        assert store.lookup(PROMPT, need_mtp=True) is None
    assert not entry.exists()
    assert "NaN or infinite" in prompt_cache_warnings(caplog)[0]
    assert solo(model_tok, PROMPT, directory=entry.parent) == cold


def test_a_cache_of_the_wrong_kind_is_refused_at_restore(model_tok, entry, cold, caplog):
    """A recurrent layer's state re-labelled as an attention cache is refused before it
    is restored (checked against the model's own caches)."""
    import json

    arrays, meta = read_entry(entry)
    layout = json.loads(meta["layout"])
    layout["trunk"][0], layout["trunk"][1] = layout["trunk"][1], layout["trunk"][0]
    for name in ("k", "v"):
        arrays[f"c.0.{name}"] = arrays.pop(f"c.1.{name}")
    for name in ("conv", "ssm"):
        arrays[f"c.1.{name}"] = arrays.pop(f"c.0.{name}")
    meta["layout"] = json.dumps(layout)
    write_entry(entry, arrays, meta)
    engine = make_engine(model_tok, entry.parent)
    with caplog.at_level(logging.WARNING, logger="mlx_mtp.server"):
        events = submit(engine, PROMPT)
        drive(engine, events)
    assert isinstance(outcome(events), Done) and tokens(events) == cold and cached(events) == 0
    assert not entry.exists()
    assert len(prompt_cache_warnings(caplog)) == 1


# -- the join itself -------------------------------------------------------------------
def batch_arrays(bd):
    """Every cache's kind, meta state and state arrays (as bytes), in order."""
    out = []
    for c in bd.cache + (bd.mtp_cache or []):
        arrays = [a.view(mx.uint16) if a.dtype == mx.bfloat16 else a for a in c.arrays()]
        out.append((type(c).__name__, tuple(c.meta_state),
                    [(a.dtype, a.shape, np.array(a).tobytes()) for a in arrays]))
    return out


def _widen_mtp(seq):
    k, v = seq.mtp_cache[0].state
    seq.mtp_cache[0].state = (widen(k), widen(v))


def _widen_trunk(seq):
    k, v = seq.cache[1].state
    seq.cache[1].state = (widen(k), widen(v))


def _wrong_kind(seq):
    seq.cache[0] = seq.cache[1].copy()


@pytest.mark.parametrize("forge", [_widen_mtp, _widen_trunk, _wrong_kind])
def test_a_failed_join_leaves_every_batch_cache_bit_identical(model_tok, forge):
    model = model_tok[0]
    bd = BatchDecoder(model, True, adaptive=False)
    for i, p in enumerate(NEIGHBOURS):
        seq = Sequence(model, 2, adaptive=False)
        seq.prefill(p)
        bd.add(i, seq)
        bd.step()
    rows = list(bd.rows)
    bad = Sequence(model, 2, adaptive=False)
    bad.prefill(PROMPT)
    forge(bad)
    before = batch_arrays(bd)
    with pytest.raises(BatchJoinError) as err:
        bd.add("forged", bad)
    assert err.value.key == "forged" and "'forged'" in str(err.value)
    assert batch_arrays(bd) == before  # every cache, bit for bit
    assert bd.rows == rows and bad.row.key is None
    assert set(bd.step()) == {0, 1}  # the batch goes on


def test_the_first_row_is_checked_against_the_models_caches(model_tok):
    model = model_tok[0]
    bd = BatchDecoder(model, True, adaptive=False)
    bad = Sequence(model, 2, adaptive=False)
    bad.prefill(PROMPT)
    bad.cache[0] = KVCache()
    with pytest.raises(BatchJoinError, match="trunk cache 0"):
        bd.add("forged", bad)
    assert len(bd) == 0 and bd.cache is None


# -- a keyed digest --------------------------------------------------------------------
def test_the_session_key_file_is_private_and_stable(tmp_path):
    path = tmp_path / "keys" / "session.key"
    key = load_key(path)
    assert len(key) == 32 and oct(path.stat().st_mode & 0o777) == "0o600"
    assert load_key(path) == key
    path.chmod(0o644)
    with pytest.raises(ValueError, match="0600"):
        load_key(path)


def test_with_a_key_only_entries_proven_by_it_are_restored(model_tok, cold, tmp_path):
    directory = tmp_path / "sessions"
    key, other = load_key(tmp_path / "a.key"), load_key(tmp_path / "b.key")
    solo(model_tok, PROMPT, directory=directory, boundaries=[len(PROMPT) - 1], key=key)
    (path,) = directory.glob("*.safetensors")
    good = path.read_bytes()
    assert read_entry(path, key)[1]["format"]
    with pytest.raises(ValueError, match="proven by hmac-sha256, not sha256"):
        read_entry(path)  # a keyless reader does not accept it either

    engine = make_engine(model_tok, directory, key=key)
    events = submit(engine, PROMPT)
    drive(engine, events)
    assert tokens(events) == cold and cached(events) == len(PROMPT) - 1
    for forge in (lambda: reencode(path, key=key),  # a plain digest, recomputed
                  lambda: reencode(path, key=key, key_to_write=other)):  # another key
        path.write_bytes(good)
        forge()
        store = SessionStore(directory, model_fingerprint(model_tok[0]), min_tokens=MIN,
                             key=key)
        assert store.lookup(PROMPT, need_mtp=True) is None  # treated as absent
        assert not path.exists()  # and deleted


@pytest.mark.parametrize("reference", [False, True])
@pytest.mark.parametrize("name", ["c.1.k", "m.0.k"])
def test_a_forged_entry_alone_in_the_batch_is_served_cold(model_tok, entry, cold, name,
                                                          reference):
    """With no neighbour to check it beside, a state of the wrong width fails its own first
    step (without a reference state); it is dropped and the request computed cold."""
    def forge(arrays):
        for n in (name, name[:-1] + "v"):
            arrays[n] = widen(arrays[n])

    reencode(entry, forge)
    engine = make_engine(model_tok, entry.parent, reference)
    events = submit(engine, PROMPT)
    drive(engine, events)
    assert isinstance(outcome(events), Done), outcome(events)
    assert tokens(events) == cold and cached(events) == 0
    assert not entry.exists()


def test_bad_key_flags_exit_2(ckpt, tmp_path):
    import socket
    import subprocess
    import sys

    with socket.socket() as s:  # a free port: the last case loads the model first
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    sessions, shared = tmp_path / "sessions", tmp_path / "shared.key"
    shared.write_bytes(b"k" * 32)
    shared.chmod(0o644)
    for flags in (["--prompt-cache-key", str(tmp_path / "a.key")],  # without a directory
                  ["--prompt-cache-dir", str(sessions),
                   "--prompt-cache-key", str(sessions / "inside.key")],
                  ["--prompt-cache-dir", str(sessions), "--prompt-cache-key", str(shared)]):
        p = subprocess.run([sys.executable, "-m", "mlx_mtp.cli", "serve", "--model", str(ckpt),
                            "--port", port, *flags], capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert "--prompt-cache-key" in p.stderr, p.stderr
