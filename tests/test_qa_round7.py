"""Round-7 QA of the first surfaces a user meets (docs/qa-round7.md): each test pins one
defect found there. In-process through ``cli.main`` (no child interpreters)."""

import json

import pytest

from mlx_mtp import cli


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def headless_glm(tmp_path_factory):
    """A GLM-4.5 release without its head (raw names, the head's layer dropped)."""
    from mlx_mtp.testing.tiny_attention import make_tiny

    return make_tiny(tmp_path_factory.mktemp("glm_headless"), "glm4_moe", drop_mtp=True,
                     vocab_size=4096)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    return path


def test_inspect_unsupported_family_does_not_suggest_no_mtp(capsys, llama_dir):
    code, out, _ = run_cli(capsys, "inspect", str(llama_dir))
    assert code == 0
    assert "--no-mtp only" not in out  # mlx-mtp cannot run it at all
    assert "cannot run this model_type" in out and "mlx_lm" in out


def test_inspect_headless_release_names_the_add_mtp_command(capsys, headless_glm):
    code, out, _ = run_cli(capsys, "inspect", str(headless_glm))
    assert code == 0
    assert f"mlx-mtp add-mtp --model {headless_glm} --source" in out


def test_headless_refusal_names_the_model_in_the_add_mtp_command(capsys, headless_glm):
    code, out, err = run_cli(capsys, "generate", "--model", str(headless_glm), "-p", "hi",
                             "-m", "2")
    assert code == 2 and "Traceback" not in err
    assert "model.layers.2.eh_proj.weight" in err  # the keys it expected
    assert f"mlx-mtp add-mtp --model {headless_glm} --source" in err
    assert "--model THIS" not in err


def test_no_mtp_with_a_drafter_is_refused(capsys, headless_glm):
    code, _, err = run_cli(capsys, "generate", "--model", str(headless_glm), "-p", "hi",
                           "--no-mtp", "--mtp-model", str(headless_glm))
    assert code == 2 and "--mtp-model" in err and "--no-mtp" in err


def test_top_level_help_speaks_to_users(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "dispatch to the verb's module" not in out and "speculative decoding" in out


def test_unsupported_model_type_says_what_to_use_instead(capsys, llama_dir):
    code, _, err = run_cli(capsys, "generate", "--model", str(llama_dir), "-p", "hi")
    assert code == 2 and "'llama' is not supported" in err and "mlx_lm" in err


@pytest.fixture(scope="module")
def drafter(tmp_path_factory, tiny_ckpt):
    from mlx_mtp.convert.main import convert

    root = tmp_path_factory.mktemp("pair")
    convert(str(tiny_ckpt("qwen3_5", vocab_size=4096)), str(root / "trunk"),
            split_mtp=str(root / "head"), verbose=False)
    return root / "head"  # not named as a sibling drafter: the trunk alone has no head


def test_convert_of_a_split_drafter_says_what_it_is(capsys, drafter, tmp_path):
    code, _, err = run_cli(capsys, "convert", "--hf-path", str(drafter), "--mlx-path",
                           str(tmp_path / "out"))
    assert code == 2 and "is a split MTP drafter" in err and "--mtp-model" in err
    assert len(err) < 600  # not the list of every key the trunk lacked
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_flag_with_a_default_names_it_in_help(command):
    parser = cli.build_parser(command).command_parser
    formatter = parser._get_formatter()
    silent = []
    for action in parser._actions:
        if not action.option_strings or any(action.default is v for v in (None, False, True)):
            continue
        if action.default == "==SUPPRESS==":
            continue
        text = formatter._expand_help(action) if action.help else ""
        if "default" not in text.lower() and f"({action.default})" not in text:
            silent.append(action.option_strings[0])
    assert not silent, f"{command}: --help does not name the default of {silent}"


def test_sampling_flags_have_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--top-k TOP_K Keep the K most probable tokens" in out
    assert "--max-tokens MAX_TOKENS, -m MAX_TOKENS Tokens to generate at most (default: 256)" \
        in out


def test_headless_qwen_conversion_points_to_a_split_drafter(capsys, drafter):
    # A trunk whose drafter is not named as a sibling: the refusal says how to pass it.
    trunk = drafter.parent / "trunk"
    code, _, err = run_cli(capsys, "generate", "--model", str(trunk), "-p", "hi", "-m", "2")
    assert code == 2 and "--mtp-model DRAFTER" in err
    assert f"--model {trunk} --source" in err
