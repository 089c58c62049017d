"""Anthropic Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Translated at the edge onto the chat pipeline: a request becomes a
``ChatCompletionRequest`` (system prompt, text / tool_use / tool_result / thinking
blocks, tools, tool_choice), which the chat template, the engine and the output
parser handle as for ``/v1/chat/completions``. The parser's pieces become content
blocks (``thinking``, ``text``, ``tool_use``) and stream events in Anthropic's order.
Errors under ``/v1/messages`` use Anthropic's shape ``{"type": "error", "error": {"type",
"message"}}`` (``AnthropicErrors`` reshapes the app's OpenAI envelopes on these paths).
The routes are in ``routers/anthropic``.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from .events import Admitted, Delta, Done
from .parsers import Piece
from .prompts import PreparedChat, output_parser
from .protocol import APIError, ChatCompletionRequest, bad_request, translated_chat_request

if TYPE_CHECKING:
    from .state import ServerState

# Anthropic's error type for each HTTP status; 503 (queue full, shutting down) is
# answered as Anthropic's 529 "overloaded_error", which its clients retry.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 529: "overloaded_error"}

# Fields the Messages API lacks, passed through to the chat pipeline as the chat endpoint
# reads them (vLLM's and llama-server's vendor extensions, and ours).
EXTENSIONS = ("seed", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
              "logit_bias", "num_draft_tokens", "mtp_coupled", "cache_prompt",
              "chat_template_kwargs", "draft_source")


def _status(status: int) -> int:
    return 529 if status == 503 else status


def error_body(e: APIError) -> dict:
    status = _status(e.status)
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


class AnthropicErrors:
    """ASGI middleware: error responses under ``/v1/messages`` in Anthropic's shape, whoever
    made them (these routes, the request guard, routing); other paths pass untouched."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/messages"):
            return await self.app(scope, receive, send)
        start, chunks = None, []

        async def reshape(msg):
            nonlocal start
            if msg["type"] == "http.response.start" and msg["status"] >= 400:
                start = msg  # held until the body is known
                return
            if start is None or msg["type"] != "http.response.body":
                return await send(msg)
            chunks.append(msg.get("body", b""))
            if msg.get("more_body"):
                return
            status, body = start["status"], b"".join(chunks)
            try:
                err = json.loads(body)["error"]
                body = json.dumps(error_body(APIError(status, err["message"]))).encode()
                status = _status(status)
            except (ValueError, KeyError, TypeError):
                pass  # not an OpenAI error envelope (e.g. already Anthropic's): as it is
            headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send(dict(start, status=status, headers=headers))
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, reshape)


# --- request ---------------------------------------------------------------------------
class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class InputMessage(_Model):
    role: Literal["user", "assistant"]
    content: Union[str, List[Dict[str, Any]]]


class CountTokensRequest(_Model):
    model: Optional[str] = None
    messages: List[InputMessage] = Field(min_length=1)
    system: Optional[Union[str, List[Dict[str, Any]]]] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Dict[str, Any]] = None
    thinking: Optional[Dict[str, Any]] = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: Optional[List[str]] = None
    stream: Optional[bool] = False
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    metadata: Optional[Dict[str, Any]] = None


def _text(blocks, where: str) -> str:
    """A string or a list of text blocks -> the text; any other block is a 400."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise bad_request(f"{where} must be a string or a list of text blocks.", param=where)
    out = []
    for j, b in enumerate(blocks):
        if not (isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)):
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise bad_request(f"{where}[{j}]: only text blocks are supported here (got {kind!r}).",
                              param=where)
        out.append(b["text"])
    return "".join(out)


def _assistant(m: InputMessage, i: int) -> dict:
    if isinstance(m.content, str):
        return {"role": "assistant", "content": m.content}
    text, reasoning, calls = [], [], []
    for j, b in enumerate(m.content):
        kind = b.get("type")
        if kind == "text":
            text.append(_text([b], f"messages[{i}].content"))
        elif kind == "thinking":
            reasoning.append(str(b.get("thinking", "")))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                raise bad_request(f"messages[{i}].content[{j}]: a tool_use block needs a "
                                  "string name and an object input.", param="messages")
            calls.append({"id": b.get("id"), "type": "function",
                          "function": {"name": b["name"], "arguments": b.get("input", {})}})
        else:
            raise bad_request(f"messages[{i}].content[{j}]: block type {kind!r} is not "
                              "supported in assistant messages.", param="messages")
    out: Dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        out["tool_calls"] = calls
    if reasoning:
        out["reasoning_content"] = "".join(reasoning)
    return out


def _user(m: InputMessage, i: int) -> List[dict]:
    """One user turn -> tool messages (tool_result blocks) and user messages, in order."""
    if isinstance(m.content, str):
        return [{"role": "user", "content": m.content}]
    out: List[dict] = []
    for j, b in enumerate(m.content):
        kind = b.get("type")
        if kind == "tool_result":
            content = _text(b.get("content", ""), f"messages[{i}].content[{j}].content")
            out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": content})
        elif kind == "text":
            _add_user_part(out, {"type": "text", "text": _text([b], f"messages[{i}].content")})
        elif kind == "image":
            _add_user_part(out, _image_part(b.get("source"), f"messages[{i}].content[{j}]"))
        else:
            raise bad_request(f"messages[{i}].content[{j}]: block type {kind!r} is not "
                              "supported (this server reads text, image, tool_use and "
                              "tool_result).", param="messages")
    return out or [{"role": "user", "content": ""}]


def _add_user_part(out: List[dict], part: dict):
    """Text joins the user turn's text; an image turns its content into OpenAI parts."""
    if not (out and out[-1]["role"] == "user"):
        out.append({"role": "user", "content": ""})
    last = out[-1]
    if part["type"] == "text" and isinstance(last["content"], str):
        last["content"] += part["text"]
        return
    if isinstance(last["content"], str):
        last["content"] = [{"type": "text", "text": last["content"]}] if last["content"] else []
    last["content"].append(part)


def _image_part(source, where: str) -> dict:
    """An ``image`` block's source (base64, or a URL) -> an OpenAI ``image_url`` part."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("media_type"), str) \
            and isinstance(source.get("data"), str):
        url = f"data:{source['media_type']};base64,{source['data']}"
    elif kind == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise bad_request(f"{where}.source must be {{'type': 'base64', 'media_type': ..., "
                          "'data': ...}} or {'type': 'url', 'url': ...}", param="messages")
    return {"type": "image_url", "image_url": {"url": url}}


def _tools(req: CountTokensRequest) -> Optional[list]:
    tools = []
    for j, t in enumerate(req.tools or []):
        if t.get("type") not in (None, "custom"):
            raise bad_request(f"tools[{j}]: server tool {t.get('type')!r} is not supported; "
                              "only custom tools (name, input_schema) are.", param="tools")
        if not isinstance(t.get("name"), str) or not isinstance(t.get("input_schema"), dict):
            raise bad_request(f"tools[{j}] needs a string name and an object input_schema.",
                              param="tools")
        fn = {"name": t["name"], "parameters": t["input_schema"]}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        if t.get("strict") is not None:
            fn["strict"] = t["strict"]
        tools.append({"type": "function", "function": fn})
    return tools or None


def _tool_choice(choice: Optional[dict]):
    if choice is None:
        return None
    kind = choice.get("type")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice of type 'tool' needs a name.", param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if mapped is None:
        raise bad_request(f"tool_choice.type must be auto, any, tool or none (got {kind!r}).",
                          param="tool_choice")
    return mapped


def to_chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """An Anthropic request -> the equivalent chat completion request."""
    messages: List[dict] = []
    if req.system is not None:
        system = _text(req.system, "system")
        if system:
            messages.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        messages += [_assistant(m, i)] if m.role == "assistant" else _user(m, i)
    if req.messages[-1].role == "assistant":
        raise bad_request("A final assistant message (prefill) is not supported; end the "
                          "conversation with a user turn.", param="messages")
    extra = req.model_extra or {}
    if "n" in extra:  # one message per request in this API: asking for more is an error
        raise bad_request("n is not a Messages API field: a request returns one message; "
                          "send several requests for several answers.", param="n")
    body: Dict[str, Any] = {k: extra[k] for k in EXTENSIONS if k in extra}
    body.update(model=req.model, messages=messages, tools=_tools(req),
                tool_choice=_tool_choice(req.tool_choice))
    if req.tool_choice and req.tool_choice.get("disable_parallel_tool_use"):
        body["parallel_tool_calls"] = False
    if req.thinking is not None:
        kind = req.thinking.get("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise bad_request("thinking.type must be enabled, disabled or adaptive.",
                              param="thinking")
        kwargs = dict(body.get("chat_template_kwargs") or {})
        kwargs["enable_thinking"] = kind != "disabled"
        body["chat_template_kwargs"] = kwargs
    if isinstance(req, MessagesRequest):
        if req.temperature is not None and not 0.0 <= req.temperature <= 1.0:
            raise bad_request(f"temperature must be between 0 and 1 (got {req.temperature}).",
                              param="temperature")
        body.update(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                    top_k=req.top_k, stop=req.stop_sequences)
    # A block the chat model rejects (e.g. a non-string tool_use id) is a 400 on messages.
    return translated_chat_request(body, "messages", "message content")


# --- response ----------------------------------------------------------------------------
def _input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except (TypeError, json.JSONDecodeError):
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def _cached(done: Done) -> int:
    return (done.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0


def _usage(n_prompt: int, cached: int, n_output: int) -> dict:
    # Anthropic's input_tokens excludes tokens read from the cache.
    return {"input_tokens": n_prompt - cached, "cache_read_input_tokens": cached,
            "output_tokens": n_output}


def _final_usage(done: Done) -> dict:
    return _usage(done.usage["prompt_tokens"], _cached(done), done.usage["completion_tokens"])


class MessageFormatter:
    """Engine events -> an Anthropic message, or its stream events."""

    def __init__(self, state: ServerState, model: str, prepared: PreparedChat,
                 stop_sequences: List[str]):
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.state = state
        self.model = model
        self.n_prompt = len(prepared.ids)
        self.stops = [s for s in stop_sequences if s]
        self.parser = output_parser(state, prepared)
        self.token_ids: List[int] = []
        self.text = ""  # everything the engine sent, for telling stop strings from eos
        self.num_calls = 0
        self.index = -1  # index of the open content block
        self.open_kind: Optional[str] = None
        self.started = False  # message_start sent

    def _message(self, content: list, stop_reason, stop_sequence, usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": usage}

    def _record(self, ev: Delta):
        self.token_ids += ev.token_ids
        self.text += ev.text

    def _stop(self, done: Done):
        """(stop_reason, stop_sequence) of a finished request."""
        if done.finish_reason == "length":
            return "max_tokens", None
        if self.num_calls:
            return "tool_use", None
        seq = getattr(done, "stop_sequence", None) or self._matched_stop(done)
        return ("stop_sequence", seq) if seq else ("end_turn", None)

    def _matched_stop(self, done: Done) -> Optional[str]:
        # The engine sends every step's token ids and text == decode(ids) up to the
        # cut: an eos token ends the id list; a stop string starts where the text ends.
        if not self.stops or done.finish_reason != "stop" or not self.token_ids:
            return None
        if self.token_ids[-1] in getattr(self.state.engine, "eos", ()):
            return None
        if len(self.token_ids) < done.usage.get("completion_tokens", 0):
            return None  # some step sent no event: cannot tell
        full = self.state.tokenizer.decode(self.token_ids)
        hits = [(i, s) for s in self.stops for i in (full.find(s, len(self.text)),) if i >= 0]
        return min(hits)[1] if hits else None

    # streaming: message_start waits for the engine's Admitted (before the first token), so
    # its usage splits the prompt into input and cache reads as the final usage does.
    def start(self) -> List[dict]:
        return []

    def on_admitted(self, ev: Admitted) -> List[dict]:
        return self._start(ev.cached_tokens)

    def _start(self, cached: int) -> List[dict]:
        """message_start, once (a stream without Admitted sends it before its first event)."""
        if self.started:
            return []
        self.started = True
        usage = _usage(self.n_prompt, cached, 0)
        return [{"type": "message_start", "message": self._message([], None, None, usage)}]

    def _close(self) -> List[dict]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _open(self, kind: str, block: dict) -> List[dict]:
        events = self._close()
        self.index += 1
        self.open_kind = kind
        events.append({"type": "content_block_start", "index": self.index, "content_block": block})
        if self.index == 0:
            events.append({"type": "ping"})
        return events

    def _events(self, pieces: List[Piece]) -> List[dict]:
        events: List[dict] = []
        for p in pieces:
            if p.kind == "tool_call":
                self.num_calls += 1
                fn = p.call["function"]
                events += self._open("tool_use", {"type": "tool_use", "id": _tool_id(p.call),
                                                  "name": fn["name"], "input": {}})
                events.append({"type": "content_block_delta", "index": self.index,
                               "delta": {"type": "input_json_delta",
                                         "partial_json": json.dumps(_input(fn["arguments"]))}})
                events += self._close()
                continue
            if p.kind == "reasoning":
                if self.open_kind != "thinking":
                    events += self._open("thinking", {"type": "thinking", "thinking": "",
                                                      "signature": ""})
                delta = {"type": "thinking_delta", "thinking": p.text}
            else:
                if self.open_kind != "text":
                    events += self._open("text", {"type": "text", "text": ""})
                delta = {"type": "text_delta", "text": p.text}
            events.append({"type": "content_block_delta", "index": self.index, "delta": delta})
        return events

    def on_delta(self, ev: Delta) -> List[dict]:
        self._record(ev)
        return self._start(0) + self._events(self.parser.feed(ev.text))

    def on_done(self, done: Done, include_usage: bool = False) -> List[dict]:
        events = self._start(_cached(done)) + self._events(self.parser.finish()) + self._close()
        reason, seq = self._stop(done)
        events.append({"type": "message_delta",
                       "delta": {"stop_reason": reason, "stop_sequence": seq},
                       "usage": _final_usage(done), "mtp": done.mtp, "timings": done.timings})
        events.append({"type": "message_stop"})
        return events

    # stream framing (see pipeline.Pipeline.run_request): named events, no [DONE]
    stream_trailer = ""

    @staticmethod
    def encode_event(obj: dict) -> str:
        return f"event: {obj['type']}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"

    @staticmethod
    def error_events(err: APIError) -> List[dict]:
        return [error_body(err)]

    # whole response
    def response(self, deltas: List[Delta], done: Done) -> dict:
        pieces: List[Piece] = []
        for ev in deltas:
            self._record(ev)
            pieces += self.parser.feed(ev.text)
        pieces += self.parser.finish()
        content: List[dict] = []
        for p in pieces:
            kind, key = ("thinking", "thinking") if p.kind == "reasoning" else ("text", "text")
            if p.kind == "tool_call":
                self.num_calls += 1
                fn = p.call["function"]
                content.append({"type": "tool_use", "id": _tool_id(p.call), "name": fn["name"],
                                "input": _input(fn["arguments"])})
            elif content and content[-1]["type"] == kind:  # pieces of one block
                content[-1][key] += p.text
            elif p.text:
                content.append({"type": kind, key: p.text})
        # As in chat: no padding around thoughts, nor around text next to tool calls.
        for b in content:
            if b["type"] == "thinking":
                b.update(thinking=b["thinking"].strip(), signature="")
            elif b["type"] == "text" and self.num_calls:
                b["text"] = b["text"].strip()
        content = [b for b in content if b.get("thinking", b.get("text", True))]
        reason, seq = self._stop(done)
        out = self._message(content, reason, seq, _final_usage(done))
        out.update(mtp=done.mtp, timings=done.timings)
        return out


def _tool_id(call: dict) -> str:
    return "toolu_" + call["id"].split("_", 1)[-1]
