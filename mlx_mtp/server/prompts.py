"""Request -> prompt: chat messages normalised for the chat template (text parts,
``developer`` role, tool-call arguments decoded), the template applied and
tokenized, and the prefix-cache boundaries; plain completion prompts checked.
Runs on the tokenizer thread.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from .protocol import APIError, ChatCompletionRequest, CompletionRequest, bad_request

if TYPE_CHECKING:
    from .state import ServerState


def _decode_arguments(args, i: int, j: int):
    if args is None or isinstance(args, dict):
        return args or {}
    try:
        out = json.loads(args)
    except json.JSONDecodeError as e:
        raise bad_request(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON: {e}",
                          param="messages")
    if not isinstance(out, dict):
        raise bad_request(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object",
                          param="messages")
    return out


def _template_messages(req: ChatCompletionRequest) -> List[dict]:
    out = []
    for i, m in enumerate(req.messages):
        d: Dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, str):
                    parts.append({"type": "text", "text": part})
                elif part.get("type") == "text" and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                else:
                    raise bad_request(
                        f"messages[{i}].content: only text parts are supported "
                        f"(got type {part.get('type')!r})", param="messages")
            content = "".join(p["text"] for p in parts)
        if content is None and m.role in ("system", "developer", "user", "tool"):
            raise bad_request(f"messages[{i}].content is required for role {m.role!r}",
                              param="messages")
        d["content"] = content if content is not None else ""
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [
                {"id": tc.id, "type": "function",
                 "function": {"name": tc.function.name,
                              "arguments": _decode_arguments(tc.function.arguments, i, j)}}
                for j, tc in enumerate(m.tool_calls)]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None:
            d["reasoning_content"] = reasoning
        out.append(d)
    return out


@dataclass
class PreparedChat:
    ids: List[int]
    boundaries: List[int]
    start_in_reasoning: bool
    tools: Optional[list]


def prepare_chat(state: ServerState, req: ChatCompletionRequest) -> PreparedChat:
    tok = state.tokenizer
    if not getattr(tok, "chat_template", None):
        raise bad_request("This model has no chat template; use /v1/completions.",
                          param="messages")
    messages = _template_messages(req)
    use_tools = bool(req.tools) and req.tool_choice != "none"
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if use_tools else None
    kwargs = dict(state.template_args)
    kwargs.update(req.chat_template_kwargs or {})
    kwargs.setdefault("enable_thinking", False)
    for reserved in ("tools", "tokenize", "add_generation_prompt", "conversation", "messages"):
        kwargs.pop(reserved, None)
    try:
        text = tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                       add_generation_prompt=True, **kwargs)
    except APIError:
        raise
    except Exception as e:  # jinja2 errors and the template's raise_exception
        raise bad_request(f"The chat template could not render these messages: {e}",
                          param="messages", code="invalid_messages")
    ids = tok.encode(text, add_special_tokens=False)
    if not ids:
        raise bad_request("The prompt is empty after applying the chat template.",
                          param="messages")
    # Reusable prefix boundaries: after the first turn (shared system prompts),
    # before the final generation header (the history, reused by the next
    # turn), and the whole prompt (repeats).
    bounds = {len(ids) - 1}
    im = state.im_start_id
    if im is not None:
        starts = [i for i, t in enumerate(ids) if t == im]
        if len(starts) >= 2:
            bounds.update((starts[1], starts[-1]))
    start_in_reasoning = (state.reasoning_parser != "none"
                          and text.rstrip().endswith("<think>"))
    return PreparedChat(ids, sorted(b for b in bounds if b > 0), start_in_reasoning, tools)


def prepare_completion(state: ServerState, req: CompletionRequest) -> List[int]:
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise bad_request("Only one prompt per request is supported.", param="prompt")
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise bad_request("The prompt is empty.", param="prompt")
        from ..decode.prompt import encode_prompt

        try:
            return encode_prompt(state.tokenizer, p)
        except ValueError as e:
            raise bad_request(str(e), param="prompt")
    ids = list(p)
    if not ids:
        raise bad_request("The prompt is empty.", param="prompt")
    bad = [t for t in ids if not 0 <= t < state.vocab_size]
    if bad:
        raise bad_request(f"Token ids out of range [0, {state.vocab_size}): {bad[:5]}",
                          param="prompt")
    return ids

