"""Built-in prompt sets and prompt files.

Acceptance depends on what is being written: code and structured text are
predictable, free prose less so, short answers end quickly, and a long context
changes both the verify cost (attention over more keys) and prompt speed.

``--prompts`` accepts:

* ``builtin``: the first prompt of each category (code, prose, qa, long);
* ``builtin:all``: every built-in prompt;
* ``builtin:code,qa``: every prompt of the named categories;
* ``builtin:copy``: answers that repeat their context (edits of a given module, a
  quoting summary, an answer from documents: ``copy_prompts.py``);
* a file: ``.jsonl`` (one ``{"prompt": ..., "category": ...}`` per line, or a
  bare JSON string per line), ``.json`` (a list of those), or plain text
  (prompts separated by blank lines).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

from .copy_prompts import COPY


@dataclass
class Prompt:
    name: str
    category: str
    text: str


CODE = [
    "Write a Python function `merge_intervals(intervals)` that merges overlapping closed "
    "intervals given as a list of (start, end) tuples. Include a docstring, type hints and "
    "three doctest examples.",
    "Implement a least-recently-used cache class in Python with `get(key)` and `put(key, value)` "
    "methods, both O(1), using a dictionary and a doubly linked list. Add a short usage example.",
    "Write a Bash script that finds the ten largest files under a directory given as its first "
    "argument, prints their sizes in human-readable form, and exits with an error message when "
    "the directory does not exist.",
]

PROSE = [
    "Write a short story, about four paragraphs long, about a lighthouse keeper who discovers "
    "that the light has been signalling to someone across the sea for years.",
    "Write an essay that explains to a general audience why the sky is blue during the day "
    "and red at sunset. Use plain language and one everyday analogy.",
    "Describe a walk through a busy morning market in a coastal town: the sounds, the smells, "
    "the people, and how the place changes as the day gets warmer.",
]

QA = [
    "What is the capital of Australia?",
    "How many bytes are in a kibibyte?",
    "Name the largest planet in the solar system and one of its moons.",
]

_REPORT = """\
Quarterly operations review: regional delivery network

Summary. In the third quarter the network handled more parcels than in any previous quarter, \
while the share of deliveries completed on the first attempt fell slightly. Most of the \
decline came from two depots that changed their routing software in the middle of the \
quarter. Fuel costs per parcel went down because more routes were served by electric vans, \
but maintenance costs for those vans were higher than planned.

Depots. Each depot serves a fixed set of postal districts. A depot's capacity is limited by \
the number of loading bays, the size of its van fleet and the length of the evening sorting \
shift. When a depot is over capacity, parcels are held overnight and delivered the next day, \
which counts as a late delivery in the figures below.

Routing. The new routing software plans routes in the evening for the next day. It takes \
into account road works, the expected time at each stop and the charging needs of electric \
vans. Drivers at the two depots that switched reported that the first weeks produced routes \
that crossed the same districts several times; the vendor released a correction in week 9.

Staffing. Seasonal staff were hired from week 10 onward. New drivers complete a two-day \
training course and ride with an experienced driver for three days before they take their \
own route. Absence rates were close to the yearly average except in week 7, when a regional \
illness spread through two depots.

Customer contact. Complaints are logged by category. The most common categories are late \
delivery, parcel left in an unsafe place, and missing delivery notification. Complaints about \
missing notifications almost doubled after a change in the text-message provider in week 5.

The table below lists, for each depot and week, the parcels handled, the first-attempt \
success rate in percent, the number of late deliveries and the number of complaints.
"""

_DEPOTS = ["North Quay", "Hillside", "Old Mill", "Riverside"]


def _report_table() -> str:
    rows = ["depot,week,parcels,first_attempt_pct,late,complaints"]
    for w in range(1, 11):
        for d, depot in enumerate(_DEPOTS):
            # Deterministic, varied figures (no randomness: runs must be comparable).
            parcels = 4200 + 310 * d + 95 * w + (37 * w * (d + 3)) % 260
            first = 93.5 - 0.4 * (d in (1, 3) and 6 <= w <= 9) * (w - 5) + ((w * 7 + d * 3) % 11) / 10
            late = (parcels * (100 - first) / 100) * 0.35 + (w * d) % 7
            complaints = 12 + (w * 5 + d * 11) % 23 + (18 if w >= 5 and d == 2 else 0)
            rows.append(f"{depot},{w},{parcels},{first:.1f},{late:.0f},{complaints}")
    return "\n".join(rows)


LONG = [
    _REPORT + "\n" + _report_table() + "\n\nUsing the review and the table, explain which "
    "depots had the weakest first-attempt rates during weeks 6 to 9, what the review suggests "
    "as the cause, and what the operations team should check next quarter.",
]

BUILTIN: Dict[str, List[str]] = {"code": CODE, "prose": PROSE, "qa": QA, "long": LONG}
# Named sets outside ``builtin`` / ``builtin:all``: answers that repeat their context.
EXTRA: Dict[str, List[str]] = {"copy": COPY}


def builtin_prompts(spec: str = "builtin") -> List[Prompt]:
    """Prompts for ``builtin``, ``builtin:all`` or ``builtin:<cat>[,<cat>...]``."""
    _, _, sel = spec.partition(":")
    if not sel:
        return [Prompt(f"{cat}-1", cat, texts[0]) for cat, texts in BUILTIN.items()]
    cats = list(BUILTIN) if sel == "all" else [c.strip() for c in sel.split(",") if c.strip()]
    sets = {**BUILTIN, **EXTRA}
    unknown = [c for c in cats if c not in sets]
    if unknown:
        raise ValueError(f"unknown built-in prompt set(s) {', '.join(unknown)}; "
                         f"choose from {', '.join(sets)} or 'all'")
    return [Prompt(f"{c}-{i + 1}", c, t) for c in cats for i, t in enumerate(sets[c])]


def _from_record(rec, i: int, default_cat: str) -> Prompt:
    if isinstance(rec, str):
        return Prompt(f"{default_cat}-{i + 1}", default_cat, rec)
    if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
        cat = str(rec.get("category", default_cat))
        return Prompt(str(rec.get("name", f"{cat}-{i + 1}")), cat, rec["prompt"])
    raise ValueError(f"prompt #{i + 1}: expected a string or an object with a 'prompt' string")


def load_prompts(spec: str) -> List[Prompt]:
    """Prompts from a ``--prompts`` value (see the module docstring)."""
    if spec == "builtin" or spec.startswith("builtin:"):
        return builtin_prompts(spec)
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(f"prompt file {spec!r} does not exist "
                         "(or use builtin, builtin:all, builtin:code,prose,qa,long)")
    text = path.read_text(encoding="utf-8")
    stem = path.stem
    if path.suffix == ".jsonl":
        recs = [json.loads(line) for line in text.splitlines() if line.strip()]
    elif path.suffix == ".json":
        recs = json.loads(text)
        if not isinstance(recs, list):
            raise ValueError(f"{spec}: expected a JSON list of prompts")
    else:
        recs = [block.strip() for block in text.split("\n\n") if block.strip()]
    prompts = [_from_record(r, i, stem) for i, r in enumerate(recs)]
    if not prompts:
        raise ValueError(f"{spec} contains no prompts")
    return prompts
