"""Reasoning and tool-call parsing for Qwen output (streaming and whole-text).

One state machine over the decoded text, fed in arbitrary pieces:

* ``reasoning``: inside a think block. ``</think>`` ends it; a ``<tool_call>``
  also ends it (Qwen3.5 may open a tool call without closing its thoughts).
  The parser starts here when the prompt ends with ``<think>`` (the Qwen3.5
  template opens the block itself, so only ``</think>`` shows up in the output).
* ``content``: ordinary answer text. A ``<think>`` before any content opens a
  think block (Qwen3 writes both tags itself).
* ``tool``: inside ``<tool_call>...</tool_call>``: nothing is streamed; at the
  closing tag the body is parsed as Hermes JSON (``{"name", "arguments"}``,
  Qwen3 / Qwen3-Next) or Qwen3-Coder XML (``<function=NAME><parameter=P>value
  </parameter></function>``, Qwen3.5 / 3.6) and handed out as one call. A body
  that parses as neither is passed through as content.

Text that might be the start of a tag (``"<"``, ``"<too"``...) is held back
until the next piece decides it.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from ..decode.text_stream import partial_match_start

THINK_START, THINK_END = "<think>", "</think>"
TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"


@dataclass
class Piece:
    kind: str  # "reasoning" | "content" | "tool_call"
    text: str = ""
    call: Optional[dict] = None


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# --- tool-call bodies ---------------------------------------------------------------
def _param_types(tools: Optional[list], function: str) -> Dict[str, Any]:
    for t in tools or []:
        fn = t.get("function", t) if isinstance(t, dict) else None
        if isinstance(fn, dict) and fn.get("name") == function:
            params = fn.get("parameters") or {}
            props = params.get("properties") if isinstance(params, dict) else None
            if isinstance(props, dict):
                return {k: (v.get("type") if isinstance(v, dict) else None)
                        for k, v in props.items()}
    return {}


def _convert(raw: str, ptype) -> Any:
    """An XML parameter value -> the JSON value its schema type asks for."""
    if isinstance(ptype, list):
        non_null = [t for t in ptype if t != "null"]
        if "null" in ptype and raw.strip().lower() in ("null", "none"):
            return None
        ptype = non_null[0] if non_null else None
    if ptype is None:
        return raw
    t = str(ptype).lower()
    v = raw.strip()
    if t in ("string", "str", "text", "varchar", "char", "enum"):
        return raw
    if t == "null":
        return None if v.lower() in ("null", "none", "") else raw
    if t in ("integer", "int") or t.startswith("int"):
        try:
            return int(v)
        except ValueError:
            try:
                f = float(v)
                return int(f) if f.is_integer() else f
            except ValueError:
                return raw
    if t in ("number", "float", "double") or t.startswith(("float", "num")):
        try:
            return int(v) if re.fullmatch(r"[-+]?\d+", v) else float(v)
        except ValueError:
            return raw
    if t in ("boolean", "bool"):
        if v.lower() in ("true", "1", "yes"):
            return True
        if v.lower() in ("false", "0", "no"):
            return False
        return raw
    if t in ("object", "array", "dict", "list") or t.startswith(("dict", "list")):
        try:
            return json.loads(v)
        except json.JSONDecodeError:
            try:
                return ast.literal_eval(v)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return raw
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return raw


def _strip_one_newline(s: str) -> str:
    if s.startswith("\n"):
        s = s[1:]
    if s.endswith("\n"):
        s = s[:-1]
    return s


_FUNC_RE = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.S)
_PARAM_RE = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)


def _call(name: str, arguments) -> dict:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_tool_body(body: str, tools: Optional[list] = None,
                    fmt: str = "auto") -> Optional[List[dict]]:
    """The text between ``<tool_call>`` and ``</tool_call>`` -> OpenAI tool calls, or None.

    ``fmt``: "hermes" (JSON), "qwen3_coder" (XML) or "auto" (either).
    """
    s = body.strip()
    if not s:
        return None
    if s[0] in "{[" and fmt in ("auto", "hermes"):
        try:
            obj = json.loads(s)
        except json.JSONDecodeError:
            return None
        calls = []
        for o in obj if isinstance(obj, list) else [obj]:
            if not isinstance(o, dict) or not isinstance(o.get("name"), str):
                return None
            args = o.get("arguments", o.get("parameters", {}))
            calls.append(_call(o["name"], args))
        return calls or None
    if "<function=" in s and fmt in ("auto", "qwen3_coder"):
        calls = []
        for m in _FUNC_RE.finditer(s):
            name = m.group(1).strip()
            types = _param_types(tools, name)
            params = {}
            for pm in _PARAM_RE.finditer(m.group(2)):
                pname = pm.group(1).strip()
                params[pname] = _convert(_strip_one_newline(pm.group(2)), types.get(pname))
            calls.append(_call(name, params))
        return calls or None
    return None


# --- the streaming state machine -----------------------------------------------------
class OutputParser:
    def __init__(self, *, reasoning: bool = True, start_in_reasoning: bool = False,
                 tools: Optional[list] = None, parse_tools: bool = False,
                 tool_format: str = "auto"):
        self.reasoning = reasoning
        self.tool_format = tool_format
        self.parse_tools = parse_tools
        self.tools = tools
        self.state = "reasoning" if (reasoning and start_in_reasoning) else "content"
        self.buf = ""
        self.seen_content = False
        self.reasoning_started = False
        # The newlines a think block ends with ("</think>\n\n") are markup, not content.
        self.strip_content = False
        # Whitespace-only content waits: it is dropped if a tool call follows (markup
        # around the call), sent otherwise, also when it is the whole answer.
        self.ws_held = ""
        self.num_calls = 0

    def _tags(self):
        if self.state == "reasoning":
            return [THINK_END] + ([TOOL_START] if self.parse_tools else [])
        tags = [TOOL_START] if self.parse_tools else []
        if self.reasoning and not self.seen_content:
            tags.append(THINK_START)
        return tags

    def _emit_text(self, out: List[Piece], text: str):
        if not text:
            return
        if self.state == "reasoning":
            if not self.reasoning_started:
                text = text.lstrip()
                if not text:
                    return
                self.reasoning_started = True
            out.append(Piece("reasoning", text))
            return
        if self.strip_content and not self.seen_content:
            text = text.lstrip("\n")  # only the separator: indentation is content
            if not text:
                return
            self.strip_content = False
        if not text.strip():
            self.ws_held += text
            return
        text, self.ws_held = self.ws_held + text, ""
        self.seen_content = True
        out.append(Piece("content", text))

    def feed(self, text: str) -> List[Piece]:
        self.buf += text
        return self._drain(final=False)

    def finish(self) -> List[Piece]:
        out = self._drain(final=True)
        if self.ws_held and not self.num_calls:
            out.append(Piece("content", self.ws_held))
        self.ws_held = ""
        return _merge(out)

    def _drain(self, final: bool) -> List[Piece]:
        out: List[Piece] = []
        while True:
            if self.state == "tool":
                i = self.buf.find(TOOL_END)
                if i < 0 and not final:
                    break
                body = self.buf if i < 0 else self.buf[:i]
                self.buf = "" if i < 0 else self.buf[i + len(TOOL_END):]
                calls = parse_tool_body(body, self.tools, self.tool_format)
                self.state = "content"
                if calls:
                    for c in calls:
                        out.append(Piece("tool_call", call=c))
                    self.num_calls += len(calls)
                    self.ws_held = ""
                else:
                    closing = TOOL_END if i >= 0 else ""
                    self._emit_text(out, TOOL_START + body + closing)
                continue
            tags = self._tags()
            found = min(((self.buf.find(t), t) for t in tags if t in self.buf), default=None)
            if found is not None:
                i, tag = found
                if tag == THINK_START and self.buf[:i].strip():
                    # text before it: this "<think>" is part of the answer
                    self._emit_text(out, self.buf[:i])
                    self.buf = self.buf[i:]
                    continue
                self._emit_text(out, self.buf[:i])
                self.buf = self.buf[i + len(tag):]
                if tag == THINK_END:
                    self.state, self.strip_content = "content", True
                elif tag == THINK_START:
                    self.state, self.ws_held = "reasoning", ""  # whitespace before the tag
                else:  # TOOL_START
                    self.state = "tool"
                continue
            # A tail that may still become a tag waits (the stop-string hold-back's rule).
            cut = len(self.buf) if final else partial_match_start(self.buf, tags)
            self._emit_text(out, self.buf[:cut])
            self.buf = self.buf[cut:]
            break
        return _merge(out)


def _merge(pieces: List[Piece]) -> List[Piece]:
    out: List[Piece] = []
    for p in pieces:
        if out and p.kind != "tool_call" and out[-1].kind == p.kind:
            out[-1] = Piece(p.kind, out[-1].text + p.text)
        else:
            out.append(p)
    return out


def parse_full(text: str, **kw) -> dict:
    """Whole output -> {"content", "reasoning", "tool_calls"}."""
    p = OutputParser(**kw)
    pieces = p.feed(text) + p.finish()
    content = "".join(x.text for x in pieces if x.kind == "content")
    reasoning = "".join(x.text for x in pieces if x.kind == "reasoning")
    calls = [x.call for x in pieces if x.kind == "tool_call"]
    return {"content": content, "reasoning": reasoning.strip() or None, "tool_calls": calls}
