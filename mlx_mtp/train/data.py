"""Training data for ``mlx-mtp train``: corpus files, tokenization (cached) and seeded batches."""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Sequence

import numpy as np

from ..text_corpus import TEXT_SUFFIXES, _load_tokenizer, corpus_file_list  # noqa: F401  (re-exported)

ASSETS = Path(__file__).parent.parent / "assets"
TOKENIZER_DIR = ASSETS / "tokenizer"
DEMO_MODEL_DIR = ASSETS / "demo-model"
FAMILY = "qwen3_5"
ENDOFTEXT_ID = 4087
IM_END_ID = 4089


def _user_error(msg: str):
    from ..options import UserError

    return UserError(msg)


# --------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------


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


def load_or_build_copy(run_dir: Path, files, tokenizer_dir, n_docs: int, seed: int = 0,
                       mix: str = "copy"):
    """Copy and task documents (``copydata``, ``codetasks``) built from ``files`` by
    ``mix``, tokenized; cached in the run dir."""
    from . import copydata
    from .codetasks import MIXES
    from .tokenizer_build import read_corpus_file

    name = f"{n_docs}-{seed}" if mix == "copy" else f"{mix}-{n_docs}-{seed}"
    cache = run_dir / f"tokens-copy-{name}.npz"
    kinds = np.array(copydata.KINDS if mix == "copy" else sorted(MIXES[mix]))
    if cache.exists():
        with np.load(cache) as z:
            # caches from before the answer flags, or built with other kinds, are rebuilt
            if "answer" in z and "kinds" in z and np.array_equal(z["kinds"], kinds):
                return z["ids"], z["starts"], z["answer"]
    try:
        docs = copydata.build_documents([read_corpus_file(f) for f in files], n_docs, seed,
                                        mix)
    except ValueError as e:
        raise _user_error(f"--copy-fraction: {e}")
    ids, starts, answer = copydata.tokenize_documents(
        docs, _load_tokenizer(tokenizer_dir), ENDOFTEXT_ID)
    tmp = run_dir / ".tokens-copy.tmp.npz"
    np.savez(tmp, ids=ids, starts=starts, answer=answer, kinds=kinds)
    os.replace(tmp, cache)
    return ids, starts, answer


def sample_batch(tokens: np.ndarray, batch_size: int, length: int, seed: int, step: int):
    """``batch_size`` random windows of ``length`` tokens (deterministic per step)."""
    rng = np.random.default_rng([seed, step])
    hi = len(tokens) - length
    if hi <= 0:
        raise _user_error(f"corpus has {len(tokens)} tokens; need more than seq_len+1={length}")
    starts = rng.integers(0, hi + 1, size=batch_size)
    return np.stack([tokens[s:s + length] for s in starts]).astype(np.int32)
