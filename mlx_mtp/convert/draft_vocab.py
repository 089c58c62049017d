"""``mlx-mtp draft-vocab``: rank a model's tokens by frequency in a corpus, for ``--draft-vocab``.

Counts every token of the corpus with the model's own tokenizer and writes
``draft_vocab.json`` beside the model (atomically; see ``models/draft_vocab.py``). The
tokenizer's added tokens (chat markers, end of turn) rank first: generated text needs them
though a plain-text corpus never holds them.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from ..models.draft import vocab as draft_vocab
from ..models.io.layout import text_config
from ..models.io import hub
from ..models.io.loader import load_config, resolve_model_path
from ..options import UserError
from ..text_corpus import _load_tokenizer, corpus_file_list, read_corpus_file

BATCH_FILES = 64


def count_tokens(tokenizer, files, vocab_size: int, max_tokens: int = 0) -> np.ndarray:
    """Per-token counts over ``files`` (stopping after ``max_tokens`` when > 0)."""
    counts = np.zeros(vocab_size, np.int64)
    for i in range(0, len(files), BATCH_FILES):
        texts = [read_corpus_file(f) for f in files[i:i + BATCH_FILES]]
        for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
            ids = np.asarray(enc.ids, np.int64)
            if ids.size and ids.max() >= vocab_size:
                raise UserError(f"the tokenizer produced id {int(ids.max())}, past the model's "
                                f"{vocab_size}-token vocabulary: is it the model's tokenizer?")
            counts += np.bincount(ids, minlength=vocab_size)
        if max_tokens and counts.sum() >= max_tokens:
            break
    return counts


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=None,
                        help="Model directory (default: the embedded demo model); the ranking "
                             "is written beside its weights")
    parser.add_argument("--corpus", default="stdlib",
                        help="Text like the prompts and outputs you expect: a directory (text "
                             "files, recursively), one file, or 'stdlib' (the CPython standard "
                             "library's training split; default)")
    parser.add_argument("--max-tokens", type=int, default=0,
                        help="Stop counting after about this many tokens (default: all)")
    parser.add_argument("--default-size", type=int, default=None,
                        help="Subset size `--draft-vocab auto` (the default of generate, serve "
                             "and bench) uses for this model; measure it first (`mlx-mtp bench "
                             "--draft-vocab N`). Default: none, drafts keep the whole vocabulary "
                             "unless --draft-vocab N is given")
    parser.add_argument("--output", default=None,
                        help=f"Write here instead of MODEL/{draft_vocab.FILE}")
    return parser


def run(args) -> int:
    if args.output is None and hub.is_repo_id(args.model):
        raise UserError(f"{args.model} is a hub id: pass --output FILE (mlx-mtp does not write "
                        "into the Hugging Face cache), or convert the model to a local directory.")
    path = resolve_model_path(args.model, files=hub.TOKENIZER_FILES)  # no weights needed
    config = load_config(path)
    vocab_size = text_config(config).get("vocab_size")
    if not isinstance(vocab_size, int):
        raise UserError(f"{path / 'config.json'} has no vocab_size.")
    if args.max_tokens < 0:
        raise UserError(f"--max-tokens must be >= 0 (got {args.max_tokens})")
    files = corpus_file_list(args.corpus, "train")
    tokenizer = _load_tokenizer(path)
    counts = count_tokens(tokenizer, files, vocab_size, args.max_tokens)
    if counts.sum() == 0:
        raise UserError(f"--corpus {args.corpus}: no tokens to count")
    added = sorted(i for i in tokenizer.get_added_tokens_decoder() if 0 <= i < vocab_size)
    try:
        out = draft_vocab.write(path, counts, corpus=str(args.corpus),
                                default_size=args.default_size, first=added, path=args.output)
    except draft_vocab.DraftVocabError as e:
        raise UserError(f"--default-size: {e}")
    except OSError as e:
        raise UserError(f"cannot write the ranking: {e}")
    ranking = draft_vocab.ranking_from_counts(counts, added)
    total = counts.sum()
    cover = ", ".join(f"{n}: {counts[ranking[:n]].sum() / total:.1%}"
                      for n in (256, 1024, 4096, 16384, 32768, 65536) if n < vocab_size)
    print(f"Counted {total:,} tokens in {len(files)} files; {int((counts > 0).sum()):,} of "
          f"{vocab_size:,} tokens occur. Share of the corpus covered by the N most frequent "
          f"({cover or 'the vocabulary is small'}). Wrote {out}", file=sys.stderr)
    return 0
