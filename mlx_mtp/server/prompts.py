"""Request -> prompt: chat messages normalised for the chat template (text parts,
``developer`` role, tool-call arguments decoded), request template variables checked,
``tool_choice`` applied, the template applied and tokenized, and the prefix-cache
boundaries; plain completion prompts checked. Runs on a prompt worker thread
(``state.PromptWorkers``) with that thread's own tokenizer.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from ..decode.prompt import chat_template_args
from .images import image_url, no_images, no_images_with_block_drafter
from .parsers import OutputParser
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, bad_request

if TYPE_CHECKING:
    from .state import ServerState

# Arguments of the template renderer itself (transformers' apply_chat_template and the
# variables it sets), never template variables a request may set: a request-supplied
# ``chat_template`` would run arbitrary Jinja loops on the prompt thread.
RENDERER_PARAMS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "tokenizer_kwargs", "return_dict", "return_tensors",
    "return_assistant_tokens_mask", "padding", "truncation", "max_length",
    "sanitize_control_tokens", "raise_exception", "strftime_now"})
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@functools.lru_cache(maxsize=8)
def _renderer_params(tokenizer_type) -> frozenset:
    try:
        params = inspect.signature(tokenizer_type.apply_chat_template).parameters.values()
    except (AttributeError, TypeError, ValueError):
        return frozenset()
    return frozenset(p.name for p in params if p.name != "self" and p.kind not in
                     (p.VAR_KEYWORD, p.VAR_POSITIONAL))


def check_template_variables(tok, variables: Dict[str, Any]):
    """A request's ``chat_template_kwargs``: plain variables the template reads
    (``enable_thinking``...), never renderer parameters or special-token names."""
    inner = getattr(tok, "_tokenizer", tok)
    reserved = (RENDERER_PARAMS | _renderer_params(type(inner))
                | set(getattr(inner, "special_tokens_map", None) or ()))
    for name in variables:
        param = f"chat_template_kwargs.{name}"
        if not _IDENTIFIER.match(name):
            raise bad_request(f"chat_template_kwargs: {name!r} is not a template variable "
                              "name.", param=param)
        if name in reserved:
            raise bad_request(f"chat_template_kwargs: {name!r} is a parameter of the template "
                              "renderer, not a template variable; a request cannot set it.",
                              param=param)


def check_prompt_chars(state: ServerState, n_chars: int, param: str):
    """Refuse, without tokenizing, a text longer than the context could hold."""
    per_token = state.max_chars_per_token
    if per_token and n_chars > state.context_length * per_token:
        raise APIError(400, f"This model's maximum context length is {state.context_length} "
                       f"tokens. However, your prompt has {n_chars} characters, more than "
                       f"that many tokens can hold (one token covers at most {per_token} "
                       "characters). Please reduce the length of the prompt.", param=param,
                       code="context_length_exceeded")


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


def _content_parts(content: list, i: int) -> list:
    """A message's parts for the template: text parts, and ``{"type": "image"}`` items (the
    template writes their placeholders) that keep their URL and place in the request."""
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            parts.append({"type": "text", "text": part})
        elif part.get("type") == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif part.get("type") == "text":
            raise bad_request(f"messages[{i}].content: a text part's text must be a "
                              "string", param="messages")
        elif part.get("type") == "image_url":
            where = f"messages[{i}].content[{j}]"
            parts.append({"type": "image", "url": image_url(part, where), "where": where})
        else:
            raise bad_request(
                f"messages[{i}].content: only text and image_url parts are supported "
                f"(got type {part.get('type')!r})", param="messages")
    if any(p["type"] == "image" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _template_messages(req: ChatCompletionRequest) -> List[dict]:
    out = []
    for i, m in enumerate(req.messages):
        d: Dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
        content = m.content
        if isinstance(content, list):
            content = _content_parts(content, i)
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
    # Text appended to the prompt to force a tool call (tool_choice); the output parser
    # reads it first, as if the model had written it.
    forced_prefix: str = ""
    images: Optional[Any] = None  # models.vision.images.ImageBatch: the prompt's images


def output_parser(state: ServerState, prepared: PreparedChat) -> OutputParser:
    """The parser of the answer to ``prepared``, in the server's reasoning and tool-call
    formats, from where the prompt leaves off (inside a think block, or in a forced tool
    call whose opening it reads first, as if the model had written it)."""
    parse_tools = prepared.tools is not None and state.tool_call_parser != "none"
    parser = OutputParser(reasoning=state.reasoning_parser != "none",
                          start_in_reasoning=prepared.start_in_reasoning, tools=prepared.tools,
                          parse_tools=parse_tools, tool_format=state.tool_call_parser)
    if prepared.forced_prefix:
        parser.feed(prepared.forced_prefix)
    return parser


def forced_tool(req: ChatCompletionRequest) -> Optional[str]:
    """The tool_choice in force: None (auto or none), "required" or a function name."""
    choice = req.tool_choice
    names = [t.function.name for t in req.tools or []]
    if choice is None or choice in ("auto", "none"):
        return None
    if isinstance(choice, str) and choice != "required":
        raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or "
                          f"{{'type': 'function', 'function': {{'name': ...}}}} (got {choice!r}).",
                          param="tool_choice")
    if not names:
        raise bad_request("tool_choice is only allowed when tools are specified.",
                          param="tool_choice")
    if choice == "required":
        return names[0] if len(names) == 1 else "required"
    fn = choice.get("function") if choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad_request("tool_choice must be {'type': 'function', 'function': {'name': ...}}.",
                          param="tool_choice")
    if name not in names:
        raise bad_request(f"tool_choice names the function {name!r}, which is not among the "
                          f"tools ({', '.join(map(repr, names))}).", param="tool_choice")
    return name


def tool_call_format(state: ServerState, tok) -> str:
    """The model's tool-call format: "qwen3_coder" (XML) or "hermes" (JSON)."""
    fmt = state.tool_call_parser
    if fmt == "auto":
        fmt = "qwen3_coder" if "<function=" in str(getattr(tok, "chat_template", "")) \
            else "hermes"
    return fmt


def _tool_call_opening(state: ServerState, tok, forced: str) -> str:
    """The start of a tool call in the model's own format; with a name, of a call to it."""
    name = None if forced == "required" else forced
    fmt = tool_call_format(state, tok)
    if fmt == "qwen3_coder":
        return "<tool_call>\n<function=" + (f"{name}>\n" if name else "")
    return "<tool_call>\n" + (f'{{"name": {json.dumps(name)}, "arguments": ' if name else "")


def prepare_chat(state: ServerState, req: ChatCompletionRequest, tok=None) -> PreparedChat:
    """``tok``: the calling thread's tokenizer (default ``state.tokenizer``)."""
    tok = tok if tok is not None else state.tokenizer
    if not getattr(tok, "chat_template", None):
        raise bad_request("This model has no chat template; use /v1/completions.",
                          param="messages")
    messages = _template_messages(req)
    urls = _image_urls(state, messages)  # a server without images says so, not its template
    forced = forced_tool(req)
    if forced is not None and state.tool_call_parser == "none":
        raise bad_request("tool_choice needs tool-call parsing, which this server has off "
                          "(--tool-call-parser none).", param="tool_choice")
    use_tools = bool(req.tools) and req.tool_choice != "none"
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if use_tools else None
    check_template_variables(tok, req.chat_template_kwargs or {})
    # The defaults `generate` uses too, then --chat-template-args, then the request's.
    kwargs = chat_template_args(state.template_args, req.chat_template_kwargs)
    for reserved in ("tools", "tokenize", "add_generation_prompt", "conversation", "messages"):
        kwargs.pop(reserved, None)  # from --chat-template-args
    try:
        text = tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                       add_generation_prompt=True, **kwargs)
    except APIError:
        raise
    except Exception as e:  # jinja2 errors and the template's raise_exception
        raise bad_request(f"The chat template could not render these messages: {e}",
                          param="messages", code="invalid_messages")
    start_in_reasoning = (state.reasoning_parser != "none"
                          and text.rstrip().endswith("<think>"))
    prefix = ""
    if forced is not None:
        # A forced call skips the thoughts: close the think block the prompt opened.
        if text.rstrip().endswith("<think>"):
            text, prefix = text.rstrip(), "\n\n</think>\n\n"
        prefix += _tool_call_opening(state, tok, forced)
    check_prompt_chars(state, len(text) + len(prefix), "messages")
    ids = tok.encode(text + prefix, add_special_tokens=False)
    if not ids:
        raise bad_request("The prompt is empty after applying the chat template.",
                          param="messages")
    ids, images = state.images.prepare(ids, urls) if urls else (ids, None)
    # Reusable prefix boundaries: after the first turn (shared system prompts),
    # before the final generation header (the history, reused by the next
    # turn), and the whole prompt (repeats).
    bounds = {len(ids) - 1}
    im = state.im_start_id
    if im is not None:
        starts = [i for i, t in enumerate(ids) if t == im]
        if len(starts) >= 2:
            bounds.update((starts[1], starts[-1]))
    return PreparedChat(ids, sorted(b for b in bounds if b > 0), start_in_reasoning, tools,
                        prefix, images)


def _image_urls(state: ServerState, messages: List[dict]) -> list:
    """The messages' image parts as (url, where), checked usable on this server."""
    urls = [(p["url"], p["where"]) for m in messages if isinstance(m["content"], list)
            for p in m["content"] if p["type"] == "image"]
    if urls and state.images is None:
        raise no_images(urls[0][1])
    if urls and state.block_drafter:
        raise no_images_with_block_drafter(urls[0][1])
    return urls


def prepare_completion(state: ServerState, req: CompletionRequest, tok=None) -> List[int]:
    tok = tok if tok is not None else state.tokenizer
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise bad_request("Only one prompt per request is supported.", param="prompt")
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise bad_request("The prompt is empty.", param="prompt")
        check_prompt_chars(state, len(p), "prompt")
        from ..decode.prompt import encode_prompt

        try:
            return encode_prompt(tok, p)
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
