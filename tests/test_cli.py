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
    # What --dtype auto and --draft-vocab auto chose (float32 checkpoint, no ranking).
    assert "Weights: as stored (auto: no half-precision weights); draft vocabulary: whole " \
           "vocabulary" in out


def test_generate_reads_stdin_and_runs_without_mtp(model):
    code, out, err = run("generate", "--model", model, "--prompt", "-", "-m", "5", "--no-mtp",
                         stdin="hello")
    assert code == 0, err
    assert "Generation: 5 tokens" in out and "MTP:" not in out


@pytest.mark.parametrize("args,msg", [
    (["--num-draft-tokens", "9"], "between 0 and 8"),
    (["--num-draft-tokens", "-1"], "between 0 and 8"),
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


def test_config_without_a_head_says_how_to_run_it(tiny_ckpt, tmp_path):
    """A config declaring no MTP layers: one line naming the ways to run it (before, the
    decoder's own ValueError escaped as a traceback); with them it decodes."""
    import json
    import shutil

    path = tmp_path / "nohead"
    shutil.copytree(tiny_ckpt("qwen3_5", "random", vocab_size=4096, drop_mtp=True), path)
    config = json.loads((path / "config.json").read_text())
    config.get("text_config", config)["mtp_num_hidden_layers"] = 0
    (path / "config.json").write_text(json.dumps(config))
    code, _, err = run("generate", "--model", str(path), "--prompt", "hi", "-m", "2")
    assert code == 2 and "Traceback" not in err and "no MTP layers" in err
    assert "--no-mtp" in err and "add-mtp" in err and err.count("\n") == 1
    for extra in (["--no-mtp"], ["--draft-source", "lookup"]):
        code, _, err = run("generate", "--model", str(path), "--prompt", "hi", "-m", "2", *extra)
        assert code == 0, err


def test_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    code, _, err = run("generate", "--model", str(tmp_path), "--prompt", "hi")
    assert code == 2 and "Supported model types" in err


def test_unknown_command():
    code, _, err = run("frobnicate")
    assert code == 2 and "unknown command" in err


# --- output fidelity and mlx-lm / llama-server conventions ------------------------------
def oracle_text(model, first, n):
    """What the oracle model writes: tokens first, first+1, ..., decoded."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{model}/tokenizer.json")
    return tok.decode(list(range(first, first + n)), skip_special_tokens=False)


def test_printed_text_equals_decode_of_generated_ids(model):
    # The prompt ends with token 258 ("   "); the model continues with 259 (8 spaces),
    # 260 "se", 261 (7 spaces), ...: the first token's leading spaces must all be printed.
    expected = oracle_text(model, 259, 8)
    assert expected.startswith(" " * 8)
    code, out, err = run("generate", "--model", model, "--prompt", "def f():\\n   ",
                         "--ignore-chat-template", "-m", "8", "--verbose", "False")
    assert code == 0, err
    assert out == expected + "\n"
    code, out, err = run("generate", "--model", model, "--prompt", "def f():\\n   ",
                         "--ignore-chat-template", "-m", "8")
    assert code == 0, err
    assert out.startswith("==========\n" + expected + "\n==========\nPrompt:")


def test_incomplete_utf8_bytes_print_as_decode_does(model):
    # After "a\x1f" (ending with token 219): " ", "\x7f", then lone UTF-8 continuation bytes.
    expected = oracle_text(model, 220, 6)
    assert "\ufffd" in expected
    code, out, err = run("generate", "--model", model, "--prompt", "a\x1f",
                         "--ignore-chat-template", "-m", "6", "--verbose", "F")
    assert code == 0, err
    assert out == expected + "\n"


def test_verbose_is_mlx_lm_boolean(model):
    base = ("generate", "--model", model, "--prompt", "x", "-m", "3")
    for flag, stats in ((["--verbose", "False"], False), (["--verbose", "f"], False),
                        (["--verbose", "True"], True), (["--verbose"], True), ([], True)):
        code, out, err = run(*base, *flag)
        assert code == 0, err
        assert ("Generation: 3 tokens" in out) == stats, flag


def test_unknown_flag_prints_the_subcommand_usage(model):
    code, out, err = run("generate", "--model", model, "--prompt", "x", "--no-such-flag")
    assert code == 2 and "usage: mlx-mtp generate" in err
    assert "unrecognized arguments: --no-such-flag" in err and "Traceback" not in err


def test_llama_server_speculative_flags(model):
    base = ("generate", "--model", model, "--prompt", "def f():", "-m", "8")
    code, out, err = run(*base, "--spec-type", "draft-mtp", "--spec-draft-n-max", "2",
                         "--spec-draft-n-min", "2", "--spec-draft-p-min", "0.75")
    assert code == 0, err
    assert "MTP: accepted" in out and "has no effect" in err
    code, out, err = run(*base, "--spec-type", "none")
    assert code == 0 and "MTP:" not in out, err
    code, _, err = run(*base, "--spec-type", "ngram-simple")
    assert code == 2 and "draft-mtp" in err
    code, _, err = run(*base, "--spec-draft-n-max", "3", "--spec-draft-n-min", "1")
    assert code == 2 and "--spec-draft-n-min 1 is not supported" in err


def test_generate_and_serve_build_the_same_prompt(model):
    from mlx_mtp.decode.prompt import build_prompt, chat_template_args
    from mlx_mtp.models.io.loader import load

    _, tok = load(model)
    # One default for both commands: thinking off unless asked for.
    assert chat_template_args() == {"enable_thinking": False}
    assert build_prompt(tok, "hi").endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    thinking = build_prompt(tok, "hi", template_args={"enable_thinking": True})
    assert thinking.endswith("<|im_start|>assistant\n<think>\n")
