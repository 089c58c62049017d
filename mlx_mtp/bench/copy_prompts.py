"""Prompts whose answers repeat their context (``--prompts builtin:copy``): edits of a
given module, a summary that quotes, an answer from given documents. Context drafts
(``--draft-source lookup|both``) are made for these; the chat sets are the control."""

from __future__ import annotations

_MODULE = '''\
import json
import os


def load_settings(path, defaults):
    settings = dict(defaults)
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
        for key, value in data.items():
            if key in settings:
                settings[key] = value
    return settings


def save_settings(path, settings):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(settings, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


def merge_settings(base, override):
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_settings(merged[key], value)
        else:
            merged[key] = value
    return merged


def describe_settings(settings):
    lines = []
    for key in sorted(settings):
        lines.append(f"{key} = {settings[key]!r}")
    return "\\n".join(lines)
'''

_BUGGY = _MODULE.replace("for key in sorted(settings):", "for key in settings:").replace(
    'path + ".tmp"', 'path + "tmp"')

_ARTICLE = '''\
The city council met on Tuesday to discuss the new bicycle lanes on Harbour Street. \
"We have counted twice as many cyclists since the lanes opened," said councillor Ana Ruiz, \
"and not a single serious accident." Shop owners were less pleased. "Deliveries now block \
the road for everyone," said Tom Berg, who runs a bakery on the corner, "because the vans \
have nowhere to stop." The traffic department proposed two loading zones at the ends of the \
street. "Two zones will not be enough for forty shops," Berg replied. Ruiz suggested a trial: \
"Let us test the loading zones for three months and count again before we decide." The \
council voted seven to two in favour of the trial. "Three months is a fair test," said the \
mayor, Lena Okafor, "and we will publish the counts every week."
'''

_DOCS = '''\
[doc 1] The X200 router supports firmware updates over the web interface. Download the \
firmware file, open Settings > System > Firmware, choose the file and press Update. Do not \
switch the router off during the update, which takes about four minutes.
[doc 2] To reset the X200 to factory settings, hold the reset button on the back for ten \
seconds until the power light blinks orange. All settings, including the Wi-Fi password, \
are erased. The default password is printed on the label under the router.
[doc 3] If the X200 does not start after a firmware update, hold the reset button while \
switching the router on and keep it pressed for thirty seconds. The router then starts the \
recovery firmware, which accepts a new firmware file at the address 192.168.1.1.
'''

COPY = [
    "Here is a Python module:\n\n" + _MODULE + "\nAdd type hints to every function and "
    "return the whole module, unchanged otherwise.",
    "Here is a Python module:\n\n" + _MODULE + "\nRename `settings` to `config` everywhere "
    "(names, parameters, function names) and return the whole module.",
    "Here is a Python module with two bugs:\n\n" + _BUGGY + "\nFix the bugs and return the "
    "whole corrected module.",
    "Here is a Python module:\n\n" + _MODULE + "\nChange `describe_settings` so that it skips "
    "keys starting with an underscore, and return the whole module.",
    "Here is a Python module:\n\n" + _MODULE.replace("    ", "  ") + "\nReformat it with "
    "four-space indentation and return the whole module.",
    "Here is a news article:\n\n" + _ARTICLE + "\nSummarise the article in a few sentences, "
    "quoting each speaker's words exactly.",
    "Answer using only the documents below and quote the steps exactly as they are written.\n\n"
    + _DOCS + "\nQuestion: my X200 does not start after a firmware update. What should I do, "
    "and how do I reset it afterwards?",
]
