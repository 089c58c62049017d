"""Instruction documents built from the corpus's own functions and classes (issue 41).

A model fine-tuned only on copy documents (``copydata``) learns that a chat turn is
answered by code it was given, so every turn loops on what it saw most. These kinds ask
for code the turn does not contain, each answered by a real function or class of the
corpus (a *unit*: a whole ``def``/``class`` with its decorators, 3-40 lines, dedented):

* ``write``: a one-line request made from the unit's docstring summary (or its name), the
  answer the unit.
* ``complete``: the unit's header line(s) alone (``def fibonacci(n):``, optionally with
  its docstring), as a user pastes a signature; the answer the whole unit.

``copydata.build_documents`` mixes them with the copy kinds by a named mix (``MIXES``).
"""

from __future__ import annotations

import ast
import re
import textwrap
from typing import Dict, List, Optional

import numpy as np

TASK_KINDS = ("write", "complete")
MIN_LINES, MAX_LINES, MAX_CHARS = 3, 40, 1400
_WRITE = ("Write a Python function that {s}.", "Implement `{sig}`: {s}.",
          "Write `{name}` in Python. It should {s}.", "{S}. Write it in Python.",
          "Can you write a function that {s}?", "Python: {s}.")
_WRITE_CLASS = ("Write a Python class `{name}`: {s}.", "Implement the class `{name}` ({s}).",
                "Write a class that {s}.")
_NAMED = ("Write the function `{sig}`.", "Implement `{sig}` in Python.",
          "Write `{name}`.")


def units(text: str) -> List[str]:
    """The file's top-level and class-level functions and classes (source, dedented)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
        src = textwrap.dedent("\n".join(lines[start:node.end_lineno])) + "\n"
        n = src.count("\n")
        if MIN_LINES <= n <= MAX_LINES and len(src) <= MAX_CHARS and src.isascii():
            out.append(src)
    return out


def _header(unit: str) -> str:
    """The unit's first statement line(s): decorators and the ``def``/``class`` up to ':'."""
    out = []
    for line in unit.splitlines(True):
        out.append(line)
        if re.match(r"\s*(async\s+def|def|class)\b", line) and line.rstrip().endswith(":"):
            break
    return "".join(out)


def _summary(unit: str) -> Optional[str]:
    """The docstring's first sentence, lower-cased to follow 'that ...' (None: none usable)."""
    try:
        node = ast.parse(unit).body[0]
        doc = ast.get_docstring(node)
    except (SyntaxError, IndexError, TypeError):
        return None
    first = (doc or "").strip().split("\n\n")[0].replace("\n", " ").split(". ")[0].strip(" .")
    if not 8 <= len(first) <= 160 or not first[0].isalpha():
        return None
    return first[0].lower() + first[1:]


def _signature(unit: str) -> Dict[str, str]:
    head = _header(unit).strip().splitlines()[-1]
    m = re.match(r"(?:async\s+)?(def|class)\s+(\w+)\s*(\([^:]*\))?", head)
    name = m.group(2) if m else "f"
    return {"name": name, "sig": f"{name}{m.group(3) or '()'}" if m else name,
            "kind": m.group(1) if m else "def"}


def make_task(unit: str, kind: str, rng: np.random.Generator) -> str:
    """One chat document of ``kind`` answered by ``unit``."""
    from .copydata import chat

    if kind == "complete":
        head = _header(unit)
        doc = re.match(r'(\s+(?:"""|\'\'\')[\s\S]*?(?:"""|\'\'\')\n)', unit[len(head):])
        given = head + (doc.group(1) if doc and rng.random() < 0.3 else "")
        return chat(given.rstrip("\n"), unit)
    if kind != "write":
        raise ValueError(f"unknown task kind {kind!r}")
    sig, summary = _signature(unit), _summary(unit)
    if summary is None:
        template = _NAMED[int(rng.integers(len(_NAMED)))]
    elif sig["kind"] == "class":
        template = _WRITE_CLASS[int(rng.integers(len(_WRITE_CLASS)))]
    else:
        template = _WRITE[int(rng.integers(len(_WRITE)))]
    s = summary or ""
    return chat(template.format(s=s, S=s[:1].upper() + s[1:], **sig), unit)


# A mix: document kind -> weight. "copy" is the shipped copy fine-tune's (uniform over the
# copy kinds); "instruct" answers most turns with new code (it cost copying: 95 % -> 55 %
# identical after 80 steps); "balanced" gives verbatim repeats as much weight as requests.
MIXES = {
    "copy": {k: 1.0 for k in ("block", "repeat", "rename", "reindent", "uncomment",
                              "continue")},
    "instruct": {"write": 0.35, "complete": 0.25, "continue": 0.1, "repeat": 0.1,
                 "rename": 0.05, "reindent": 0.05, "uncomment": 0.05, "block": 0.05},
    "balanced": {"write": 0.25, "complete": 0.2, "continue": 0.1, "repeat": 0.25,
                 "rename": 0.05, "reindent": 0.05, "uncomment": 0.05, "block": 0.05},
    # from the copy fine-tune: a quarter requests, verbatim repeats the largest kind
    "mostly-copy": {"write": 0.15, "complete": 0.1, "continue": 0.1, "repeat": 0.35,
                    "rename": 0.075, "reindent": 0.075, "uncomment": 0.05, "block": 0.1},
    # from an instruction-tuned checkpoint: verbatim repeats half the rows, no "uncomment"
    # (the tuned models' copies drop or rewrite whole lines where their own code is likelier)
    "repeat-anneal": {"write": 0.1, "complete": 0.15, "continue": 0.1, "repeat": 0.45,
                      "rename": 0.05, "reindent": 0.05, "block": 0.1},
    # from repeat-anneal: its copies jumped to a phrase's second occurrence and its short
    # requests looped: most repeats have such a phrase, and requests weigh twice as much
    "recall-anneal": {"write": 0.2, "complete": 0.1, "continue": 0.1, "repeat": 0.2,
                      "repeat-ambiguous": 0.25, "rename": 0.05, "reindent": 0.05,
                      "block": 0.05},
    # from recall-anneal (N): one module still lost at a token likelier than the source's
    # (the merged "):\n" before an inline comment): a quarter of repeats show such spots
    "hard-anneal": {"write": 0.2, "complete": 0.1, "continue": 0.1, "repeat": 0.15,
                    "repeat-ambiguous": 0.15, "repeat-tricky": 0.15, "rename": 0.05,
                    "reindent": 0.05, "block": 0.05},
    # from hard-anneal (P): the "):" before an inline comment rose only from p 0.16 to 0.3 in
    # 40 steps: a fifth of the rows repeat code with comments moved inline after a ":"
    "inline-anneal": {"write": 0.2, "complete": 0.1, "continue": 0.1, "repeat": 0.05,
                      "repeat-ambiguous": 0.1, "repeat-tricky": 0.1, "repeat-inline": 0.2,
                      "rename": 0.05, "reindent": 0.05, "block": 0.05},
}
