"""The ``mlx-mtp generate`` command: output, stats block, and error paths (exit code 2)."""

import subprocess
import sys

import pytest


def run(*args, stdin=None):
    p = subprocess.run([sys.executable, "-m", "mlx_mtp.cli", *args], input=stdin,
                       capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return str(tiny_ckpt("qwen3_5", "oracle", trunk_scale=0.1, vocab_size=4096))


def test_generate_prints_text_and_stats(model):
    code, out, err = run("generate", "--model", model, "--prompt", "def f():", "-m", "12",
                         "--num-draft-tokens", "2", "--fixed-k")
    assert code == 0, err
    assert "Prompt:" in out and "Generation: 12 tokens" in out and "Peak memory" in out
    assert "MTP: accepted" in out and "mean acceptance length" in out


def test_generate_reads_stdin_and_runs_without_mtp(model):
    code, out, err = run("generate", "--model", model, "--prompt", "-", "-m", "5", "--no-mtp",
                         stdin="hello")
    assert code == 0, err
    assert "Generation: 5 tokens" in out and "MTP:" not in out


@pytest.mark.parametrize("args,msg", [
    (["--num-draft-tokens", "9"], "between 1 and 8"),
    (["--num-draft-tokens", "0"], "between 1 and 8"),
    (["--temp", "-1"], "temperature"),
    (["--top-p", "1.5"], "top_p"),
    (["--min-p", "2"], "min_p"),
    (["--chat-template-args", "{bad"], "not valid JSON"),
])
def test_bad_arguments_exit_2_with_message(model, args, msg):
    code, _, err = run("generate", "--model", model, "--prompt", "hi", *args)
    assert code == 2 and msg in err


def test_empty_prompt(model):
    code, _, err = run("generate", "--model", model, "--prompt", "  ")
    assert code == 2 and "prompt is empty" in err


def test_missing_mtp_weights_message_and_no_mtp_escape(tiny_ckpt):
    path = str(tiny_ckpt("qwen3_5", "random", vocab_size=4096, drop_mtp=True))
    code, _, err = run("generate", "--model", path, "--prompt", "hi", "-m", "2")
    assert code == 2 and "mtp.*" in err and "add-mtp" in err and "--no-mtp" in err
    code, out, err = run("generate", "--model", path, "--prompt", "hi", "-m", "2", "--no-mtp")
    assert code == 0, err


def test_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    code, _, err = run("generate", "--model", str(tmp_path), "--prompt", "hi")
    assert code == 2 and "Supported model types" in err


def test_unknown_command():
    code, _, err = run("frobnicate")
    assert code == 2 and "unknown command" in err
