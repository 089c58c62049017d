"""Issue 43, items 3-5: every bad checkpoint, tokenizer, split drafter and hub id is one line
on stderr and exit 2 on ``inspect``, ``generate``, ``serve`` and ``--mtp-model``, checked
before any large allocation; hub revisions never write outside the Hub cache; a Hub that
accepts connections and never answers fails within ``HF_HUB_ETAG_TIMEOUT``.

The CLI runs in-process where an exit code and stderr are all a case needs; the cases that
measure time and memory (and the silent Hub, whose timeout is read from the environment at
import) run in one child interpreter each, several cases per child.
"""

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_mtp import cli
from mlx_mtp.models.io import hub

sys.path.insert(0, str(Path(__file__).parent))
from hub_server import StandInHub, start  # noqa: E402


def edit_config(path: Path, change, section="text_config"):
    config = json.loads((path / "config.json").read_text())
    change(config[section] if section else config)
    (path / "config.json").write_text(json.dumps(config))


def setter(key, value, section="text_config"):
    return lambda d: edit_config(d, lambda c: c.__setitem__(key, value), section)


def drop_dtype(path: Path):
    """Remove one tensor's ``dtype`` from the header (same length, padded with spaces)."""
    f = path / "model.safetensors"
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    del header[next(k for k in header if k != "__metadata__")]["dtype"]
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= n
    f.write_bytes(data[:8] + raw.ljust(n) + data[8 + n:])


def replace_weights(path: Path, make):
    (path / "model.safetensors").unlink()
    make(path / "model.safetensors")


def drop_tokenizer(path: Path):
    for f in path.iterdir():
        if "token" in f.name:
            f.unlink()


# name -> (damage done to a copy of a good checkpoint, words the error must hold)
CHECKPOINT_CASES = {
    "text_config null": (setter("text_config", None, None), "text_config must be a JSON object"),
    "text_config string": (setter("text_config", "qwen", None),
                           "text_config must be a JSON object"),
    "model_type 5": (setter("model_type", 5, None), "model_type must be a string"),
    "0 attention heads": (setter("num_attention_heads", 0), "num_attention_heads must be"),
    "vocab_size 1e10": (setter("vocab_size", 1e10), "vocab_size must be a whole number"),
    "value heads not a multiple": (setter("linear_num_value_heads", 3), "must be a multiple"),
    "generation_config invalid": (lambda d: (d / "generation_config.json").write_text("{"),
                                  "generation_config.json is not valid JSON"),
    "generation_config list": (lambda d: (d / "generation_config.json").write_text("[1]"),
                               "generation_config.json does not hold a JSON object"),
    "tokenizer.json invalid": (lambda d: (d / "tokenizer.json").write_text('{"model": '),
                               "tokenizer.json is not valid JSON"),
    "tokenizer_config invalid": (lambda d: (d / "tokenizer_config.json").write_text("{"),
                                 "tokenizer_config.json is not valid JSON"),
    "tokenizer missing": (drop_tokenizer, "has no tokenizer"),
    "weights a directory": (lambda d: replace_weights(d, Path.mkdir), "(a directory)"),
    "weights a symlink loop": (lambda d: replace_weights(d, lambda f: f.symlink_to(f.name)),
                               "looping symlink"),
    "header entry without dtype": (drop_dtype, "needs dtype"),
}


@pytest.fixture(scope="module")
def good(tiny_ckpt):
    return Path(tiny_ckpt("qwen3_5", "random", vocab_size=4096))


def damaged_copy(good: Path, where: Path, damage) -> Path:
    shutil.copytree(good, where, symlinks=True)
    damage(where)
    return where


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def verbs(model, drafter=None):
    """The three model verbs on ``model`` (with ``--mtp-model drafter``); the server's own
    INFO log lines left out."""
    flags = ["--model", str(model)] + (["--mtp-model", str(drafter)] if drafter else [])
    return {"inspect": ["inspect", str(drafter or model)],
            "generate": ["generate", *flags, "--prompt", "hi", "-m", "2", "--blas", "reference"],
            "serve": ["serve", *flags, "--port", str(free_port()), "--blas", "reference",
                      "--log-level", "WARNING"]}


def assert_one_line_exit_2(capsys, argv, words):
    code = cli.main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err, (argv[0], err)
    assert len(lines) == 1 and lines[0].startswith("mlx-mtp: error: "), (argv[0], err)
    assert words in lines[0], (argv[0], err)


@pytest.mark.parametrize("case", list(CHECKPOINT_CASES))
def test_a_bad_checkpoint_is_one_line_and_exit_2_on_every_verb(case, good, tmp_path, capsys):
    damage, words = CHECKPOINT_CASES[case]
    path = damaged_copy(good, tmp_path / "m", damage)
    for argv in verbs(path).values():
        assert_one_line_exit_2(capsys, argv, words)


# --- split drafters (--mtp-model) ----------------------------------------------------------


def truncate_weights(path: Path):
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])


DRAFTER_CASES = {
    "config invalid": (lambda d: (d / "config.json").write_text("{"), "is not valid JSON"),
    "config a list": (lambda d: (d / "config.json").write_text("[]"),
                      "does not hold a JSON object"),
    "text_config null": (setter("text_config", None, None), "text_config must be a JSON object"),
    "weights truncated": (truncate_weights, "the header needs"),
    "tokenizer invalid": (lambda d: (d / "tokenizer.json").write_text("{"),
                          "tokenizer.json is not valid JSON"),
    "tokenizer not one": (lambda d: (d / "tokenizer.json").write_text('{"model": [1]}'),
                          "is not a tokenizer.json"),
}


@pytest.fixture(scope="module")
def split_pair(good, tmp_path_factory):
    from mlx_mtp.convert.main import convert

    root = tmp_path_factory.mktemp("pair")
    convert(good, root / "trunk", split_mtp=root / "trunk-MTP", verbose=False)
    return root / "trunk", root / "trunk-MTP"


@pytest.mark.parametrize("case", list(DRAFTER_CASES))
def test_a_bad_split_drafter_is_one_line_and_exit_2(case, split_pair, tmp_path, capsys):
    trunk, drafter = split_pair
    damage, words = DRAFTER_CASES[case]
    bad = damaged_copy(drafter, tmp_path / "d", damage)
    for verb, argv in verbs(trunk, bad).items():
        if verb == "inspect" and case == "tokenizer not one":
            continue  # inspect reads a drafter's tokenizer as JSON only (its trunk's is used)
        assert_one_line_exit_2(capsys, argv, words)


# --- hub ids --------------------------------------------------------------------------------


@pytest.mark.parametrize("revision", ["main", "v1.0", "refs/pr/1", "a" * 40, "feature_x-2",
                                      "v1.0+build"])
def test_revisions_huggingface_hub_takes_are_accepted(revision):
    hub.check_hub_id("org/name", revision)


@pytest.mark.parametrize("spec,words", [
    ("org/" + "n" * 300, "is not a valid Hugging Face id"),
    ("org/name@" + "r" * 5000, "is not a valid revision"),
    ("org/name@/tmp/outside", "is not a valid revision"),
    ("org/name@main//x", "is not a valid revision"),
    ("org/name@main/./x", "is not a valid revision"),
])
def test_bad_hub_ids_are_refused_before_any_request(spec, words, tmp_path, capsys,
                                                    split_pair):
    """Against a stand-in Hub (no request reaches it); an absolute revision writes nothing
    (huggingface_hub would write its ref file at that path)."""
    outside = tmp_path / "outside"
    spec = spec.replace("/tmp/outside", str(outside))
    stand_in = StandInHub()
    server, _ = start(stand_in)
    try:
        env = {"HF_ENDPOINT": stand_in.url, "HF_HOME": str(tmp_path / "hf")}
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            for argv in list(verbs(spec).values()) + [verbs(split_pair[0], spec)["generate"]]:
                assert_one_line_exit_2(capsys, argv, words)
    finally:
        server.shutdown()
    assert stand_in.requests == [] and not outside.exists()


# --- time and memory: each case in a child interpreter, several per child -------------------

CHILD = """
import contextlib, io, json, resource, sys, time
from mlx_mtp import cli
out = []
for argv in json.loads(sys.argv[1]):
    err, t = io.StringIO(), time.monotonic()
    with contextlib.redirect_stderr(err):
        code = cli.main(argv)
    out.append({"code": code, "seconds": time.monotonic() - t, "err": err.getvalue(),
                "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux
print(json.dumps({"runs": out, "max_rss_mb": rss_mb}))
"""


# Cases that wait out a timeout: all at once, one thread each (stderr kept per thread; the
# commands' modules imported first: threads importing them together can deadlock).
CHILD_AT_ONCE = """
import importlib, io, json, sys, threading, time
from mlx_mtp import cli
class PerThread(io.TextIOBase):
    def __init__(self):
        self.parts = {}
    def write(self, s):
        self.parts.setdefault(threading.get_ident(), []).append(s)
        return len(s)
sys.stderr = err = PerThread()
argvs = json.loads(sys.argv[1])
for argv in argvs:
    importlib.import_module(cli.COMMANDS[argv[0]][0])
out = [None] * len(argvs)
def run(i, argv):
    t = time.monotonic()
    code = cli.main(argv)
    out[i] = {"code": code, "seconds": time.monotonic() - t,
              "err": "".join(err.parts.pop(threading.get_ident(), []))}
threads = [threading.Thread(target=run, args=a) for a in enumerate(argvs)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps({"runs": out}))
"""


def run_child(argvs, script=CHILD, **env):
    p = subprocess.run([sys.executable, "-c", script, json.dumps(argvs)], capture_output=True,
                       text=True, timeout=600, env=dict(os.environ, **env))
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def huge_header(path: Path):
    """A header length of 2 GB in a (sparse) file larger than that."""
    f = path / "model.safetensors"
    data = f.read_bytes()
    with open(f, "wb") as fh:
        fh.write(struct.pack("<Q", 2_000_000_000) + data[8:])
        fh.truncate(2_100_000_000)


BUDGET_CASES = {
    "10**12 layers": (setter("num_hidden_layers", 10**12), "num_hidden_layers must be between"),
    "2e9 layers": (setter("num_hidden_layers", 2_000_000_000), "more than the weight files"),
    "2 GB header": (huge_header, "invalid header length 2000000000"),
}


def test_damaged_counts_and_headers_fail_fast_and_small(good, tmp_path):
    """Issue 43 targets: exit 2 in under 2 s with under 200 MB (asserted with room for a
    loaded machine: 10 s each). Memory is what the damaged runs add to the peak of a child
    that has already run ``inspect`` on the good model (interpreter, MLX and the verbs'
    imports loaded: their size depends on the environment, not on the file)."""
    argvs, expected = [["inspect", str(good)]], [None]
    for i, (case, (damage, words)) in enumerate(BUDGET_CASES.items()):
        path = damaged_copy(good, tmp_path / f"m{i}", damage)
        for argv in verbs(path).values():
            argvs.append(argv)
            expected.append((case, argv[0], words))
    report = run_child(argvs)
    warm, runs = report["runs"][0], report["runs"][1:]
    assert warm["code"] == 0, warm
    for (case, verb, words), run in zip(expected[1:], runs):
        lines = run["err"].strip().splitlines()
        assert run["code"] == 2 and len(lines) == 1 and words in lines[0], (case, verb, run)
        assert run["seconds"] < 10, (case, verb, run["seconds"])
    grew = [(case, verb, round(run["max_rss_mb"] - warm["max_rss_mb"]))
            for (case, verb, _), run in zip(expected[1:], runs)]
    assert all(mb < 200 for *_, mb in grew), grew  # peak growth after each run


def test_a_silent_hub_fails_within_the_stated_timeout(split_pair, tmp_path):
    """An endpoint that accepts connections and never answers: each verb fails after
    HF_HUB_ETAG_TIMEOUT seconds (2 here) with one line that says so."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # the kernel accepts; nobody ever reads or answers
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        argvs = list(verbs("org/tiny").values()) + [verbs(split_pair[0], "org/tiny")["generate"]]
        report = run_child(argvs, CHILD_AT_ONCE, HF_ENDPOINT=url, HF_HOME=str(tmp_path / "hf"),
                           HF_HUB_ETAG_TIMEOUT="2", HF_HUB_DISABLE_TELEMETRY="1")
    for argv, run in zip(argvs, report["runs"]):
        lines = run["err"].strip().splitlines()
        assert run["code"] == 2 and len(lines) == 1, (argv, run)
        assert "within 2 s (HF_HUB_ETAG_TIMEOUT)" in lines[0], (argv, run)
        assert run["seconds"] < 20, (argv, run["seconds"])
