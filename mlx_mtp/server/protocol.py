"""Request models of the OpenAI-compatible API and the OpenAI error envelope.

Models are strict about types (a string where a number belongs is a 400, not a
silent coercion) and lenient about unknown fields (clients send ``user``,
``metadata``, ``store``... which are ignored).
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .. import decode

# OpenAI's "type" for each HTTP status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error answered with the OpenAI envelope ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None,
                 code: Optional[str] = None, type: Optional[str] = None,
                 headers: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.status = status
        self.headers = dict(headers or {})  # e.g. WWW-Authenticate on a 401
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ERROR_TYPES.get(status, "server_error" if status >= 500
                                            else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: Optional[str] = None, code: str = "invalid_value"):
    return APIError(400, message, param=param, code=code)


def check_draft_source(value: Optional[str]) -> Optional[str]:
    """A request's ``draft_source`` (None: the server's --draft-source)."""
    try:
        return None if value is None else decode.check_draft_source(value)
    except ValueError as e:
        raise bad_request(str(e), param="draft_source")


class _Base(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Base):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class FunctionCall(_Base):
    name: str
    arguments: Optional[Union[str, Dict[str, Any]]] = None


class ToolCall(_Base):
    id: Optional[str] = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, List[Union[str, Dict[str, Any]]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[List[ToolCall]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None


class FunctionDefinition(_Base):
    name: str
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(_Base):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class _GenerationFields(_Base):
    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = 1
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    # mlx-lm's per-request draft depth; 0 disables MTP for this request.
    num_draft_tokens: Optional[int] = None
    # llama-server's switch for prompt (prefix) caching.
    cache_prompt: Optional[bool] = True
    # Ours: sampled drafts share the target's noise (SamplingParams.coupled), so a seeded
    # answer is the same with MTP on or off; None: the server's --coupled.
    mtp_coupled: Optional[bool] = None
    # Ours: where drafts come from, mtp | lookup | both (decode/draft_source.py); None: the
    # server's --draft-source.
    draft_source: Optional[str] = None


class ChatCompletionRequest(_GenerationFields):
    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    tools: Optional[List[Tool]] = None
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None


class CompletionRequest(_GenerationFields):
    prompt: Union[str, List[int], List[str], List[List[int]]]
    logprobs: Optional[int] = None
    echo: Optional[bool] = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None


def translated_chat_request(body: dict, content_param: str, what: str) -> "ChatCompletionRequest":
    """The chat request another API's request was translated to, or APIError(400): a bad
    value of a field passed through (a penalty, the seed...) is named as that field, any
    other problem as one of the content (``content_param``) described as ``what``."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        top = str(err["loc"][0]) if err.get("loc") else ""
        if top in body and top not in ("messages", "tools", "tool_choice"):
            raise bad_request(f"Invalid request: {_loc(err['loc'])}: {err.get('msg')}",
                              param=top)
        raise bad_request(f"Invalid {what}: {e}", param=content_param)


def _loc(loc) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


MAX_JSON_DEPTH = 64  # far deeper than any real request (tool schemas included)
# How a UTF-16 surrogate gets into a string: a \u escape, or its UTF-8 form (json.loads
# decodes bytes with "surrogatepass").
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}|\xed[\xa0-\xbf]")


def _too_deep(data, limit: int) -> bool:
    stack = [(data, 1)]
    while stack:
        obj, depth = stack.pop()
        if depth > limit:
            return True
        for child in (obj.values() if isinstance(obj, dict) else obj):
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False


def _has_lone_surrogate(data) -> bool:
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def load_json_body(raw: bytes) -> dict:
    """Bytes of a request body -> a JSON object no deeper than ``MAX_JSON_DEPTH`` whose
    strings are valid Unicode, or APIError(400)."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"The request body is not valid JSON: {e}", code="invalid_json")
    except RecursionError:
        data = None
        deep = True
    else:
        # Cheap test first: fewer brackets than the limit cannot nest deeper.
        deep = (raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH
                and _too_deep(data, MAX_JSON_DEPTH))
    if deep:
        raise APIError(400, f"The request body is nested more than {MAX_JSON_DEPTH} levels "
                       "deep.", code="invalid_json")
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(data):
        raise APIError(400, "The request body contains a lone UTF-16 surrogate (\\ud800-"
                       "\\udfff without its pair); strings must be valid Unicode.",
                       code="invalid_json")
    return data


def parse_request(raw: bytes, model_cls):
    """Bytes of a request body -> validated model, or APIError(400)."""
    data = load_json_body(raw)
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        errs = e.errors(include_url=False)
        parts, seen = [], set()
        for err in errs:
            loc = _loc(err.get("loc", ())) or "body"
            top = str(err["loc"][0]) if err.get("loc") else "body"
            if top in seen:  # a union reports one error per member: keep the first
                continue
            seen.add(top)
            parts.append(f"{loc}: {err.get('msg')}")
        param = str(errs[0]["loc"][0]) if errs and errs[0].get("loc") else None
        kind = "invalid_type" if any(x.get("type", "").endswith(("_type", "_parsing"))
                                     for x in errs) else "invalid_value"
        raise APIError(400, "Invalid request: " + "; ".join(parts), param=param, code=kind)
