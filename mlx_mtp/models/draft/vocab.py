"""Draft vocabulary: the tokens drafts may propose, ranked by how often they occur in a corpus.

Each draft token reads the whole output layer (248k rows on Qwen3.5/3.6). Restricting drafts
to the N most frequent tokens reads N rows instead; the target still scores every token, so
output never changes: the draft distribution ``q`` is zero outside the subset (a rejection
then simply recovers from the target), and only acceptance can drop, when the target's
token lies outside.

The ranking is a file beside the model (``FILE``), written by ``mlx-mtp draft-vocab``::

    {"format": "mlx-mtp draft vocabulary", "version": 1, "vocab_size": V,
     "ranking": [ids, most frequent first], "counts": [their counts],
     "tokens_counted": n, "corpus": "...", "default_size": N or null}

(``ranking`` may put some ids ahead of their count: the tokenizer's added tokens.)

``default_size`` (optional) is the subset size ``--draft-vocab auto`` uses; the command
writes it only when told (it should come from a measurement on the target hardware).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

FILE = "draft_vocab.json"
FORMAT = "mlx-mtp draft vocabulary"
VERSION = 1
# Subset sizes the shipped rankings record held-out coverage for (and the only ones the
# automatic choice considers).
COVERAGE_SIZES = (1024, 2048, 4096, 8192, 12288, 16384, 24576, 32768, 49152, 65536)


class DraftVocabError(ValueError):
    """A missing or unusable ranking file, or a size that does not fit it."""


def vocab_hash(tokens: Sequence[str]) -> str:
    """Identity of a BPE vocabulary: its token strings (as tokenizer.json spells them) in id
    order. Added tokens are left out, so Qwen3.5 and 3.6 (same BPE, other markers) match."""
    return hashlib.sha256("\n".join(tokens).encode()).hexdigest()[:32]


def ranking_from_counts(counts: np.ndarray, first: Sequence[int] = ()) -> np.ndarray:
    """Token ids by count, most frequent first (ties by id), after the ids ``first``."""
    by_count = np.argsort(-np.asarray(counts, np.int64), kind="stable")
    first = np.unique(np.asarray(first, np.int64))
    return np.concatenate([first, by_count[~np.isin(by_count, first)]])


def write(model_dir, counts: np.ndarray, corpus: str, default_size: Optional[int] = None,
          first: Sequence[int] = (), path=None) -> Path:
    """Write the ranking for per-token ``counts`` (length = the model's vocabulary), the ids
    ``first`` ahead of the rest, atomically."""
    counts = np.asarray(counts, np.int64)
    if default_size is not None and not 1 <= default_size <= counts.size:
        raise DraftVocabError(f"default size {default_size} is outside 1..{counts.size}")
    ranking = ranking_from_counts(counts, first)
    doc = {"format": FORMAT, "version": VERSION, "vocab_size": int(counts.size),
           "ranking": ranking.tolist(), "counts": counts[ranking].tolist(),
           "tokens_counted": int(counts.sum()), "corpus": corpus, "default_size": default_size}
    out = Path(path) if path is not None else Path(model_dir) / FILE
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")  # same dir: os.replace is atomic
    try:
        with open(tmp, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def read(model_dir) -> dict:
    """The ranking document beside ``model_dir`` (DraftVocabError if absent or damaged)."""
    f = Path(model_dir) / FILE
    if not f.exists():
        raise DraftVocabError(
            f"{model_dir} has no {FILE} (the token ranking --draft-vocab needs). Create it with "
            f"`mlx-mtp draft-vocab --model {model_dir} --corpus DIR` (text like the prompts you "
            "expect), or leave --draft-vocab off.")
    try:
        doc = json.loads(f.read_text())
        ok = (doc.get("format") == FORMAT and doc.get("version") == VERSION
              and isinstance(doc.get("ranking"), list))
    except (OSError, ValueError, AttributeError) as e:
        raise DraftVocabError(f"{f} is not readable: {e}. Recreate it with `mlx-mtp draft-vocab`.")
    if not ok:
        raise DraftVocabError(f"{f} is not an mlx-mtp draft vocabulary (version {VERSION}); "
                              "recreate it with `mlx-mtp draft-vocab`.")
    return doc


def parse_size(value: str):
    """``--draft-vocab`` values: "auto" (the file's default size, if any) or a token count."""
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        raise DraftVocabError(f"--draft-vocab must be a token count or 'auto' (got {value!r})")
    if n < 1:
        raise DraftVocabError(f"--draft-vocab must be at least 1 (got {n})")
    return n


def select(model_dir, size, vocab_size: int) -> Optional[np.ndarray]:
    """The ``size`` most frequent token ids, ascending (None: use the whole vocabulary).

    ``size`` "auto": the file's ``default_size``, None when there is no file or no default.
    A count needs the file. A subset as large as the vocabulary is None too.
    """
    if size is None or (size == "auto" and not (Path(model_dir) / FILE).exists()):
        return None
    doc = read(model_dir)
    if doc["vocab_size"] != vocab_size:
        raise DraftVocabError(
            f"{Path(model_dir) / FILE} ranks {doc['vocab_size']} tokens but the model has "
            f"{vocab_size}: it was made for another model. Recreate it with `mlx-mtp draft-vocab`.")
    if size == "auto":
        size = doc.get("default_size")
        if size is None:
            return None
    if size >= vocab_size:
        return None
    ranking: Sequence[int] = doc["ranking"]
    if len(ranking) != vocab_size:
        raise DraftVocabError(f"{Path(model_dir) / FILE} is truncated; recreate it.")
    return np.sort(np.asarray(ranking[:size], np.int64))
