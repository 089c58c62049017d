"""Training data for ``mlx-mtp train``: corpus files, tokenization (cached) and seeded batches."""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Sequence

import numpy as np

ASSETS = Path(__file__).parent.parent / "assets"
TOKENIZER_DIR = ASSETS / "tokenizer"
DEMO_MODEL_DIR = ASSETS / "demo-model"
FAMILY = "qwen3_5"
ENDOFTEXT_ID = 4087
IM_END_ID = 4089
TEXT_SUFFIXES = {".py", ".pyi", ".txt", ".md", ".rst", ".c", ".h", ".cc", ".cpp", ".js", ".ts",
                 ".rs", ".go", ".java", ".json", ".toml", ".yaml", ".yml", ".sh", ".html",
                 ".css", ".tex", ".jsonl", ".cfg", ".ini"}


def _user_error(msg: str):
    from ..options import UserError

    return UserError(msg)


# --------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------


def _load_tokenizer(path: Path):
    from tokenizers import Tokenizer

    f = Path(path) / "tokenizer.json"
    if not f.exists():
        raise _user_error(f"No tokenizer.json in {path}")
    return Tokenizer.from_file(str(f))


def corpus_file_list(corpus: str, split: str = "train") -> List[Path]:
    """Files of ``corpus``: ``stdlib`` (the CPython standard library split), a
    directory (text files by suffix, recursively) or one file."""
    from .tokenizer_build import corpus_files

    if corpus == "stdlib":
        return corpus_files(split)
    p = Path(corpus).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise _user_error(f"--corpus {corpus}: no text files ({', '.join(sorted(TEXT_SUFFIXES))}) found")
        return files
    raise _user_error(f"--corpus must be 'stdlib', a directory or a file (got {corpus!r}: not found)")


def _chat_wrap(text: str, rel: str) -> str:
    """A chat-formatted training document (ChatML, as the shipped chat template renders)."""
    module = rel[:-3].replace("/", ".") if rel.endswith(".py") else rel
    user = f"Write the Python module `{module}`."
    return (f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
            f"<think>\n\n</think>\n\n```python\n{text}```<|im_end|>\n")


def tokenize_corpus(files: Sequence[Path], tokenizer_dir: Path = TOKENIZER_DIR,
                    chat_fraction: float = 0.0, seed: int = 0) -> np.ndarray:
    """All files tokenized and concatenated, each followed by <|endoftext|>.

    ``chat_fraction`` of the documents (chosen by a seeded RNG) are wrapped as a
    chat turn so the model also follows the chat template.
    """
    from .tokenizer_build import read_corpus_file

    tok = _load_tokenizer(tokenizer_dir)
    rng = np.random.default_rng(seed)
    texts = []
    for f in files:
        t = read_corpus_file(f)
        if chat_fraction > 0 and rng.random() < chat_fraction:
            t = _chat_wrap(t, Path(f).name)
        texts.append(t)
    ids: List[np.ndarray] = []
    for i in range(0, len(texts), 64):
        for enc in tok.encode_batch(texts[i:i + 64], add_special_tokens=False):
            ids.append(np.asarray(enc.ids, dtype=np.int32))
            ids.append(np.array([ENDOFTEXT_ID], np.int32))
    out = np.concatenate(ids) if ids else np.zeros(0, np.int32)
    return out.astype(np.uint16 if out.size and out.max() < 65535 else np.int32)


def load_or_tokenize(run_dir: Path, name: str, files, tokenizer_dir, chat_fraction=0.0,
                     seed=0) -> np.ndarray:
    cache = run_dir / f"tokens-{name}.npy"
    if cache.exists():
        return np.load(cache)
    ids = tokenize_corpus(files, tokenizer_dir, chat_fraction, seed)
    tmp = run_dir / f".tokens-{name}.tmp.npy"
    np.save(tmp, ids)
    os.replace(tmp, cache)
    return ids


def sample_batch(tokens: np.ndarray, batch_size: int, length: int, seed: int, step: int):
    """``batch_size`` random windows of ``length`` tokens (deterministic per step)."""
    rng = np.random.default_rng([seed, step])
    hi = len(tokens) - length
    if hi <= 0:
        raise _user_error(f"corpus has {len(tokens)} tokens; need more than seq_len+1={length}")
    starts = rng.integers(0, hi + 1, size=batch_size)
    return np.stack([tokens[s:s + length] for s in starts]).astype(np.int32)
