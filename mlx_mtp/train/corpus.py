"""The demo model's training corpus: the CPython standard library plus the pure-Python
sources of the permissively licensed packages installed next to mlx-mtp.

Usage::

    python -m mlx_mtp.train.corpus OUT_DIR [--sources-json PATH] [--chat-fraction 0.2]

writes ``OUT_DIR/train/...`` and ``OUT_DIR/heldout/...`` (one file per source file, the
tree mirrored under ``stdlib/`` and ``site-packages/``) and a JSON record of every
installed distribution: version, license metadata, number and bytes of ``.py`` files, and
whether (and why not) it was used. Train with
``mlx-mtp train --corpus OUT_DIR/train --eval-corpus OUT_DIR/heldout``.

Rules (all deterministic):

* stdlib: ``tokenizer_build.corpus_files("all")`` (test directories excluded).
* packages: the ``.py`` files listed in each ``*.dist-info/RECORD`` of the environment's
  site-packages, outside test, vendored and example directories, for distributions whose
  ``License-Expression``/``License``/license classifiers name an MIT, BSD, Apache, PSF, ISC
  (or similar permissive) license and nothing copyleft (GPL, LGPL, MPL). Test and build
  tools and mlx-mtp itself are left out (``SKIP``).
* two very large, highly repetitive trees are subsampled by file (``SUBSAMPLE``) so they
  do not dominate: transformers' per-model code and openai's generated type stubs.
* held-out split by file: CRC32 of the path relative to its root (stdlib or site-packages)
  divisible by 20 -- the same rule as ``tokenizer_build`` uses for the stdlib, so the
  stdlib held-out files are the ones the earlier demo models never saw either.
* ``--chat-fraction`` of the train files (seeded RNG over the sorted list) are written
  already wrapped as a chat turn (``data._chat_wrap``), as ``--corpus stdlib`` does at
  tokenization time; directory corpora are not wrapped again by ``mlx-mtp train``.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import sys
import sysconfig
import zlib
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .data import _chat_wrap
from .tokenizer_build import HELDOUT_MODULUS, corpus_files, read_corpus_file, stdlib_root

PERMISSIVE = ("MIT", "BSD", "Apache", "PSF", "Python Software Foundation", "ISC", "CNRI",
              "0BSD", "Zlib", "CC0", "HPND")
COPYLEFT = ("GPL", "MPL", "Mozilla", "EUPL", "CDDL")
EXCLUDED_DIRS = frozenset({"test", "tests", "testing", "idle_test", "_vendor", "vendor",
                           "__pycache__", "site-packages", "dist-packages", "benchmarks",
                           "_examples"})
SKIP = {"mlx-mtp": "this project itself",
        "pip": "installer with a large vendored tree",
        "setuptools": "build tool with vendored trees",
        "pytest": "test tool", "iniconfig": "test tool", "pluggy": "test tool"}
SUBSAMPLE = ("transformers/models/", "openai/types/")  # kept when crc32(rel) % 4 == 0


def split_of(rel_posix: str) -> str:
    return "heldout" if zlib.crc32(rel_posix.encode()) % HELDOUT_MODULUS == 0 else "train"


def _kept(rel_posix: str) -> bool:
    if rel_posix.startswith(SUBSAMPLE):
        return zlib.crc32(rel_posix.encode()) % 4 == 0
    return True


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def dist_metadata(dist_info: Path) -> dict:
    """Name, version and license fields of a ``*.dist-info`` directory (headers only)."""
    name = lic = expr = None
    classifiers: List[str] = []
    meta = dist_info / "METADATA"
    text = meta.read_text(errors="replace") if meta.exists() else ""
    for line in text.splitlines():
        if not line:
            break  # end of the headers
        key, _, value = line.partition(":")
        value = value.strip()
        if key == "Name":
            name = value
        elif key == "License-Expression":
            expr = value
        elif key == "License" and lic is None:
            lic = value[:120]
        elif key == "Classifier" and value.startswith("License ::"):
            classifiers.append(value.split("::", 1)[1].strip())
    version = dist_info.name[:-len(".dist-info")].rsplit("-", 1)[-1]
    return {"name": name or dist_info.name, "version": version,
            "license": expr or lic, "classifiers": classifiers}


def is_permissive(meta: dict) -> bool:
    text = " ".join([meta.get("license") or ""] + meta.get("classifiers", []))
    return any(k in text for k in PERMISSIVE) and not any(k in text for k in COPYLEFT)


def package_files(dist_info: Path, root: Path) -> List[Tuple[str, Path]]:
    """(path relative to site-packages, path) of the distribution's corpus ``.py`` files."""
    record = dist_info / "RECORD"
    if not record.exists():
        return []
    out = []
    for row in csv.reader(record.read_text(errors="replace").splitlines()):
        if not row or not row[0].endswith(".py") or row[0].startswith(".."):
            continue
        parts = Path(row[0]).parts
        if parts[0].endswith((".dist-info", ".data")):
            continue
        if any(p in EXCLUDED_DIRS for p in parts[:-1]) or not _kept(row[0]):
            continue
        path = root / row[0]
        if path.is_file():
            out.append((Path(row[0]).as_posix(), path))
    return out


def collect(root: Optional[Path] = None) -> Tuple[List[Tuple[str, Path]], List[dict]]:
    """All corpus files as (key, path), key = ``stdlib/<rel>`` or ``site-packages/<rel>``,
    and the per-distribution record."""
    entries = [("stdlib/" + p.relative_to(stdlib_root()).as_posix(), p)
               for p in corpus_files("all")]
    root = Path(root) if root else site_packages()
    record = []
    for d in sorted(root.glob("*.dist-info")):
        meta = dist_metadata(d)
        files = package_files(d, root)
        reason = SKIP.get(meta["name"]) or ("" if is_permissive(meta) else "license not permissive")
        if not files and not reason:
            reason = "no pure-Python files"
        record.append(dict(meta, py_files=len(files),
                           py_bytes=sum(p.stat().st_size for _, p in files),
                           included=not reason, reason=reason))
        if not reason:
            entries.extend(("site-packages/" + rel, p) for rel, p in files)
    entries.sort(key=lambda e: e[0])
    return entries, record


def build(out_dir, chat_fraction: float = 0.2, seed: int = 0, root: Optional[Path] = None,
          sources_json: Optional[Path] = None) -> dict:
    """Write the corpus tree under ``out_dir`` and return the summary (also the JSON)."""
    import numpy as np

    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    entries, record = collect(root)
    rng = np.random.default_rng(seed)
    stats: Dict[str, Dict[str, int]] = {s: {"files": 0, "bytes": 0} for s in ("train", "heldout")}
    wrapped = 0
    for key, path in entries:
        text = read_corpus_file(path)
        if not text.strip():
            continue
        split = split_of(key.split("/", 1)[1])
        if split == "train" and chat_fraction > 0 and rng.random() < chat_fraction:
            text = _chat_wrap(text, path.name)
            wrapped += 1
        dst = out_dir / split / key
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(text, encoding="utf-8")
        stats[split]["files"] += 1
        stats[split]["bytes"] += len(text.encode())
    summary = {
        "description": "Training corpus of the mlx-mtp demo model (python -m mlx_mtp.train.corpus)",
        "python": sys.version.split()[0],
        "stdlib": "CPython standard library .py files (tokenizer_build.corpus_files('all'))",
        "heldout_rule": f"crc32(path relative to the stdlib or site-packages root) % "
                        f"{HELDOUT_MODULUS} == 0",
        "excluded_dirs": sorted(EXCLUDED_DIRS),
        "subsampled": {"prefixes": list(SUBSAMPLE), "rule": "kept when crc32(rel) % 4 == 0"},
        "chat_fraction": chat_fraction, "chat_wrapped_train_files": wrapped, "seed": seed,
        "splits": stats,
        "packages": record,
    }
    if sources_json:
        Path(sources_json).write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_mtp.train.corpus", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--sources-json", default=None,
                   help="write the per-package license record here (default OUT_DIR/sources.json)")
    p.add_argument("--chat-fraction", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    js = a.sources_json or str(Path(a.out_dir) / "sources.json")
    s = build(a.out_dir, a.chat_fraction, a.seed, sources_json=None)
    Path(js).parent.mkdir(parents=True, exist_ok=True)
    Path(js).write_text(json.dumps(s, indent=1) + "\n")
    print(json.dumps(s["splits"]))
    for r in s["packages"]:
        state = "used" if r["included"] else f"not used: {r['reason']}"
        print(f"  {r['name']:<22} {str(r['license'])[:36]:<36} {r['py_files']:5d} files  {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
