"""``mlx-mtp serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming
SSE or not; also without the ``/v1`` prefix), ``GET /v1/models`` (with the MTP
capability of the model), ``GET /health``, ``GET /metrics`` (Prometheus).

Every response carries ``usage`` (with ``prompt_tokens_details.cached_tokens``),
llama-server-style ``timings`` (``draft_n``, ``draft_n_accepted``...) and an
``mtp`` block. Errors use the OpenAI envelope ``{"error": {message, type,
param, code}}``; during a stream, one ``data: {"error": ...}`` event ends it.

Prompt preparation lives in ``prompts``, response bodies and stream chunks in
``responses``; this module holds the shared state, request validation, routes,
the command-line arguments and ``run``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import Delta, Done, Engine, EngineRequest, Failed
from .metrics import ServerMetrics
from .prefix_cache import PrefixCache
from .prompts import prepare_chat, prepare_completion
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, bad_request,
                       parse_request)
from .responses import ChatFormatter, CompletionFormatter

log = logging.getLogger("mlx_mtp.server")

KEEPALIVE_SECONDS = 10.0  # SSE comment while nothing else is sent (long prefill)
FIRST_EVENT_WAIT = 2.0  # wait this long for the first event so early failures get a status
MAX_TOP_LOGPROBS = 20


# --- configuration and shared state ---------------------------------------------------------
@dataclass
class ServerState:
    engine: Engine
    tokenizer: Any
    model_name: str
    aliases: set
    context_length: int
    vocab_size: int
    default_max_tokens: int = 512
    sampling_defaults: Dict[str, Any] = field(default_factory=dict)
    template_args: Dict[str, Any] = field(default_factory=dict)
    reasoning_parser: str = "qwen3"
    reasoning_field: str = "reasoning_content"
    tool_call_parser: str = "auto"
    api_key: Optional[str] = None
    model_path: str = ""
    num_mtp_layers: int = 0
    num_draft_tokens: int = 0
    adaptive: bool = True
    max_draft_tokens: int = 8
    created: int = field(default_factory=lambda: int(time.time()))
    tokenize_pool: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="mlx-mtp-tokenize"))

    @property
    def im_start_id(self) -> Optional[int]:
        tok = self.tokenizer
        try:
            i = tok.convert_tokens_to_ids("<|im_start|>")
        except Exception:
            return None
        return i if isinstance(i, int) and i != getattr(tok, "unk_token_id", None) else None


# --- request parameters ----------------------------------------------------------------
_warned = set()


def _warn_once(key: str, msg: str):
    if key not in _warned:
        _warned.add(key)
        log.warning(msg)


def check_model(state: ServerState, req):
    if req.model is not None and req.model not in state.aliases:
        raise APIError(404, f"The model `{req.model}` does not exist. This server serves "
                       f"`{state.model_name}`.", param="model", code="model_not_found")


def resolve_common(state: ServerState, req, n_prompt: int, max_tokens: Optional[int]):
    """Validate generation fields shared by both endpoints -> engine keyword arguments."""
    from ..sampling import SamplingParams
    from ..speculative import MAX_DRAFT_TOKENS

    check_model(state, req)
    if req.n is not None and req.n != 1:
        raise bad_request("Only n=1 is supported.", param="n")
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                          ("repetition_penalty", 1.0)):
        v = getattr(req, name)
        if v is not None and v != neutral:
            _warn_once(name, f"{name} is not supported with speculative decoding yet; "
                       "it is ignored.")
    extra = req.model_extra or {}
    if extra.get("logit_bias"):
        raise bad_request("logit_bias is not supported.", param="logit_bias")
    rf = extra.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise bad_request("response_format (structured output) is not supported.",
                          param="response_format")

    # Context: the prompt plus the completion must fit.
    ctx = state.context_length
    if n_prompt >= ctx:
        raise APIError(400, f"This model's maximum context length is {ctx} tokens. However, "
                       f"your prompt has {n_prompt} tokens. Please reduce the length of the "
                       "prompt.", param="messages", code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(state.default_max_tokens, ctx - n_prompt)
    elif max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1 (got {max_tokens}).",
                          param="max_tokens")
    elif n_prompt + max_tokens > ctx:
        raise APIError(400, f"This model's maximum context length is {ctx} tokens. However, you "
                       f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the prompt, "
                       f"{max_tokens} in the completion). Please reduce the length of the "
                       "prompt or of the completion (max_tokens).",
                       param="max_tokens", code="context_length_exceeded")

    d = state.sampling_defaults
    top_k = req.top_k if req.top_k is not None else d.get("top_k", 0)
    if top_k == -1:  # vLLM's "disabled"
        top_k = 0
    seed = req.seed if req.seed is not None else None
    if seed is not None:
        seed %= 1 << 64
    try:
        sampling = SamplingParams(
            temperature=req.temperature if req.temperature is not None else d.get("temp", 0.0),
            top_p=req.top_p if req.top_p is not None else d.get("top_p", 1.0),
            top_k=top_k,
            min_p=req.min_p if req.min_p is not None else d.get("min_p", 0.0),
            seed=seed,
        )
    except ValueError as e:
        msg = str(e)
        raise bad_request(msg, param=msg.split(" ", 1)[0])

    k = req.num_draft_tokens
    if k is not None:
        if not 0 <= k <= MAX_DRAFT_TOKENS:
            raise bad_request(f"num_draft_tokens must be between 0 and {MAX_DRAFT_TOKENS}.",
                              param="num_draft_tokens")
        if k > 0 and state.num_mtp_layers == 0:
            raise bad_request("This server runs without an MTP head (--no-mtp); "
                              "num_draft_tokens must be 0.", param="num_draft_tokens")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    stop = [s for s in stop if s]
    return dict(max_tokens=max_tokens, sampling=sampling, stop=stop, num_draft_tokens=k,
                cache_prompt=req.cache_prompt is not False)


# --- the application -------------------------------------------------------------------------
def create_app(state: ServerState):
    app = FastAPI(title="mlx-mtp", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    engine = state.engine

    def error_response(e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        msg = {404: f"Not found: {request.url.path}",
               405: f"Method {request.method} not allowed on {request.url.path}"}.get(
                   e.status_code, str(e.detail))
        return error_response(APIError(e.status_code, msg, code=None,
                                       type="invalid_request_error"))

    @app.exception_handler(Exception)
    async def _unhandled(request, e: Exception):
        log.exception("Unhandled error on %s", request.url.path)
        return error_response(APIError(500, f"Internal server error: {type(e).__name__}: {e}",
                                       code="internal_error"))

    def check_auth(request: Request):
        if state.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        if auth != f"Bearer {state.api_key}" and request.headers.get("x-api-key") != state.api_key:
            raise APIError(401, "Invalid or missing API key (send 'Authorization: Bearer KEY').",
                           code="invalid_api_key")

    @app.get("/health")
    @app.get("/v1/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine.metrics.render(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict:
        return {
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "mlx-mtp",
            "root": state.model_path,
            "parent": None,
            "max_model_len": state.context_length,
            "mtp": {
                "available": state.num_mtp_layers > 0,
                "enabled": state.num_draft_tokens > 0,
                "num_layers": state.num_mtp_layers,
                "num_draft_tokens": state.num_draft_tokens,
                "max_draft_tokens": state.max_draft_tokens,
                "adaptive": state.adaptive,
            },
            "capabilities": {
                "chat_completions": True,
                "completions": True,
                "tool_calls": state.tool_call_parser != "none",
                "reasoning": state.reasoning_parser != "none",
                "speculative_decoding": "mtp" if state.num_draft_tokens > 0 else None,
                "continuous_batching": True,
                "prefix_cache": engine.prefix_cache.enabled,
            },
        }

    @app.get("/v1/models")
    async def list_models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request):
        check_auth(request)
        if model_id not in state.aliases:
            raise APIError(404, f"The model `{model_id}` does not exist.", param="model",
                           code="model_not_found")
        return model_card()

    async def tokenize(fn, *args):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(state.tokenize_pool, fn, *args)

    async def run_request(request: Request, ereq_kwargs: dict, prompt: List[int],
                          boundaries: List[int], logprobs: Optional[int], fmt, stream: bool,
                          include_usage: bool):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def on_event(ev):
            loop.call_soon_threadsafe(queue.put_nowait, ev)

        ereq = EngineRequest(prompt=prompt, on_event=on_event, logprobs=logprobs,
                             boundaries=boundaries, **ereq_kwargs)
        try:
            engine.submit(ereq)
        except OverflowError as e:
            raise APIError(503, str(e), code="server_overloaded",
                           type="service_unavailable_error")
        except RuntimeError as e:
            raise APIError(503, str(e), code="shutting_down", type="service_unavailable_error")

        def failed(ev: Failed) -> APIError:
            return APIError(ev.status, ev.message, code=ev.code)

        if not stream:
            deltas: List[Delta] = []
            try:
                while True:
                    try:
                        ev = await asyncio.wait_for(queue.get(), 1.0)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            engine.cancel(ereq)
                            return Response(status_code=499)
                        continue
                    if isinstance(ev, Delta):
                        deltas.append(ev)
                    elif isinstance(ev, Done):
                        return fmt.response(deltas, ev)
                    elif isinstance(ev, Failed):
                        raise failed(ev)
            finally:
                engine.cancel(ereq)  # no-op once finished; frees the slot if we were cancelled

        # Streaming: wait briefly for the first event so that an early failure
        # (e.g. out of memory during prefill) gets a real HTTP status.
        first = None
        try:
            first = await asyncio.wait_for(queue.get(), FIRST_EVENT_WAIT)
        except asyncio.TimeoutError:
            pass
        except BaseException:
            engine.cancel(ereq)
            raise
        if isinstance(first, Failed):
            raise failed(first)

        def sse(obj) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        async def events():
            finished = False
            try:
                for c in fmt.start():
                    yield sse(c)
                pending = first
                while True:
                    if pending is not None:
                        ev, pending = pending, None
                    else:
                        try:
                            ev = await asyncio.wait_for(queue.get(), KEEPALIVE_SECONDS)
                        except asyncio.TimeoutError:
                            yield ": keepalive\n\n"
                            continue
                    if isinstance(ev, Delta):
                        for c in fmt.on_delta(ev):
                            yield sse(c)
                    elif isinstance(ev, Done):
                        finished = True
                        for c in fmt.on_done(ev, include_usage):
                            yield sse(c)
                        yield "data: [DONE]\n\n"
                        return
                    elif isinstance(ev, Failed):
                        finished = True
                        yield sse(failed(ev).body())
                        return
            finally:
                if not finished:
                    engine.cancel(ereq)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request):
        check_auth(request)
        req = parse_request(await request.body(), ChatCompletionRequest)
        check_model(state, req)
        prepared = await tokenize(prepare_chat, state, req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        kw = resolve_common(state, req, len(prepared.ids), max_tokens)
        logprobs = None
        if req.logprobs:
            top = req.top_logprobs or 0
            if not 0 <= top <= MAX_TOP_LOGPROBS:
                raise bad_request(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}.",
                                  param="top_logprobs")
            logprobs = top
        elif req.top_logprobs:
            raise bad_request("top_logprobs requires logprobs=true.", param="top_logprobs")
        parse_tools = prepared.tools is not None and state.tool_call_parser != "none"
        fmt = ChatFormatter(state, req.model or state.model_name, prepared, logprobs,
                            parse_tools)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await run_request(request, kw, prepared.ids, prepared.boundaries, logprobs, fmt,
                                 bool(req.stream), include_usage)

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: Request):
        check_auth(request)
        req = parse_request(await request.body(), CompletionRequest)
        check_model(state, req)
        if req.echo:
            raise bad_request("echo is not supported.", param="echo")
        if req.suffix:
            raise bad_request("suffix is not supported.", param="suffix")
        if req.best_of is not None and req.best_of != 1:
            raise bad_request("Only best_of=1 is supported.", param="best_of")
        ids = await tokenize(prepare_completion, state, req)
        kw = resolve_common(state, req, len(ids), req.max_tokens)
        logprobs = req.logprobs
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}.",
                              param="logprobs")
        fmt = CompletionFormatter(state, req.model or state.model_name, logprobs)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await run_request(request, kw, ids, [len(ids) - 1] if len(ids) > 1 else [],
                                 logprobs, fmt, bool(req.stream), include_usage)

    return app


# --- command line --------------------------------------------------------------------------------
def _size(text: str) -> int:
    """'2G', '512M', '1000000' -> bytes."""
    t = str(text).strip().upper().rstrip("B").rstrip("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    try:
        if t and t[-1] in mult:
            return int(float(t[:-1]) * mult[t[-1]])
        return int(t)
    except ValueError:
        import argparse

        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512M, 2G, 1000000)")


def add_arguments(p):
    from ..cli import add_model_arguments, add_sampling_arguments

    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="Address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="Port (default 8080)")
    add_sampling_arguments(p)
    p.add_argument("--max-tokens", "-m", type=int, default=512,
                   help="Default max_tokens of a request (default 512)")
    p.add_argument("--chat-template", default=None,
                   help="Chat template to use instead of the model's (a file or a Jinja string)")
    p.add_argument("--chat-template-args", default=None,
                   help='JSON passed to the chat template, e.g. \'{"enable_thinking": true}\' '
                        "(requests may override with chat_template_kwargs)")
    p.add_argument("--max-kv-size", "--max-model-len", type=int, default=None,
                   dest="max_kv_size",
                   help="Context limit in tokens (prompt + completion); default: the model's "
                        "max_position_embeddings")
    p.add_argument("--prefill-step-size", type=int, default=512,
                   help="Prompt tokens processed per scheduler iteration (default 512)")
    p.add_argument("--max-concurrency", "--decode-concurrency", type=int, default=16,
                   dest="max_concurrency",
                   help="Maximum number of requests in the running batch (default 16)")
    p.add_argument("--max-queue", type=int, default=1024,
                   help="Maximum number of waiting requests before answering 503 (default 1024)")
    p.add_argument("--prompt-cache-size", type=int, default=32,
                   help="Maximum number of prompt-prefix states kept (0 disables; default 32)")
    p.add_argument("--prompt-cache-bytes", type=_size, default=2 << 30,
                   help="Maximum memory of the prompt-prefix cache (default 2G)")
    p.add_argument("--api-key", default=os.environ.get("MLX_MTP_API_KEY"),
                   help="Require 'Authorization: Bearer KEY' (default: $MLX_MTP_API_KEY)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="Model name(s) in the API (default: the --model argument)")
    p.add_argument("--reasoning-parser", choices=["qwen3", "none"], default="qwen3",
                   help="Split <think>...</think> into a reasoning field (default qwen3)")
    p.add_argument("--reasoning-field", choices=["reasoning_content", "reasoning", "both"],
                   default="reasoning_content",
                   help="Name of the reasoning field in responses (default reasoning_content)")
    p.add_argument("--tool-call-parser", choices=["auto", "hermes", "qwen3_coder", "none"],
                   default="auto",
                   help="Tool-call format; auto accepts both Hermes JSON and Qwen3-Coder XML")
    p.add_argument("--allowed-origins", nargs="*", default=None,
                   help="CORS allowed origins (default: CORS disabled)")
    p.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   type=str.upper)
    p.add_argument("--log-interval", type=float, default=10.0,
                   help="Seconds between throughput/acceptance log lines (0 disables)")
    p.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="Seconds to wait for open connections on shutdown (default 5)")


def _read_template(value: str) -> str:
    """A template file's contents, or the argument itself (an inline Jinja template)."""
    try:
        p = Path(value).expanduser()
        if "\n" not in value and p.is_file():
            return p.read_text()
    except OSError:  # not a usable path (too long...): inline template
        pass
    return value


def _set_chat_template(tokenizer, template: str):
    """Replace the chat template the tokenizer renders with."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    inner.chat_template = template
    if getattr(tokenizer, "_chat_template", None) is not None:
        tokenizer._chat_template = None  # a custom renderer would bypass the new template


def _check_port(host: str, port: int):
    import socket

    from ..cli import UserError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UserError(f"cannot resolve --host {host!r}: {e}")
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e} "
                            "(is another server running? pick another --port)")


def build_state(args, model, tokenizer, config: dict, k: int, sampling_defaults: dict,
                template_args: dict, model_path=None) -> ServerState:
    text_cfg = config.get("text_config", config)
    ctx = args.max_kv_size or text_cfg.get("max_position_embeddings") or 32768
    vocab = text_cfg.get("vocab_size") or len(tokenizer.get_vocab())
    names = args.served_model_name or [args.model if args.model else "mlx-mtp-demo"]
    aliases = set(names)
    if args.model:
        aliases.add(args.model)
        resolved = str(Path(args.model).expanduser().resolve())
        aliases.update({resolved, Path(resolved).name})
    num_layers = int(getattr(model, "num_mtp_layers", 0) or 0)
    metrics = ServerMetrics(names[0])
    engine = Engine(
        model, tokenizer, num_draft_tokens=k, adaptive=not args.fixed_k,
        max_concurrency=args.max_concurrency, prefill_step_size=args.prefill_step_size,
        prefix_cache=PrefixCache(args.prompt_cache_size, args.prompt_cache_bytes),
        metrics=metrics, max_queue=args.max_queue, model_name=names[0],
        log_interval=args.log_interval,
    )
    from ..speculative import MAX_DRAFT_TOKENS

    return ServerState(
        engine=engine, tokenizer=tokenizer, model_name=names[0], aliases=aliases,
        context_length=int(ctx), vocab_size=int(vocab), default_max_tokens=args.max_tokens,
        sampling_defaults=sampling_defaults, template_args=template_args,
        reasoning_parser=args.reasoning_parser, reasoning_field=args.reasoning_field,
        tool_call_parser=args.tool_call_parser, api_key=args.api_key or None,
        model_path=str(model_path) if model_path else str(args.model or ""),
        num_mtp_layers=num_layers, num_draft_tokens=k, adaptive=not args.fixed_k,
        max_draft_tokens=MAX_DRAFT_TOKENS,
    )


def run(args) -> int:
    import uvicorn

    from ..cli import UserError, num_draft_tokens_from_args, parse_json_arg
    from ..loader import generation_defaults, load, load_config, resolve_model_path
    from ..sampling import SamplingParams

    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(args.log_level)
    k = num_draft_tokens_from_args(args)
    template_args = parse_json_arg(args.chat_template_args, "--chat-template-args")
    for flag, v, lo in (("--max-tokens", args.max_tokens, 1),
                        ("--prefill-step-size", args.prefill_step_size, 1),
                        ("--max-concurrency", args.max_concurrency, 1),
                        ("--max-queue", args.max_queue, 1),
                        ("--prompt-cache-size", args.prompt_cache_size, 0)):
        if v < lo:
            raise UserError(f"{flag} must be >= {lo} (got {v})")
    if args.max_kv_size is not None and args.max_kv_size < 2:
        raise UserError(f"--max-kv-size must be >= 2 (got {args.max_kv_size})")
    if not 0 < args.port < 65536:
        raise UserError(f"--port must be between 1 and 65535 (got {args.port})")

    _check_port(args.host, args.port)  # before spending minutes loading a model
    path = resolve_model_path(args.model)
    defaults = generation_defaults(args.model)
    for name, flag in (("temp", "temp"), ("top_p", "top_p"), ("top_k", "top_k"),
                       ("min_p", "min_p")):
        v = getattr(args, flag)
        if v is not None:
            defaults[name] = v
    try:
        SamplingParams(temperature=defaults.get("temp", 0.0), top_p=defaults.get("top_p", 1.0),
                       top_k=defaults.get("top_k", 0), min_p=defaults.get("min_p", 0.0))
    except ValueError as e:
        raise UserError(str(e))
    if args.seed is not None:
        import mlx.core as mx

        mx.random.seed(args.seed)

    log.info("Loading %s (MTP %s)", path, f"K={k}" if k else "off")
    model, tokenizer = load(args.model, mtp=k > 0, mtp_hidden=args.mtp_hidden)
    if args.chat_template:
        _set_chat_template(tokenizer, _read_template(args.chat_template))
    state = build_state(args, model, tokenizer, load_config(path), k, defaults, template_args,
                        model_path=path)
    app = create_app(state)
    if args.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins,
                           allow_methods=["*"], allow_headers=["*"])

    engine = state.engine
    engine.start()

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn's version re-raises the signal after the graceful
            # shutdown (exit status 130/143); a clean stop here exits with 0.
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            original = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, h in original.items():
                    signal.signal(s, h)

        def handle_exit(self, sig, frame):
            # End running streams now (they get an error event) instead of
            # letting the graceful shutdown wait for them; a second Ctrl-C
            # forces the exit.
            engine.shutdown(timeout=0)
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    config = uvicorn.Config(app, host=args.host, port=args.port,
                            log_level=args.log_level.lower(),
                            timeout_graceful_shutdown=args.shutdown_timeout,
                            access_log=args.log_level == "DEBUG")
    log.info("mlx-mtp serving %s at http://%s:%d/v1 (MTP: %s, max concurrency %d, "
             "context %d tokens)", state.model_name, args.host, args.port,
             f"{state.num_mtp_layers} layer(s), K={k}{'' if args.fixed_k else ' adaptive'}"
             if k else "off", args.max_concurrency, state.context_length)
    server = Server(config)
    try:
        server.run()  # exits the process with status 1 if the port cannot be bound
    finally:
        engine.shutdown()
        state.tokenize_pool.shutdown(wait=False, cancel_futures=True)
    log.info("Server stopped.")
    return 0
