"""Text corpora shared by ``convert draft-vocab`` and ``train``: which files a ``--corpus``
names, how they are read, and the model tokenizer that encodes them. Lives below both
subpackages so neither imports the other for it."""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path
from typing import Iterable, Iterator, List, Optional, Union

TEXT_SUFFIXES = {".py", ".pyi", ".txt", ".md", ".rst", ".c", ".h", ".cc", ".cpp", ".js", ".ts",
                 ".rs", ".go", ".java", ".json", ".toml", ".yaml", ".yml", ".sh", ".html",
                 ".css", ".tex", ".jsonl", ".cfg", ".ini"}

# Directory names whose contents are excluded from the corpus.
_EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)
HELDOUT_MODULUS = 20  # crc32(relative path) % 20 == 0 -> heldout (~5%)


def _user_error(msg: str):
    from .options import UserError

    return UserError(msg)


def stdlib_root() -> Path:
    """The running interpreter's stdlib directory."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def _split_of(rel_posix: str) -> str:
    h = zlib.crc32(rel_posix.encode("utf-8"))
    return "heldout" if h % HELDOUT_MODULUS == 0 else "train"


def corpus_files(split: str = "train", root: Optional[Union[str, Path]] = None) -> List[Path]:
    """Deterministic list of stdlib ``.py`` files for ``split``.

    ``split`` is ``"train"``, ``"heldout"`` or ``"all"``.  Files under test
    directories (``test``, ``tests``, ``idle_test``), ``site-packages`` and
    ``dist-packages`` are excluded.  A file is held out when the CRC32 of its
    stdlib-relative POSIX path is divisible by 20 (stable across runs and
    machines, unlike ``hash()``).  Sorted by relative path.
    """
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split must be 'train', 'heldout' or 'all', got {split!r}")
    root = Path(root).resolve() if root is not None else stdlib_root()
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in _EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        if not path.is_file():
            continue
        rel_posix = rel.as_posix()
        if split == "all" or _split_of(rel_posix) == split:
            out.append((rel_posix, path))
    out.sort(key=lambda t: t[0])
    return [p for _, p in out]


def read_corpus_file(path: Union[str, Path]) -> str:
    """Text of a corpus file (UTF-8; undecodable bytes become U+FFFD)."""
    return Path(path).read_bytes().decode("utf-8", errors="replace")


def iter_corpus_texts(files: Iterable[Union[str, Path]]) -> Iterator[str]:
    for f in files:
        yield read_corpus_file(f)


def _load_tokenizer(path: Path):
    from tokenizers import Tokenizer

    f = Path(path) / "tokenizer.json"
    if not f.exists():
        raise _user_error(f"No tokenizer.json in {path}")
    return Tokenizer.from_file(str(f))


def corpus_file_list(corpus: str, split: str = "train") -> List[Path]:
    """Files of ``corpus``: ``stdlib`` (the CPython standard library split), a
    directory (text files by suffix, recursively) or one file."""
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
