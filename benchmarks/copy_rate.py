"""Does the model repeat a module it is given? (issue 26; MODEL_CARD.md, *Copying*)

    python benchmarks/copy_rate.py [--model DIR] [--n-modules 6] [--lines 30] [-o OUT.json]

Held-out modules: ``--n-modules`` windows of exactly ``--lines`` lines from different
held-out stdlib files (the split no demo model trained on; seeded), each starting at a
top-level ``def``/``class``/import line, plus the module of the copy workload
(``mlx_mtp.bench.copy_prompts``). Each is given as one chat turn, "Here is a Python
module:\\n\\n<code>\\nRepeat it verbatim." (a phrasing the copy training data does not
use), and the answer is decoded greedily with repetition penalty 1.0 for as many tokens as
the reference answer "```python\\n<code>```" has, plus 8.

Per module: ``identical`` = the fraction of reference positions where the answer has the
same token at the same position (one inserted token shifts the rest: strict);
``aligned`` = reference tokens covered by difflib's matching blocks (forgives shifts);
``prefix`` = tokens before the first difference. Reported: each, mean and min.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path

import numpy as np

from mlx_mtp.bench.copy_prompts import _MODULE
from mlx_mtp.decode.generation import stream_generate
from mlx_mtp.decode.prompt import build_prompt, encode_prompt
from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.models.io.loader import load
from mlx_mtp.text_corpus import corpus_files, read_corpus_file

_START = re.compile(r"^(def |class |import |from |@)")


def heldout_modules(n: int, lines: int, seed: int = 0, max_chars: int = 1600):
    """``n`` windows of ``lines`` lines, each from a different held-out file."""
    files = corpus_files("heldout")
    rng = np.random.default_rng(seed)
    out = []
    for i in rng.permutation(len(files)):
        text = read_corpus_file(files[i]).splitlines()
        starts = [j for j, line in enumerate(text[:len(text) - lines]) if _START.match(line)]
        if not starts:
            continue
        j = starts[int(rng.integers(len(starts)))]
        code = "\n".join(text[j:j + lines]).rstrip() + "\n"
        if len(code) <= max_chars and code.count("\n") == lines:
            out.append((f"{files[i].name}:{j + 1}", code))
        if len(out) == n:
            break
    return out


def score(ref, got):
    n = len(ref)
    same = sum(1 for a, b in zip(ref, got) if a == b)
    prefix = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(n, len(got)))
    sm = difflib.SequenceMatcher(a=ref, b=got, autojunk=False)
    aligned = sum(b.size for b in sm.get_matching_blocks())
    return {"identical": same / n, "aligned": aligned / n, "prefix": prefix, "ref_tokens": n}


def copy_rate(model, tok, modules, max_extra: int = 8, mtp: bool = True):
    rows = []
    for name, code in modules:
        prompt = encode_prompt(tok, build_prompt(
            tok, f"Here is a Python module:\n\n{code}\nRepeat it verbatim."))
        ref = tok.encode("```python\n" + code + "```", add_special_tokens=False)
        got = [r.token for r in stream_generate(
            model, tok, prompt, max_tokens=len(ref) + max_extra,
            sampling=SamplingParams(repetition_penalty=1.0), num_draft_tokens=3 if mtp else 0)]
        rows.append({"module": name, **score(ref, got), "answer": tok.decode(got)})
    summary = {k: {"mean": float(np.mean([r[k] for r in rows])),
                   "min": float(np.min([r[k] for r in rows]))}
               for k in ("identical", "aligned", "prefix")}
    return rows, summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: the demo model)")
    p.add_argument("--n-modules", type=int, default=6)
    p.add_argument("--lines", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", default=None)
    a = p.parse_args(argv)
    model, tok = load(a.model)[:2]
    modules = heldout_modules(a.n_modules, a.lines, a.seed) + [("copy_prompts._MODULE", _MODULE)]
    rows, summary = copy_rate(model, tok, modules)
    for r in rows:
        print(f"{r['module']:40s} identical {r['identical']:6.1%}  aligned {r['aligned']:6.1%}"
              f"  prefix {r['prefix']:4d}/{r['ref_tokens']}")
    for k, v in summary.items():
        fmt = "{:.1%}" if k != "prefix" else "{:.1f}"
        print(f"{k}: mean {fmt.format(v['mean'])}, min {fmt.format(v['min'])}")
    if a.output:
        Path(a.output).write_text(json.dumps({"args": vars(a), "summary": summary, "rows": rows},
                                             indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
