"""``add-mtp --from org/name``: graft the head of a hub release onto a trunk conversion,
downloading only the config, the safetensors index and the shards holding ``mtp.*``
(against the stand-in Hub of tests/hub_server.py, through the real CLI)."""

import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_mtp.convert.add_mtp import add_mtp
from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.models.io.layout import is_mtp_key
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.testing.tiny import make_tiny

sys.path.insert(0, str(Path(__file__).parent))
from hub_server import StandInHub, start  # noqa: E402
from test_hub import cli, env_for  # noqa: E402

PROMPT = [3, 17, 42, 99, 7, 250, 11, 5]


def greedy(model, k, n=16):
    dec = MTPDecoder(model, k, adaptive=False)
    tokens = [t for t, _, _ in generate_step(PROMPT, model, decoder=dec, max_tokens=n)]
    return tokens, dec.stats.num_accepted_tokens


def mlx_lm_trunk(src: Path, dst: Path) -> Path:
    """What mlx_lm.convert -q writes: a 4-bit trunk without the head."""
    from mlx_lm.utils import load_model as lm_load_model
    from mlx_lm.utils import quantize_model, save_config, save_model

    model, config = lm_load_model(src, lazy=True)
    model, config = quantize_model(model, config, 64, 4)
    save_model(dst, model)
    save_config(config, dst / "config.json")
    return dst


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("graft")
    src = make_tiny(root / "orig", "qwen3_5", "noisy", shards=3,
                    tokenizer_dir=root / "no-tokenizer")
    trunk = mlx_lm_trunk(src, root / "trunk-4bit")
    reference = root / "reference"  # the graft from the local original
    shutil.copytree(trunk, reference)
    add_mtp(reference, src, verbose=False)
    hub = StandInHub()
    server, _ = start(hub)
    hub.add_repo("org/orig", src)
    hub.add_repo("org/trunk-4bit", trunk)
    yield hub, src, trunk, reference
    server.shutdown()


def graft_from_hub(hub, trunk: Path, tmp_path: Path, repo: str):
    """``add-mtp --from repo`` onto a copy of ``trunk``: (the model, the GET requests it made)."""
    dst = tmp_path / "model"
    shutil.copytree(trunk, dst)
    first = len(hub.requests)
    code, _, err = cli(env_for(hub, tmp_path / "hf"), "add-mtp", "--model", str(dst),
                       "--from", repo)
    assert code == 0, err
    return dst, [r for r in hub.requests[first:] if r.method == "GET" and "/resolve/" in r.path]


def same_tensors(a: Path, b: Path):
    x, y = mx.load(str(a / "mtp.safetensors")), mx.load(str(b / "mtp.safetensors"))
    assert x.keys() == y.keys() and all(mx.array_equal(x[k], y[k]).item() for k in x)


def test_from_hub_reads_only_the_head_shards_and_grafts_like_the_local_source(setup, tmp_path):
    hub, src, trunk, reference = setup
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    head_shards = {f for k, f in index.items() if is_mtp_key(k)}
    assert head_shards < set(index.values())  # the test means something: a shard is skipped
    dst, fetched = graft_from_hub(hub, trunk, tmp_path, "org/orig")
    names = sorted(r.path.rsplit("/", 1)[1] for r in fetched)
    assert names == sorted({"config.json", "model.safetensors.index.json"} | head_shards)
    wanted = sum((src / n).stat().st_size for n in names)
    assert sum(r.bytes_sent for r in fetched) == wanted
    same_tensors(dst, reference)
    model, _ = load_model(dst)
    plain, _ = greedy(model, 0)
    tokens, accepted = greedy(model, 3)
    assert tokens == plain and accepted > 0


def test_hub_trunk_is_copied_to_output_and_the_cache_left_alone(setup, tmp_path):
    hub, src, trunk, reference = setup
    env = env_for(hub, tmp_path / "hf")
    code, _, err = cli(env, "add-mtp", "--model", "org/trunk-4bit", "--from", "org/orig")
    assert code == 2 and "--output" in err and "Traceback" not in err
    out = tmp_path / "with-head"
    code, _, err = cli(env, "add-mtp", "--model", "org/trunk-4bit", "--from", "org/orig",
                       "--output", str(out))
    assert code == 0, err
    same_tensors(out, reference)
    cached = next((tmp_path / "hf" / "hub").glob("models--org--trunk-4bit/snapshots/*"))
    assert sorted(p.name for p in cached.iterdir()) == sorted(p.name for p in trunk.iterdir())
    assert all((cached / p.name).read_bytes() == p.read_bytes() for p in trunk.iterdir())


def test_damaged_download_is_refused_and_removed_then_fetched_again(setup, tmp_path):
    hub, src, trunk, reference = setup
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    shard = sorted({f for k, f in index.items() if is_mtp_key(k)})[0]
    dst = tmp_path / "model"
    shutil.copytree(trunk, dst)
    env = env_for(hub, tmp_path / "hf")
    hub.corrupt.add(shard)
    try:
        code, _, err = cli(env, "add-mtp", "--model", str(dst), "--from", "org/orig")
    finally:
        hub.corrupt.discard(shard)
    assert code == 2 and "checksum" in err and "Traceback" not in err
    assert not (dst / "mtp.safetensors").exists()  # the model is unchanged
    code, _, err = cli(env, "add-mtp", "--model", str(dst), "--from", "org/orig")
    assert code == 0, err
    same_tensors(dst, reference)


def test_a_source_without_head_is_refused(setup, tmp_path):
    hub, src, trunk, reference = setup
    dst = tmp_path / "model"
    shutil.copytree(trunk, dst)
    code, _, err = cli(env_for(hub, tmp_path / "hf"), "add-mtp", "--model", str(dst),
                       "--from", "org/trunk-4bit")
    assert code == 2 and "has no MTP weights" in err and "Traceback" not in err


def test_head_in_a_file_the_index_does_not_name(setup, tmp_path):
    """Some releases (Qwen3.6-35B-A3B-FP8) keep the head in mtp.safetensors, outside the
    index: add-mtp --from fetches that file and no shard."""
    hub, src, trunk, reference = setup
    release = tmp_path / "release"
    shutil.copytree(src, release)
    index_file = release / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    head = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = mx.load(str(release / shard))
        mx.eval(list(tensors.values()))  # read before the file is rewritten
        head.update({k: v for k, v in tensors.items() if is_mtp_key(k)})
        mx.save_safetensors(str(release / shard),
                            {k: v for k, v in tensors.items() if not is_mtp_key(k)},
                            metadata={"format": "pt"})
    mx.save_safetensors(str(release / "mtp.safetensors"), head, metadata={"format": "pt"})
    index["weight_map"] = {k: f for k, f in index["weight_map"].items() if not is_mtp_key(k)}
    index_file.write_text(json.dumps(index))
    hub.add_repo("org/release-mtp-file", release)
    dst, fetched = graft_from_hub(hub, trunk, tmp_path, "org/release-mtp-file")
    names = sorted(r.path.rsplit("/", 1)[1] for r in fetched)
    assert names == ["config.json", "model.safetensors.index.json", "mtp.safetensors"]
    same_tensors(dst, reference)
