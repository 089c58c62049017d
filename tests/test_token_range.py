"""Token ids the model cannot embed are refused, never read past the embedding table.

A tokenizer with more ids than the checkpoint's embedding rows is an error at load
(CLI: exit 2 with a message; serve: the same before it listens); a request's token-id
prompt outside the vocabulary is a 400 (see test_server_e2e's bad-input table).
"""

from pathlib import Path

import pytest

from mlx_mtp.cli import main
from mlx_mtp.models.io.loader import ModelLoadError, load, load_model, load_tokenizer
from server_process import free_port


@pytest.fixture(scope="module")
def small_vocab(tiny_ckpt):
    return str(tiny_ckpt("qwen3_5", "random"))  # 512 embedding rows, a 4096-token tokenizer


def test_load_refuses_a_tokenizer_larger_than_the_embedding_table(small_vocab):
    with pytest.raises(ModelLoadError, match=r"token ids up to 4095.* 512 rows"):
        load(small_vocab)
    # the parts still load on their own (tests that feed ids in range use them)
    model, config = load_model(Path(small_vocab))
    assert load_tokenizer(Path(small_vocab), config) is not None


def test_load_accepts_a_tokenizer_that_fits(tiny_ckpt):
    model, tok = load(str(tiny_ckpt("qwen3_5", "random", vocab_size=4096)))
    assert max(tok.get_vocab().values()) == model.text.args.vocab_size - 1


@pytest.mark.parametrize("verb", ["generate", "serve"])
def test_cli_exits_2_with_a_message(small_vocab, verb, capsys):
    args = ([verb, "--model", small_vocab, "--prompt", "hello", "-m", "2"] if verb == "generate"
            else [verb, "--model", small_vocab, "--port", str(free_port())])
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "embedding table has 512 rows" in err and "Traceback" not in err


@pytest.mark.parametrize("bad", [512, 10**6, -1])
def test_python_api_refuses_prompt_ids_outside_the_vocabulary(small_vocab, bad):
    from mlx_mtp.decode.generation import generate
    from mlx_mtp.decode.speculative import MTPDecoder

    model, config = load_model(Path(small_vocab))
    tok = load_tokenizer(Path(small_vocab), config)
    with pytest.raises(ValueError, match=f"token id {bad} is outside the vocabulary"):
        generate(model, tok, [1, 2, bad], max_tokens=2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        MTPDecoder(model, 0).prefill([bad, 3])
    MTPDecoder(model, 0).prefill([511, 0, 3])  # the first and last rows are in range
