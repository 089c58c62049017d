"""What a request constrains its output to: ``response_format``, or a strict tool call.

Both become one llguidance grammar (``decode.grammar``), compiled on a prompt worker and
applied by the decode step to every draft and verify row. A forced call (``tool_choice``
``required`` or a named function, ``prepared.forced_prefix`` already opened it) to tools
declared ``strict: true`` is constrained from there to ``</tool_call>``: the arguments
follow the tool's JSON schema, in the model's own call format (Hermes JSON, or Qwen3-Coder
XML with one ``<parameter=...>`` per property, in schema order, typed values).
Structured output is exact under MTP and costs an extra host sync per draft (see
``decode/grammar.py``).
"""

from __future__ import annotations

import json
from typing import List, Optional

from ..decode import grammar as G
from .prompts import PreparedChat, tool_call_format
from .protocol import bad_request

def _lit(text: str) -> str:
    return json.dumps(text)  # a Lark string literal


def _xml_value(schema: dict) -> Optional[str]:
    """Lark for one Qwen3-Coder parameter value, as the XML parser converts it back: a JSON
    value for every type but strings (the XML holds its JSON text: ``3``, ``true``,
    ``[1, 2]``), the literals of a string enum, a bounded line for a string with
    ``maxLength``; None: free text up to the closing tag."""
    kind = schema.get("type")
    if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        return " | ".join(_lit(v) for v in schema["enum"])
    if kind in ("integer", "number", "boolean", "null", "object", "array"):
        return f"%json {G.json_body(schema)}"
    if kind == "string" and isinstance(schema.get("maxLength"), int):
        lo = schema.get("minLength", 0) if isinstance(schema.get("minLength"), int) else 0
        return f"/[^\\n]{{{lo},{schema['maxLength']}}}/"  # one line, bounded
    return None


def _xml_params(prefix: str, schema: dict) -> List[str]:
    """Rules for a function's parameters; the first is the sequence, named ``prefix``."""
    props = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    rules, seq = [], []
    for i, (pname, pschema) in enumerate(props.items()):
        rule = f"{prefix}_{i}"
        value = _xml_value(pschema if isinstance(pschema, dict) else {})
        opening = _lit(f"<parameter={pname}>\n")
        if value is None:  # text, ended by the closing tag
            rules.append(f'{rule}: {opening} {rule}_v "\\n"')
            rules.append(f'{rule}_v[suffix={_lit(chr(10) + "</parameter>")}]: /(?s:.*)/')
        else:
            rules.append(f'{rule}: {opening} ({value}) "\\n</parameter>\\n"')
        seq.append(rule if pname in required else f"{rule}?")
    body = " ".join(seq) if seq else '""'
    return [f"{prefix}: {body}"] + rules


def opening_json(name: str) -> str:
    """A Hermes call up to its arguments, as ``prompts._tool_call_opening`` writes it."""
    return f'{{"name": {json.dumps(name)}, "arguments": '


def tool_call_grammar(fmt: str, tools: List[dict], forced: str,
                      call_end: str = _lit("</tool_call>")) -> str:
    """The rest of a forced call after its opening (``prompts._tool_call_opening``);
    ``call_end``: the Lark for ``</tool_call>`` (bare when it is one special token)."""
    fns = [t["function"] for t in tools]
    chosen = fns if forced == "required" else [f for f in fns if f["name"] == forced]
    rules = []
    if fmt == "hermes":
        if forced == "required":  # opening: "<tool_call>\n"
            alts = [f'{_lit(opening_json(f["name"]))} a{i}' for i, f in enumerate(chosen)]
            rules.append(f"start: ({' | '.join(alts)}) " + _lit("}\n") + f" {call_end}")
        else:  # opening ends with '"arguments": '
            rules.append("start: a0 " + _lit("}\n") + f" {call_end}")
        for i, f in enumerate(chosen):
            rules.append(f"a{i}: %json {G.json_body(f.get('parameters') or {'type': 'object'})}")
    else:
        closing = f'{_lit("</function>" + chr(10))} {call_end}'
        if forced == "required":  # opening: "<tool_call>\n<function="
            alts = [f"{_lit(f['name'] + '>' + chr(10))} p{i}" for i, f in enumerate(chosen)]
            rules.append(f"start: ({' | '.join(alts)}) {closing}")
        else:  # opening: "<tool_call>\n<function=NAME>\n"
            rules.append(f"start: p0 {closing}")
        for i, f in enumerate(chosen):
            G.check_json_schema(f.get("parameters") or {"type": "object"})
            rules += _xml_params(f"p{i}", f.get("parameters") or {})
    return G.lark_grammar("\n".join(rules))


def strict_tools(prepared: PreparedChat, forced: Optional[str]) -> bool:
    """Whether the forced call is to strict tools only (then the grammar holds it)."""
    if forced is None or not prepared.tools:
        return False
    fns = [t["function"] for t in prepared.tools]
    chosen = fns if forced == "required" else [f for f in fns if f["name"] == forced]
    return bool(chosen) and all(f.get("strict") for f in chosen)


def compile_constraint(state, response_format, prepared: Optional[PreparedChat] = None,
                       forced: Optional[str] = None, tok=None) -> Optional[G.Grammar]:
    """The request's grammar (None: free text); runs on a prompt worker."""
    strict = prepared is not None and strict_tools(prepared, forced)
    rf = response_format
    if not strict and (rf is None or (isinstance(rf, dict) and rf.get("type") == "text")):
        return None
    param = "tools" if strict else "response_format"
    if not strict and not isinstance(rf, dict):
        raise bad_request("response_format must be an object with a type.", param=param)
    if state.grammar_thinking is None:
        raise bad_request("Structured output needs llguidance on the server: "
                          "pip install 'llguidance>=1.9,<2'.", param=param)
    if state.engine.model.capabilities.shares:
        raise bad_request("Structured output is not supported when the model is split "
                          "across processes (mlx.launch).", param=param)
    try:
        if strict:  # a forced call: the prompt already closed any think block
            text = tool_call_grammar(tool_call_format(state, tok or state.tokenizer),
                                     prepared.tools, forced, state.grammar_call_end)
        else:
            thinking = prepared is not None and prepared.start_in_reasoning
            text = G.response_format_grammar(
                rf, after_thinking=state.grammar_thinking if thinking else None)
        return G.Grammar(state.tokenizer, text, state.vocab_size, state.eos_ids)
    except (G.GrammarError, ValueError) as e:
        what = "tool parameters" if strict else "response_format"
        raise bad_request(f"Invalid {what}: {e}", param=param,
                          code="invalid_response_format" if not strict else None)
