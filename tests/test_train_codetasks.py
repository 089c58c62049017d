"""Instruction documents for the demo model (``mlx_mtp.train.codetasks``, issue 41) and the
``--copy-mix`` that mixes them with the copy kinds."""

import ast
import re
import textwrap

import numpy as np

from mlx_mtp.train import codetasks as K
from mlx_mtp.train import copydata as C
from mlx_mtp.train import data as D
from mlx_mtp.train.data import TOKENIZER_DIR, _load_tokenizer

CODE = '''\
import os


@staticmethod
def parse_date(text, sep="-"):
    """Parse a date written as year-month-day.

    Longer explanation that is not part of the request.
    """
    year, month, day = text.split(sep)
    return int(year), int(month), int(day)


class Stack:
    """A last-in, first-out stack of items."""

    def __init__(self):
        self.items = []

    def push(self, item):
        """Put an item on top."""
        self.items.append(item)

    def pop(self):
        return self.items.pop()


def tiny():
    return 1
'''

DOC = re.compile(r"^<\|im_start\|>user\n(.*)<\|im_end\|>\n<\|im_start\|>assistant\n<think>\n\n"
                 r"</think>\n\n```python\n(.*)```<\|im_end\|>\n$", re.S)


def _turns(doc):
    m = DOC.match(doc)
    assert m, doc
    return m.group(1), m.group(2)


def test_units_are_whole_parseable_definitions_with_their_decorators():
    found = K.units(CODE)
    assert found[0].startswith("@staticmethod\ndef parse_date(")
    assert any(u.startswith("class Stack:") for u in found)
    assert any(u.startswith("def push(self, item):") for u in found)  # dedented methods
    assert not any(u.startswith("def tiny") for u in found)  # under MIN_LINES
    for u in found:  # each is a definition of the file, as written there
        assert isinstance(ast.parse(u).body[0], (ast.FunctionDef, ast.ClassDef))
        assert u in CODE or textwrap.indent(u, "    ", lambda line: line.strip()) in CODE
    assert K.units("def broken(:\n") == []


def test_write_asks_from_the_docstring_summary_and_answers_the_unit():
    rng = np.random.default_rng(0)
    unit = K.units(CODE)[0]
    for _ in range(10):
        user, answer = _turns(K.make_task(unit, "write", rng))
        assert answer == unit
        assert "year-month-day" in user or "parse_date" in user
        assert "Longer explanation" not in user and "int(year)" not in user
    stack = next(u for u in K.units(CODE) if u.startswith("class"))
    user, _ = _turns(K.make_task(stack, "write", rng))
    assert "last-in, first-out" in user


def test_complete_gives_the_header_and_answers_the_whole_unit():
    rng = np.random.default_rng(1)
    unit = K.units(CODE)[0]
    users = set()
    for _ in range(20):
        user, answer = _turns(K.make_task(unit, "complete", rng))
        assert answer == unit and unit.startswith(user) and len(user) < len(unit)
        users.add(user)
    assert users == {'@staticmethod\ndef parse_date(text, sep="-"):',
                     '@staticmethod\ndef parse_date(text, sep="-"):\n    """Parse a date written '
                     'as year-month-day.\n\n    Longer explanation that is not part of the '
                     'request.\n    """'}


def test_instruct_mix_draws_kinds_by_weight_and_is_seeded():
    texts = [CODE] * 4
    docs = C.build_documents(texts, 400, seed=0, mix="instruct")
    assert docs == C.build_documents(texts, 400, seed=0, mix="instruct")
    units = set(K.units(CODE))
    tasks = [d for d in docs if DOC.match(d) and _turns(d)[1] in units
             and not any(a in d for a in C._ASK_REPEAT)]
    share = len(tasks) / len(docs)
    task_weight = sum(K.MIXES["instruct"][k] for k in K.TASK_KINDS)
    assert abs(share - task_weight) < 0.12, share


def test_copy_mix_is_the_shipped_uniform_draw():
    """``mix="copy"`` builds exactly what the shipped fine-tune's builder built: a snippet,
    then a kind drawn uniformly (the loop as it was, re-stated here)."""
    texts = [CODE * 3, CODE]
    rng = np.random.default_rng(5)
    expected = []
    while len(expected) < 30:
        code = C.snippet(texts[int(rng.integers(len(texts)))], rng)
        if code:
            expected.append(C.make_document(code, C.KINDS[int(rng.integers(len(C.KINDS)))], rng))
    assert C.build_documents(texts, 30, seed=5) == expected


def test_instruct_cache_is_its_own(tmp_path):
    src = tmp_path / "code.py"
    src.write_text(CODE * 4)
    ids, starts, answer = D.load_or_build_copy(tmp_path, [src], TOKENIZER_DIR, 20, mix="instruct")
    assert (tmp_path / "tokens-copy-instruct-20-0.npz").exists()
    tok = _load_tokenizer(TOKENIZER_DIR)
    first = tok.decode(ids[starts[0]:starts[1]].tolist())
    flagged = tok.decode(ids[starts[0]:starts[1]][answer[starts[0]:starts[1]] == 1].tolist())
    assert "```python" in first and flagged.strip() and flagged in first


def test_repeat_anneal_mix_is_half_verbatim_repeats_and_never_drops_lines():
    docs = C.build_documents([CODE * 3], 400, seed=0, mix="repeat-anneal")
    repeats = [d for d in docs if any(a in d for a in C._ASK_REPEAT)]
    assert abs(len(repeats) / len(docs) - K.MIXES["repeat-anneal"]["repeat"]) < 0.08
    for d in repeats:  # the answer is the code given, character for character
        user, answer = _turns(d)
        assert answer in user
    assert not any("Remove the comment lines" in d for d in docs)


PLAIN = "".join(f"value_{i} = {i}\n" for i in range(40))  # no phrase occurs twice
MEMO = """\
def _deepcopy_method(x, memo):  # copy instance methods
    return type(x)(x.__func__, deepcopy(x.__self__, memo))


def _keep_alive(x, memo):
    \"\"\"Keeps a reference to the object x in the memo.\"\"\"
    try:
        memo[id(memo)].append(x)
    except KeyError:
        memo[id(memo)] = [x]
"""


def test_ambiguous_phrase_is_a_run_seen_twice_with_different_continuations():
    assert C.ambiguous_phrase(MEMO)
    # the same run continued the same way both times leaves a copy nothing to confuse
    assert not C.ambiguous_phrase("def f(x, memo):\n    return x\ndef g(x, memo):\n    return x\n")
    assert not C.ambiguous_phrase(PLAIN)


def test_recall_anneal_mix_adds_ambiguous_repeats_and_requests():
    """Against repeat-anneal on the same texts (as many verbatim repeats): more of the
    repeats are of code with an ambiguous phrase, and twice the share of one-line requests."""
    def ambiguous_repeats(mix):
        docs = C.build_documents([MEMO, PLAIN], 600, seed=0, mix=mix)
        repeats = [_turns(d) for d in docs if any(a in d for a in C._ASK_REPEAT)]
        assert all(answer in user for user, answer in repeats)
        return sum(C.ambiguous_phrase(answer) for _, answer in repeats) / len(repeats)

    new, old = ambiguous_repeats("recall-anneal"), ambiguous_repeats("repeat-anneal")
    assert new > old + 0.15, (new, old)

    def requests(mix):  # a one-line request (not a pasted header) answered by a unit
        docs = [_turns(d) for d in C.build_documents([CODE * 3, MEMO], 400, seed=0, mix=mix)
                if DOC.match(d)]
        return sum(user.count("\n") == 0 and answer in units
                   and not user.startswith(("def ", "class ", "@")) for user, answer in docs)

    units = set(K.units(CODE)) | set(K.units(MEMO))
    assert requests("recall-anneal") > 1.5 * requests("repeat-anneal") > 0
