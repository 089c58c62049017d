"""`mlx-mtp inspect` on every layout the repo can build, and `mlx-mtp doctor`.

inspect reads headers only; its figures are checked against what loading the checkpoint
gives (tensor bytes, quantization of the head), and the command it prints for a stripped
head is run and must restore the head."""

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_mtp.cli import main
from mlx_mtp.models.draft import vocab as draft_vocab
from mlx_mtp.models.io.loader import load_model, weight_files
from mlx_mtp.testing.tiny import make_tiny
from mlx_mtp.tools.inspect_model import inspect_model, render


def run_cli(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def loaded_bytes(path) -> int:
    return sum(v.nbytes for f in weight_files(path) for v in mx.load(str(f)).values())


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("hf"), "qwen3_5", "random")


@pytest.fixture(scope="module")
def ours(hf, tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "ours"
    assert main(["convert", "--hf-path", str(hf), "--mlx-path", str(out), "-q",
                 "--mtp-bits", "8"]) == 0
    return out


@pytest.fixture(scope="module")
def stripped(hf, tmp_path_factory):
    """What mlx-community publishes: mlx-lm's own conversion (it drops mtp.*)."""
    from mlx_lm.convert import convert

    out = tmp_path_factory.mktemp("mlxlm") / "lm"
    convert(str(hf), str(out), quantize=True)
    return out


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_inspect_hugging_face_layouts(family, tmp_path):
    path = make_tiny(tmp_path, family, "random")
    r = inspect_model(str(path))
    assert (r["family"], r["layout"], r["supported"]) == (family, "hf", True)
    assert r["mtp"]["declared_layers"] == r["mtp"]["present_layers"] == 1
    assert r["mtp"]["key_prefix"] == "mtp." and r["mtp"]["precision"].keys() == {"float32"}
    assert not r["head_stripped"] and r["advice"] is None and r["draft_vocab"] is None
    assert r["memory"]["weights_bytes"] == loaded_bytes(path)
    mtp_bytes = sum(v.nbytes for f in weight_files(path) for k, v in mx.load(str(f)).items()
                    if k.startswith("mtp."))
    assert r["mtp"]["bytes"] == mtp_bytes
    # 2 of 4 trunk layers are full attention, plus the MTP layer: K and V, 2 heads of 16, 16-bit.
    assert r["memory"]["kv_bytes_per_1k_tokens"] == 1024 * 3 * 2 * 2 * 16 * 2
    assert r["memory"]["state_bytes_per_sequence"] > 0


def test_inspect_our_conversion_reports_head_precision(ours):
    r = inspect_model(str(ours))
    assert (r["layout"], r["mtp"]["present_layers"]) == ("mlx", 1)
    assert r["mtp"]["files"] == ["mtp.safetensors"]
    assert next(iter(r["trunk_precision"])) == "4-bit (group 64)"
    model, _ = load_model(ours)
    head = [m for name, m in model.named_modules()
            if ".mtp." in f".{name}." and isinstance(m, nn.QuantizedLinear)]
    assert head and {m.bits for m in head} == {8}
    assert r["mtp"]["precision"] == {"8-bit (group 64)": len(head)}
    assert r["memory"]["weights_bytes"] == loaded_bytes(ours)


def test_inspect_stripped_head_and_the_command_it_prints(stripped, hf, tmp_path, capsys):
    work = tmp_path / "lm"
    shutil.copytree(stripped, work)
    r = inspect_model(str(work))
    assert r["layout"] == "mlx" and r["head_stripped"]
    # mlx-lm writes no per-module entries: the bits come from the packed shapes.
    assert next(iter(r["trunk_precision"])) == "4-bit (group 64)"
    assert (r["mtp"]["declared_layers"], r["mtp"]["present_layers"]) == (1, 0)
    command = r["advice"].split("`")[1]
    assert command == f"mlx-mtp add-mtp --model {work} --source ORIGINAL_HF_CHECKPOINT"
    argv = command.replace("ORIGINAL_HF_CHECKPOINT", str(hf)).split()[1:]
    assert main(argv) == 0
    after = inspect_model(str(work))
    assert not after["head_stripped"] and after["mtp"]["present_layers"] == 1
    rc, out, _ = run_cli(capsys, "inspect", str(stripped))
    assert rc == 0 and "1 layer(s) declared, 0 present" in out and "add-mtp" in out


def test_inspect_split_drafter(ours, tmp_path):
    """mlx-vlm's split layout: the head's tensors without `mtp.`, no embedding of its own."""
    src = {k: v for f in weight_files(ours) for k, v in mx.load(str(f)).items()}
    head = {k[len("language_model.mtp."):]: v for k, v in src.items()
            if k.startswith("language_model.mtp.")}
    config = json.loads((ours / "config.json").read_text())
    split = tmp_path / "drafter"
    split.mkdir()
    mx.save_safetensors(str(split / "model.safetensors"), head, metadata={"format": "mlx"})
    (split / "config.json").write_text(json.dumps({
        "model_type": "qwen3_5_mtp", "text_config": config["text_config"], "block_size": 3,
        "quantization": {"group_size": 64, "bits": 8}}))
    r = inspect_model(str(split))
    assert (r["layout"], r["family"]) == ("split", "qwen3_5")
    assert r["mtp"]["present_layers"] == 1 and r["mtp"]["tensors"] == len(head)
    assert r["mtp"]["precision"] == {"8-bit (group 64)": 8}
    assert "--mtp-model" in r["advice"] and r["trunk_precision"] is None
    assert "split MTP drafter" in render(r)


def test_inspect_draft_vocab_and_json(hf, tmp_path, capsys):
    path = tmp_path / "m"
    shutil.copytree(hf, path)
    (path / draft_vocab.FILE).write_text(json.dumps(
        {"format": draft_vocab.FORMAT, "version": 1, "vocab_size": 512,
         "ranking": list(range(512)), "counts": [1] * 512, "default_size": 128}))
    rc, out, _ = run_cli(capsys, "inspect", str(path), "--json")
    assert rc == 0
    report = json.loads(out)
    assert report["draft_vocab"] == {"file": draft_vocab.FILE, "ranked_tokens": 512,
                                     "default_size": 128}


def test_inspect_bad_input(tmp_path, capsys):
    rc, _, err = run_cli(capsys, "inspect", str(tmp_path / "nope"))
    assert rc == 2 and "does not exist" in err and "Traceback" not in err
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 3)
    rc, _, err = run_cli(capsys, "inspect", str(tmp_path))
    assert rc == 2 and "not a readable safetensors file" in err


def test_doctor_reports_and_measures(capsys):
    rc, out, _ = run_cli(capsys, "doctor", "--json", "--reps", "1")
    assert rc == 0
    report = json.loads(out)
    env = report["environment"]
    assert env["mlx"] == mx.__version__ and env["device"] in ("cpu", "gpu")
    assert env["blas"].startswith("CPU matmuls") and env["llguidance"]
    m, imp = report["measured"], report["implications"]
    assert m["plain_step_ms"] > 0 and set(m["c_verify"]) == {"1", "2", "3"}
    assert all(v > 0 for v in m["c_verify"].values()) and m["c_draft"] > 0
    assert imp["k1_break_even_acceptance"] == pytest.approx(
        m["c_verify"]["1"] + m["c_draft"] - 1)
    assert imp["full_acceptance_speedup"]["1"] == pytest.approx(
        2 / (m["c_verify"]["1"] + m["c_draft"]))


def test_doctor_text_and_bad_input(capsys):
    rc, out, _ = run_cli(capsys, "doctor", "--no-measure")
    assert rc == 0 and "MLX" in out and "BLAS" in out and "plain step" not in out
    rc, _, err = run_cli(capsys, "doctor", "--reps", "0")
    assert rc == 2 and "--reps" in err
