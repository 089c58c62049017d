"""What the structured-output tests share: a tiny checkpoint whose head mostly agrees with
its trunk (drafts get accepted), its tokenizer, and grammars compiled for it.
Import the fixtures by name (``from grammar_fixtures import ckpt, tok``)."""

from pathlib import Path

import pytest
from mlx_lm.utils import load_tokenizer

from mlx_mtp.decode import grammar as G

VOCAB = 4096  # the test tokenizer's vocabulary


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    # A head that agrees with the trunk most of the time: drafts get accepted.
    return tiny_ckpt("qwen3_5", "noisy", trunk_scale=0.1, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def tok(ckpt):
    return load_tokenizer(Path(ckpt))


def grammar(tok, text):
    return G.Grammar(tok, text, VOCAB, sorted(tok.eos_token_ids))
