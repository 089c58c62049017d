"""``--draft-source`` on the command line: same text as plain decoding, clear errors. The
CLI runs in this process (the ``cli`` fixture): exit codes and output are all a case needs."""

import pytest


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return str(tiny_ckpt("qwen3_5", "oracle", trunk_scale=0.1, vocab_size=4096))


def _text(out):
    return out.split("==========")[1]


def test_draft_sources_print_the_same_text_as_plain_decoding(model, cli):
    prompt = "a b c d a b c d a b c d a b c d a b c"
    common = ("generate", "--model", model, "--prompt", prompt, "-m", "24",
              "--ignore-chat-template")
    code, plain, err = cli(*common, "--no-mtp")
    assert code == 0, err
    for extra in (["--draft-source", "lookup"], ["--draft-source", "both", "--fixed-k"],
                  ["--draft-source", "lookup", "--lookup-max-draft", "32",
                   "--lookup-min-match", "1"]):
        code, out, err = cli(*common, *extra)
        assert code == 0, err
        assert _text(out) == _text(plain), extra
        assert "Generation: 24 tokens" in out


def test_num_draft_tokens_0_drafts_from_no_source(model, cli):
    """Issue 43: --num-draft-tokens 0 under the default source (both) is plain decoding."""
    prompt = "a b c d a b c d a b c d a b c d a b c"
    common = ("generate", "--model", model, "--prompt", prompt, "-m", "24",
              "--ignore-chat-template")
    code, plain, err = cli(*common, "--no-mtp")
    assert code == 0, err
    code, out, err = cli(*common, "--num-draft-tokens", "0")
    assert code == 0, err
    assert _text(out) == _text(plain) and "MTP:" not in out  # nothing drafted
    code, out, err = cli(*common, "--num-draft-tokens", "0", "--draft-source", "mtp")
    assert code == 0 and _text(out) == _text(plain) and "MTP:" not in out, err


@pytest.mark.parametrize("args,msg", [
    (["--no-mtp", "--draft-source", "both"], "--draft-source lookup"),
    (["--num-draft-tokens", "0", "--draft-source", "lookup"], "turns drafting off"),
    (["--draft-source", "lookup", "--lookup-max-draft", "40"], "--lookup-max-draft"),
    (["--draft-source", "ngram"], "invalid choice"),
])
def test_bad_draft_source_options_exit_2(model, args, msg, cli):
    code, out, err = cli("generate", "--model", model, "--prompt", "x", "-m", "2", *args)
    assert code == 2 and msg in err and "Traceback" not in err, err
