"""Disk sessions prove their bytes (issue 25): a corrupted or planted entry is never
restored, the request is computed cold (same tokens as a cold engine), one log line says
why; temp files are fresh, exclusive and never followed through a link."""

import logging
import os
import random
import struct
import time

import pytest

from mlx_mtp.models.io.loader import load
from mlx_mtp.server.engine import Engine
from mlx_mtp.server.events import Delta, Done, EngineRequest, Failed
from mlx_mtp.server.prefix_cache import PrefixCache
from mlx_mtp.server.session_store import SessionStore, model_fingerprint, read_entry
from mlx_mtp.testing.tiny import make_tiny

MIN = 16


@pytest.fixture(scope="module")
def model_tok(tmp_path_factory):
    path = make_tiny(tmp_path_factory.mktemp("integrity") / "m", "qwen3_5", "noisy",
                     vocab_size=4096, trunk_scale=2.0, fc_noise=1.0)
    return load(str(path))


def prompt_of(n, seed=0):
    return [(37 * j + 101 * seed) % 4000 + 20 for j in range(n)]


PROMPT = prompt_of(48)
LONGER = PROMPT + prompt_of(9, seed=1)


def run(model_tok, prompt, directory=None, boundaries=()):
    """Tokens of a 12-token greedy answer, and the prompt tokens restored from disk."""
    model, tok = model_tok
    pc = None
    if directory is not None:
        pc = PrefixCache(8, 1 << 30, disk=SessionStore(directory, model_fingerprint(model),
                                                       min_tokens=MIN))
    engine = Engine(model, tok, num_draft_tokens=2, adaptive=False, log_interval=0,
                    prefix_cache=pc, prefill_step_size=64, calibrate=False)
    events = []
    engine.submit(EngineRequest(prompt=list(prompt), max_tokens=12, on_event=events.append,
                                boundaries=list(boundaries)))
    for _ in range(2000):
        done = next((e for e in events if isinstance(e, (Done, Failed))), None)
        if done is not None:
            break
        engine.step()
    assert isinstance(done, Done), done
    if pc is not None:
        pc.disk.flush()
    tokens = [t for e in events if isinstance(e, Delta) for t in e.token_ids]
    return tokens, done.usage["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def cold(model_tok):
    return run(model_tok, LONGER)[0]


@pytest.fixture
def entry(model_tok, tmp_path):
    """A directory holding one good entry (the prompt's state); its path."""
    run(model_tok, PROMPT, tmp_path, boundaries=[len(PROMPT) - 1])
    files = list(tmp_path.glob("*.safetensors"))
    assert len(files) == 1
    return files[0]


def data_start(path) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def flip(path, offset: int, bit: int = 0):
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def test_a_good_entry_is_restored_and_equals_cold(model_tok, entry, cold):
    tokens, cached = run(model_tok, LONGER, entry.parent)
    assert cached == len(PROMPT) - 1 and tokens == cold


def test_a_byte_flip_in_the_data_is_refused_with_one_log_line(model_tok, entry, cold, caplog):
    start, size = data_start(entry), entry.stat().st_size
    flip(entry, start + (size - start) // 2, 3)  # header and size intact
    with caplog.at_level(logging.WARNING, logger="mlx_mtp.server"):
        tokens, cached = run(model_tok, LONGER, entry.parent)
    assert cached == 0 and tokens == cold
    lines = [r.getMessage() for r in caplog.records if "Prompt cache" in r.getMessage()]
    assert len(lines) == 1 and "digest mismatch" in lines[0], lines
    assert not entry.exists()  # dropped


def test_bit_rot_at_random_offsets_is_never_restored(model_tok, entry, cold, tmp_path_factory):
    good = entry.read_bytes()
    fp = model_fingerprint(model_tok[0])
    rng = random.Random(25)
    start = data_start(entry)
    offsets = [rng.randrange(len(good)) for _ in range(12)]
    offsets += [rng.randrange(start, len(good)) for _ in range(12)]  # data section
    for i, offset in enumerate(offsets):
        entry.write_bytes(good)
        flip(entry, offset, rng.randrange(8))
        store = SessionStore(entry.parent, fp, min_tokens=MIN)  # a restart: scan, then read
        assert store.lookup(LONGER, need_mtp=True) is None, offset
    entry.write_bytes(good)
    flip(entry, offsets[-1], 5)
    tokens, cached = run(model_tok, LONGER, entry.parent)
    assert cached == 0 and tokens == cold


def test_entries_written_without_a_digest_are_not_trusted(model_tok, entry):
    import json

    start = data_start(entry)
    raw = entry.read_bytes()
    header = json.loads(raw[8:start])
    del header["__metadata__"]["digest"]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (start - 8 - len(text))
    entry.write_bytes(raw[:8] + text + raw[start:])
    with pytest.raises(ValueError, match="no digest"):
        read_entry(entry)


def test_a_planted_symlink_is_not_followed(model_tok, entry, cold, tmp_path_factory):
    """An entry name that is a link (to a valid entry kept elsewhere) is not read."""
    outside = tmp_path_factory.mktemp("outside") / entry.name
    outside.write_bytes(entry.read_bytes())
    entry.unlink()
    entry.symlink_to(outside)
    tokens, cached = run(model_tok, LONGER, entry.parent)
    assert cached == 0 and tokens == cold
    assert outside.read_bytes()  # the link's target is untouched


def test_temp_files_are_exclusive_and_stale_ones_swept(model_tok, entry, tmp_path_factory):
    directory = entry.parent
    fp = model_fingerprint(model_tok[0])
    victim = tmp_path_factory.mktemp("victim") / "precious"
    victim.write_bytes(b"keep me")
    # Links where a temp file may be: swept at startup whatever their age, never written
    # through; a stale regular temp file and a stale FIFO are swept too.
    (directory / "a.tmp").symlink_to(victim)
    (directory / "dangling.tmp").symlink_to(directory / "missing")
    old = time.time() - 3600
    (directory / "crashed.tmp").write_bytes(b"half")
    os.utime(directory / "crashed.tmp", (old, old))
    os.mkfifo(directory / "fifo.tmp")
    os.utime(directory / "fifo.tmp", (old, old))
    (directory / "fresh.tmp").write_bytes(b"another writer, still running")
    store = SessionStore(directory, fp, min_tokens=MIN)
    left = sorted(p.name for p in directory.glob("*.tmp"))
    assert left == ["fresh.tmp"]
    # The old writer's predictable temp name, planted as a link: writing goes elsewhere.
    key = prompt_of(40, seed=3)
    planted = directory / f"{store.file_for(key).name}.{os.getpid()}.{store._writer.ident}.tmp"
    planted.symlink_to(victim)
    from mlx_mtp.decode.speculative import MTPDecoder

    dec = MTPDecoder(model_tok[0], 2, prefill_step_size=64)
    dec.prefill(key)
    assert store.put(key, dec.snapshot(), has_mtp=True)
    store.flush()
    assert victim.read_bytes() == b"keep me"
    assert store.file_for(key).is_file() and not store.file_for(key).is_symlink()
    assert store.lookup(key + [5], need_mtp=True)[0] == tuple(key)

