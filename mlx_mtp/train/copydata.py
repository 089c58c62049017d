"""Copy-rich training documents: a model that has only seen fresh code never learns to
repeat its context, so ``mlx-mtp train --copy-fraction F`` mixes in documents whose second
half repeats (or lightly edits) their first half.

Kinds (each a seeded choice per document, from a code snippet of 6-40 lines):

* ``block``: the snippet, a separator comment, the snippet again (no chat).
* ``repeat``: a user turn giving the snippet and asking for it verbatim; the answer is it.
* ``repeat-ambiguous`` (task mixes only): a ``repeat`` of a snippet in which a phrase occurs
  twice with different continuations (``ambiguous_phrase``): a copy that matches only its
  last few tokens jumps to the other occurrence and continues from there.
* ``repeat-tricky`` (task mixes only): a ``repeat`` of a snippet where the likelier token
  is not the source's (``tricky_copy``): an inline comment after a ``:`` (the merged token
  ``):\n`` is likelier than ``):``) or an identifier sharing a prefix with an earlier one
  (``merged`` then ``merge_settings``).
* ``repeat-inline`` (task mixes only): a ``repeat`` of a snippet whose comment lines that
  follow a line ending in ``:`` are moved onto that line as inline comments
  (``inline_comments``), the spot where ``):\n`` outbids the source's ``):``.
* ``rename``: asks to rename an identifier the snippet uses; the answer is the renamed code.
* ``reindent``: the snippet with 2-space indentation, asked back with 4 spaces.
* ``uncomment``: asks for the snippet without its comment lines.
* ``continue``: a user turn of bare code, no request; the answer continues it. Without it,
  every chat turn of the mix asks for code back, and a model trained on answers only learns
  to echo any code it is sent.

Chat documents are ChatML as the demo model's template renders them (empty think block),
with the code given fenced or bare and the request before or after it.

Each document's *answer* is what follows its last marker (the assistant turn, or the
separator comment): ``--copy-context-weight`` scales the loss on everything before it, so a
run can spend its gradient on the copying rather than on predicting fresh code again.
"""

from __future__ import annotations

import keyword
import re
from typing import List, Optional, Sequence, Tuple

import numpy as np

KINDS = ("block", "repeat", "rename", "reindent", "uncomment", "continue")
MIN_LINES, MAX_LINES, MAX_CHARS = 6, 40, 1400
_IDENT = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")
_WORD = re.compile(r"\w+|[^\w\s]")
_ASK_REPEAT = ("Repeat this module verbatim.", "Return the code below exactly as it is.",
               "Copy this code without changing anything.", "Repeat the following code.",
               "Please write this Python code back to me unchanged.",
               "Here is a module. Repeat it.")
_RENAME_SUFFIX = ("_value", "_item", "_obj", "2", "_new", "_data")
_SEPARATOR = "# --- the same code again ---\n"
_ANSWER_MARKERS = ("<|im_start|>assistant\n", _SEPARATOR)


def chat(user: str, answer: str) -> str:
    return (f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
            f"<think>\n\n</think>\n\n```python\n{answer}```<|im_end|>\n")


def snippet(text: str, rng: np.random.Generator) -> str:
    """A window of whole lines from ``text`` (6-40 lines, at most MAX_CHARS), ending in \\n;
    empty if the text has too few non-blank lines."""
    lines = text.splitlines()
    if sum(1 for line in lines if line.strip()) < MIN_LINES:
        return ""
    n = int(rng.integers(MIN_LINES, MAX_LINES + 1))
    start = int(rng.integers(0, max(1, len(lines) - n + 1)))
    out: List[str] = []
    size = 0
    for line in lines[start:start + n]:
        if size + len(line) + 1 > MAX_CHARS and out:
            break
        out.append(line)
        size += len(line) + 1
    while out and not out[0].strip():
        out.pop(0)
    while out and not out[-1].strip():
        out.pop()
    return "\n".join(out) + "\n" if len(out) >= 3 else ""


def renamable(code: str) -> List[str]:
    """Identifiers used at least twice, not keywords or builtins-like dunders."""
    counts: dict = {}
    for name in _IDENT.findall(code):
        if len(name) > 2 and not keyword.iskeyword(name) and not name.startswith("__"):
            counts[name] = counts.get(name, 0) + 1
    return sorted(n for n, c in counts.items() if c >= 2)


def ambiguous_phrase(code: str, n: int = 6) -> bool:
    """Whether a run of ``n`` words/punctuation marks occurs twice in ``code`` followed by
    different words (``def f(x, memo):`` then ``def g(x, memo):``)."""
    words = _WORD.findall(code)
    follows: dict = {}
    for i in range(len(words) - n):
        if follows.setdefault(tuple(words[i:i + n]), words[i + n]) != words[i + n]:
            return True
    return False


_INLINE_COMMENT = re.compile(r":[ \t]+#")


def tricky_copy(code: str, prefix: int = 5, recent: int = 12) -> bool:
    """Whether ``code`` has an inline comment after a ``:``, or an identifier sharing its
    first ``prefix`` characters with another among the last ``recent`` identifiers of at
    least ``prefix`` characters, neither a prefix of the other (``merged`` then
    ``merge_settings``)."""
    if _INLINE_COMMENT.search(code):
        return True
    names = [n for n in _IDENT.findall(code) if len(n) >= prefix and not keyword.iskeyword(n)]
    for i, name in enumerate(names):
        for prev in names[max(0, i - recent):i]:
            if prev[:prefix] == name[:prefix] and not (name.startswith(prev)
                                                       or prev.startswith(name)):
                return True
    return False


_COMMENT_AFTER_COLON = re.compile(r"(?m)^([^#\n]*:)[ \t]*\n[ \t]+(#[^\n]*)$")


def inline_comments(code: str, gap: str = " ") -> str:
    """``code`` with each comment line that follows a line ending in ``:`` moved onto that
    line, ``gap`` before the ``#``."""
    return _COMMENT_AFTER_COLON.sub(lambda m: f"{m.group(1)}{gap}{m.group(2)}", code)


def rename(code: str, old: str, new: str) -> str:
    return re.sub(rf"\b{re.escape(old)}\b", new, code)


def _ask(rng, request: str, code: str) -> str:
    shown = f"```python\n{code}```" if rng.random() < 0.5 else code
    if rng.random() < 0.5:
        return f"{request}\n\n{shown}"
    return f"Here is a Python module:\n\n{shown}\n{request}"


def make_document(code: str, kind: str, rng: np.random.Generator) -> str:
    """One training document of ``kind`` built from ``code`` (a snippet)."""
    if kind == "block":
        return f"{code}\n{_SEPARATOR}{code}"
    if kind == "repeat-inline":
        code = inline_comments(code, "  " if rng.random() < 0.5 else " ")
        kind = "repeat"
    if kind in ("repeat", "repeat-ambiguous", "repeat-tricky"):
        return chat(_ask(rng, _ASK_REPEAT[int(rng.integers(len(_ASK_REPEAT)))], code), code)
    if kind == "rename":
        names = renamable(code)
        if not names:
            return make_document(code, "repeat", rng)
        old = names[int(rng.integers(len(names)))]
        new = old + _RENAME_SUFFIX[int(rng.integers(len(_RENAME_SUFFIX)))]
        if new in code:
            return make_document(code, "repeat", rng)
        return chat(_ask(rng, f"Rename `{old}` to `{new}` everywhere and return the whole "
                              "code.", code), rename(code, old, new))
    if kind == "reindent":
        two = re.sub(r"(?m)^((?:    )+)", lambda m: "  " * (len(m.group(1)) // 4), code)
        return chat(_ask(rng, "Reformat it with four-space indentation and return the whole "
                              "code.", two), code)
    if kind == "uncomment":
        bare = "".join(line for line in code.splitlines(True) if not line.lstrip().startswith("#"))
        return chat(_ask(rng, "Remove the comment lines and return the rest unchanged.", code),
                    bare)
    if kind == "continue":
        lines = code.splitlines(True)
        cut = int(rng.integers(1, len(lines)))
        return chat("".join(lines[:cut]), "".join(lines[cut:]))
    raise ValueError(f"unknown copy document kind {kind!r}")


def _draw_kind(rng: np.random.Generator, mix: str) -> str:
    from .codetasks import MIXES

    if mix == "copy":  # the shipped copy fine-tune's draw, so its record reproduces
        return KINDS[int(rng.integers(len(KINDS)))]
    kinds, weights = zip(*MIXES[mix].items())
    return kinds[int(rng.choice(len(kinds), p=np.asarray(weights) / sum(weights)))]


# the repeat kinds whose snippet must pass a test, and the test
_PICKY = {"repeat-ambiguous": ambiguous_phrase, "repeat-tricky": tricky_copy,
          "repeat-inline": lambda code: bool(_COMMENT_AFTER_COLON.search(code))}


def _picky_snippet(texts: Sequence[str], rng: np.random.Generator, test, tries: int = 20
                   ) -> str:
    """A snippet passing ``test``, from the first of ``tries`` drawn texts that gives one
    (empty if none does)."""
    for _ in range(tries):
        code = snippet(texts[int(rng.integers(len(texts)))], rng)
        if code and test(code):
            return code
    return ""


def build_documents(texts: Sequence[str], n_docs: int, seed: int = 0, mix: str = "copy"
                    ) -> List[str]:
    """``n_docs`` documents from ``texts`` (seeded: same inputs, same output), their kinds
    drawn by ``mix`` (``codetasks.MIXES``): copy kinds from snippets, task kinds from whole
    functions and classes."""
    from .codetasks import TASK_KINDS, make_task, units

    rng = np.random.default_rng(seed)
    docs: List[str] = []
    usable = [t for t in texts if t.strip()]
    if not usable:
        raise ValueError("no text to build copy documents from")
    unit_cache: dict = {}
    tries = 0
    while len(docs) < n_docs and tries < 20 * n_docs:
        tries += 1
        i = int(rng.integers(len(usable)))
        # the copy mix draws its kind after the snippet, as the shipped fine-tune did
        kind = None if mix == "copy" else _draw_kind(rng, mix)
        if kind in TASK_KINDS:
            found = unit_cache.setdefault(i, units(usable[i]))
            if found:
                docs.append(make_task(found[int(rng.integers(len(found)))], kind, rng))
            continue
        code = (_picky_snippet(usable, rng, _PICKY[kind]) if kind in _PICKY
                else snippet(usable[i], rng))
        if code:
            docs.append(make_document(code, kind or _draw_kind(rng, mix), rng))
    if len(docs) < n_docs:
        raise ValueError(f"only {len(docs)} of {n_docs} copy documents could be built "
                         f"(texts too short: need >= {MIN_LINES} lines)")
    return docs


def answer_start(doc: str) -> int:
    """Character offset where ``doc``'s answer begins (after its last marker)."""
    return max(doc.rfind(m) + len(m) for m in _ANSWER_MARKERS if m in doc)


def tokenize_documents(docs: Sequence[str], tok, eot_id: int
                       ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Concatenated ids (each document followed by ``eot_id``), each document's start, and
    a per-token flag: 1 on answer tokens (and the closing ``eot_id``), 0 before them."""
    ids: List[np.ndarray] = []
    answer: List[np.ndarray] = []
    starts = []
    pos = 0
    for i in range(0, len(docs), 64):
        batch = list(docs[i:i + 64])
        for doc, enc in zip(batch, tok.encode_batch(batch, add_special_tokens=False)):
            starts.append(pos)
            ids.append(np.asarray(enc.ids + [eot_id], dtype=np.int32))
            begin = answer_start(doc)
            answer.append(np.asarray([o[0] >= begin for o in enc.offsets] + [True], np.uint8))
            pos += len(ids[-1])
    return np.concatenate(ids), np.asarray(starts, dtype=np.int64), np.concatenate(answer)


def mixed_batch(base: np.ndarray, copy: np.ndarray, copy_starts: np.ndarray, fraction: float,
                batch_size: int, length: int, seed: int, step: int,
                answer: Optional[np.ndarray] = None, context_weight: float = 1.0,
                copyable: Optional[np.ndarray] = None
                ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, weights, hard), each (batch_size, length): each row, with probability
    ``fraction``, a window of the copy stream starting at a document start (so the repeated
    part follows its source), else a random window of ``base``. A token's weight scales the
    loss of predicting it: ``context_weight`` on copy tokens ``answer`` does not flag, else 1.
    ``hard`` is 1 on the copy tokens ``copyable`` flags (``hardmine.copyable_flags``), else 0.
    Deterministic per (seed, step), so resuming replays it."""
    rng = np.random.default_rng([seed, step, 1])
    usable = copy_starts[copy_starts <= len(copy) - length]
    if len(base) <= length or (fraction > 0 and len(usable) == 0):
        raise ValueError(f"too few tokens for windows of {length}")
    rows, weights = [], np.ones((batch_size, length), np.float32)
    hard = np.zeros((batch_size, length), np.uint8)
    for r in range(batch_size):
        if rng.random() < fraction:
            s = int(usable[int(rng.integers(len(usable)))])
            rows.append(copy[s:s + length])
            if answer is not None:
                weights[r] = np.where(answer[s:s + length], 1.0, context_weight)
            if copyable is not None:
                hard[r] = copyable[s:s + length]
        else:
            s = int(rng.integers(0, len(base) - length + 1))
            rows.append(base[s:s + length])
    return np.stack(rows).astype(np.int32), weights, hard
