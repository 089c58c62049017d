"""``generate --coupled``: with a seed, sampled output is the same with MTP on and off."""

import re

import pytest

from mlx_mtp.cli import main


def generate(capsys, *args):
    assert main(["generate", "--prompt", "Once upon a time", "-m", "24", "--temp", "0.6",
                 "--seed", "5", *args]) == 0
    out = capsys.readouterr().out
    text = out.split("==========\n")[1]
    accepted = re.search(r"MTP: accepted (\d+)/", out)
    return text, int(accepted.group(1)) if accepted else None


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    # the tokenizer's whole vocabulary (text prompt); a head that is partly right
    return str(tiny_ckpt("qwen3_5", "noisy", vocab_size=4096, trunk_scale=2.0, fc_noise=1.0))


def test_coupled_seeded_output_equals_no_mtp(model, capsys):
    plain, _ = generate(capsys, "--model", model, "--no-mtp")
    for k in ("1", "3"):
        text, accepted = generate(capsys, "--model", model, "--coupled", "--fixed-k",
                                  "--num-draft-tokens", k)
        assert text == plain, k
        assert accepted > 0, k  # drafts were accepted: not plain decoding in disguise
    # --coupled is a sampling flag: plain decoding takes it too (and ignores it)
    assert generate(capsys, "--model", model, "--no-mtp", "--coupled")[0] == plain


def test_serve_coupled_is_the_default_of_requests_mtp_coupled():
    """``serve --coupled`` makes coupled sampling the default; a request's mtp_coupled
    overrides it either way."""
    from types import SimpleNamespace

    from mlx_mtp.cli import build_parser
    from mlx_mtp.options import sampling_defaults
    from mlx_mtp.server.params import resolve_common
    from mlx_mtp.server.protocol import ChatCompletionRequest

    def coupled(flags, body):
        args = build_parser("serve").parse_args(["serve", *flags])
        state = SimpleNamespace(aliases={"m"}, model_name="m", vocab_size=16,
                                context_length=64, default_max_tokens=8, num_mtp_layers=1,
                                sampling_defaults=sampling_defaults(args, {}))
        req = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.7, **body})
        return resolve_common(state, req, 4, None)["sampling"].coupled

    assert coupled([], {}) is False
    assert coupled(["--coupled"], {}) is True
    assert coupled(["--coupled"], {"mtp_coupled": False}) is False
    assert coupled([], {"mtp_coupled": True}) is True
