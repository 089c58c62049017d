"""OpenAI Responses API (``POST /v1/responses``), stateless.

Translated at the edge onto the chat pipeline: ``instructions`` and the ``input``
items (messages, ``function_call``, ``function_call_output``, ``reasoning``) become
a ``ChatCompletionRequest`` that the chat template, the engine and the output
parser handle as for ``/v1/chat/completions``; the parser's pieces become
``output`` items (``reasoning``, ``message`` with ``output_text``,
``function_call``) and the ``response.*`` stream events. Nothing is stored, so
``previous_response_id`` is a 400. The route is in ``routers/responses``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union

from pydantic import BaseModel, ConfigDict

from .events import Delta, Done
from .parsers import Piece
from .prompts import PreparedChat, output_parser
from .protocol import APIError, ChatCompletionRequest, bad_request, translated_chat_request

if TYPE_CHECKING:
    from .state import ServerState

# Fields the Responses API lacks, passed through to the chat pipeline as the chat endpoint
# reads them (OpenAI chat fields, vLLM's and llama-server's extensions, and ours).
EXTENSIONS = ("seed", "top_k", "min_p", "stop", "presence_penalty", "frequency_penalty",
              "repetition_penalty", "logit_bias", "num_draft_tokens", "mtp_coupled",
              "cache_prompt", "chat_template_kwargs", "draft_source")
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    model: Optional[str] = None
    input: Union[str, List[Dict[str, Any]]]
    instructions: Optional[str] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: Optional[bool] = False
    previous_response_id: Optional[str] = None
    text: Optional[Dict[str, Any]] = None
    reasoning: Optional[Dict[str, Any]] = None
    metadata: Optional[Dict[str, Any]] = None


# --- request ---------------------------------------------------------------------------
def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts.", param="input")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise bad_request(f"{where}[{j}]: only text parts are supported (got {kind!r}).",
                              param="input")
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{j}].text must be a string.", param="input")
        out.append(part["text"])
    return "".join(out)


def _user_content(content, where: str):
    """A user message's text, or OpenAI chat parts when it holds ``input_image`` parts."""
    if not (isinstance(content, list) and any(
            isinstance(p, dict) and p.get("type") == "input_image" for p in content)):
        return _text(content, where)
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            if not isinstance(part.get("image_url"), str):
                raise bad_request(f"{where}[{j}]: an input_image needs image_url, a string "
                                  "(file_id is not supported)", param="input")
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            parts.append({"type": "text", "text": _text([part], f"{where}[{j}]")})
    return parts


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text: its ``content`` parts, else its ``summary`` parts."""
    for field in ("content", "summary"):
        parts = item.get(field)
        if parts is None:
            continue
        if not isinstance(parts, list):
            raise bad_request(f"{where}.{field} must be a list of text parts.", param="input")
        for j, p in enumerate(parts):
            if not isinstance(p, dict) or not isinstance(p.get("text", ""), str):
                raise bad_request(f"{where}.{field}[{j}] must be a part with a string text.",
                                  param="input")
        if parts:
            return "".join(p.get("text", "") for p in parts)
    return ""


def _messages(req: ResponsesRequest) -> List[dict]:
    """``instructions`` + ``input`` -> chat messages (function calls join the assistant turn)."""
    out: List[dict] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return out + [{"role": "user", "content": req.input}]
    reasoning: List[str] = []  # reasoning items belong to the next assistant turn

    def assistant() -> dict:
        if not (out and out[-1]["role"] == "assistant"):
            out.append({"role": "assistant", "content": ""})
        if reasoning:
            out[-1]["reasoning_content"] = "".join(reasoning)
            reasoning.clear()
        return out[-1]

    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role must be user, system, developer or assistant "
                                  f"(got {role!r}).", param="input")
            if role == "assistant":
                msg = assistant()
                msg["content"] += _text(item.get("content", ""), f"{where}.content")
            elif role == "user":
                out.append({"role": "user",
                            "content": _user_content(item.get("content", ""), f"{where}.content")})
            else:
                out.append({"role": "system",
                            "content": _text(item.get("content", ""), f"{where}.content")})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}: a function_call needs a string name and call_id.",
                                  param="input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments", "{}")}}
            assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}: a function_call_output needs a call_id.",
                                  param="input")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text(item.get("output", ""), f"{where}.output")})
        elif kind == "reasoning":
            reasoning.append(_reasoning_text(item, where))
        elif kind == "item_reference":
            raise bad_request(f"{where}: item references need stored responses; this server is "
                              "stateless, send the items themselves.", param="input")
        else:
            raise bad_request(f"{where}: input item type {kind!r} is not supported (this server "
                              "reads message, function_call, function_call_output, reasoning).",
                              param="input")
    # The template takes one system message: instructions and leading system items join.
    while len(out) > 1 and out[0]["role"] == out[1]["role"] == "system":
        out[0]["content"] += "\n\n" + out.pop(1)["content"]
    return out


def _tools(tools: Optional[list]) -> Optional[list]:
    out = []
    for j, t in enumerate(tools or []):
        if t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise bad_request(f"tools[{j}]: only function tools with a name are supported "
                              f"(got type {t.get('type')!r}).", param="tools")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict")
              if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("tool_choice must be auto, none, required or {\"type\": \"function\", "
                      "\"name\": ...}.", param="tool_choice")


def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """A Responses request -> the equivalent chat completion request."""
    if req.previous_response_id is not None:
        raise bad_request("previous_response_id is not supported: this server is stateless "
                          "and stores no responses; send the whole conversation in input.",
                          param="previous_response_id", code="unsupported_parameter")
    messages = _messages(req)
    if not messages:
        raise bad_request("input is empty.", param="input")
    extra = req.model_extra or {}
    if "n" in extra:  # one response per request in this API: asking for more is an error
        raise bad_request("n is not a Responses API field: a request returns one response; "
                          "send several requests for several answers.", param="n",
                          code="unsupported_parameter")
    body: Dict[str, Any] = {k: extra[k] for k in EXTENSIONS if k in extra}
    body.update(model=req.model, messages=messages, tools=_tools(req.tools),
                tool_choice=_tool_choice(req.tool_choice),
                parallel_tool_calls=req.parallel_tool_calls, max_tokens=req.max_output_tokens,
                temperature=req.temperature, top_p=req.top_p)
    fmt = (req.text or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" \
            and not isinstance(fmt.get("schema"), dict):
        # The API requires the schema here; without it, output would be unconstrained.
        raise bad_request("Missing required parameter: 'text.format.schema' (an object).",
                          param="text.format.schema", code="missing_required_parameter")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        # Structured output goes the chat way (response_format), which decides support.
        schema = {k: v for k, v in fmt.items() if k != "type"}
        body["response_format"] = ({"type": "json_schema", "json_schema": schema}
                                   if fmt["type"] == "json_schema" else {"type": fmt["type"]})
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:
        kwargs = dict(body.get("chat_template_kwargs") or {})
        kwargs["enable_thinking"] = effort not in ("none", "minimal")
        body["chat_template_kwargs"] = kwargs
    return translated_chat_request(body, "input", "input")


# --- response ----------------------------------------------------------------------------
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseFormatter:
    """Engine events -> a ``response`` object, or its ``response.*`` stream events."""

    def __init__(self, state: ServerState, model: str, prepared: PreparedChat,
                 req: ResponsesRequest, tools: Optional[list]):
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        self.state = state
        self.model = model
        self.req = req
        self.tools = tools
        self.parser = output_parser(state, prepared)
        self.output: List[dict] = []  # items, the last one possibly still open
        self.open = False
        self.seq = 0
        self.reasoning_tokens = 0

    def _response(self, status: str, usage=None, incomplete=None, error=None) -> dict:
        req = self.req
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": status, "error": error, "incomplete_details": incomplete,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "model": self.model, "output": [dict(x) for x in self.output],
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": None, "reasoning": req.reasoning or {},
                "store": False, "temperature": req.temperature, "top_p": req.top_p,
                "text": req.text or {"format": {"type": "text"}},
                "tool_choice": req.tool_choice or "auto", "tools": self.tools or [],
                "truncation": "disabled", "metadata": req.metadata or {}, "usage": usage}

    def _event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq, **fields}

    def _usage(self, done: Done) -> dict:
        u = done.usage
        return {"input_tokens": u["prompt_tokens"],
                "input_tokens_details": dict(u.get("prompt_tokens_details") or
                                             {"cached_tokens": 0}),
                "output_tokens": u["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                "total_tokens": u["total_tokens"]}

    def _feed(self, ev: Delta) -> List[Piece]:
        # Reasoning tokens: those of the steps that began inside the think block.
        if self.parser.state == "reasoning":
            self.reasoning_tokens += len(ev.token_ids)
        return self.parser.feed(ev.text)

    # items: open one, add text to it, close it (each returns its stream events)
    def _open(self, kind: str) -> List[dict]:
        events = self._close()
        if kind == "reasoning":
            item = {"type": "reasoning", "id": _new_id("rs"), "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}]}
        else:
            item = {"type": "message", "id": _new_id("msg"), "status": "in_progress",
                    "role": "assistant", "content": []}
        self.output.append(item)
        self.open = True
        idx = len(self.output) - 1
        events.append(self._event("response.output_item.added", output_index=idx,
                                  item=dict(item, content=[])))
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=idx, content_index=0, part=dict(part)))
        return events

    def _add_text(self, kind: str, text: str) -> List[dict]:
        last = self.output[-1] if self.open else None
        events = [] if last is not None and last["type"] == kind else self._open(kind)
        item, idx = self.output[-1], len(self.output) - 1
        item["content"][0]["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" \
            else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self._event(name, item_id=item["id"], output_index=idx, content_index=0,
                                  delta=text, **extra))
        return events

    def _close(self, status: str = "completed") -> List[dict]:
        if not self.open:
            return []
        self.open = False
        item, idx = self.output[-1], len(self.output) - 1
        part = item["content"][0]
        if item["type"] == "reasoning":
            events = [self._event("response.reasoning_text.done", item_id=item["id"],
                                  output_index=idx, content_index=0, text=part["text"])]
        else:
            item["status"] = status
            events = [self._event("response.output_text.done", item_id=item["id"],
                                  output_index=idx, content_index=0, text=part["text"],
                                  logprobs=[]),
                      self._event("response.content_part.done", item_id=item["id"],
                                  output_index=idx, content_index=0, part=dict(part))]
        events.append(self._event("response.output_item.done", output_index=idx,
                                  item=json.loads(json.dumps(item))))
        return events

    def _call(self, call: dict) -> List[dict]:
        events = self._close()
        fn = call["function"]
        item = {"type": "function_call", "id": _new_id("fc"), "call_id": call["id"],
                "name": fn["name"], "arguments": fn["arguments"], "status": "completed"}
        self.output.append(item)
        idx = len(self.output) - 1
        return events + [
            self._event("response.output_item.added", output_index=idx,
                        item=dict(item, arguments="", status="in_progress")),
            self._event("response.function_call_arguments.delta", item_id=item["id"],
                        output_index=idx, delta=fn["arguments"]),
            self._event("response.function_call_arguments.done", item_id=item["id"],
                        output_index=idx, name=fn["name"], arguments=fn["arguments"]),
            self._event("response.output_item.done", output_index=idx, item=dict(item))]

    def _events(self, pieces: List[Piece]) -> List[dict]:
        events: List[dict] = []
        for p in pieces:
            if p.kind == "tool_call":
                events += self._call(p.call)
            elif p.text:
                events += self._add_text("reasoning" if p.kind == "reasoning" else "message",
                                         p.text)
        return events

    def _final(self, done: Done) -> dict:
        truncated = done.finish_reason == "length"
        out = self._response("incomplete" if truncated else "completed", self._usage(done),
                             {"reason": "max_output_tokens"} if truncated else None)
        out.update(mtp=done.mtp, timings=done.timings)
        return out

    # streaming
    def start(self) -> List[dict]:
        return [self._event("response.created", response=self._response("in_progress")),
                self._event("response.in_progress", response=self._response("in_progress"))]

    def on_delta(self, ev: Delta) -> List[dict]:
        return self._events(self._feed(ev))

    def on_done(self, done: Done, include_usage: bool = False) -> List[dict]:
        truncated = done.finish_reason == "length"
        events = self._events(self.parser.finish())
        events += self._close("incomplete" if truncated else "completed")
        kind = "response.incomplete" if truncated else "response.completed"
        return events + [self._event(kind, response=self._final(done))]

    # stream framing (see pipeline.Pipeline.run_request): named events, no [DONE]
    stream_trailer = ""

    @staticmethod
    def encode_event(obj: dict) -> str:
        return f"event: {obj['type']}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def error_events(self, err: APIError) -> List[dict]:
        error = {"code": err.code or "server_error", "message": err.message}
        return [self._event("response.failed", response=self._response("failed", error=error))]

    # whole response
    def response(self, deltas: List[Delta], done: Done) -> dict:
        for ev in deltas:
            self._events(self._feed(ev))
        self._events(self.parser.finish())
        self._close("incomplete" if done.finish_reason == "length" else "completed")
        # As in chat: no padding around thoughts, nor around text next to tool calls.
        calls = any(x["type"] == "function_call" for x in self.output)
        for item in self.output:
            if item["type"] == "reasoning" or (item["type"] == "message" and calls):
                part = item["content"][0]
                part["text"] = part["text"].strip()
        self.output = [x for x in self.output if x["type"] == "function_call"
                       or x["content"][0]["text"]]
        return self._final(done)
