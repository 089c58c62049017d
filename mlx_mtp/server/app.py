"""``mlx-mtp serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming
SSE or not; also without the ``/v1`` prefix), ``GET /v1/models`` (with the MTP
capability of the model), ``GET /health``, ``GET /metrics`` (Prometheus); the
Anthropic Messages API (``anthropic``) and the OpenAI Responses API
(``openai_responses``) are translated onto the chat pipeline in their own modules.

Every response carries ``usage`` (with ``prompt_tokens_details.cached_tokens``),
llama-server-style ``timings`` (``draft_n``, ``draft_n_accepted``...) and an
``mtp`` block. Errors use the OpenAI envelope ``{"error": {message, type,
param, code}}``; during a stream, one ``data: {"error": ...}`` event ends it.

Prompt preparation lives in ``prompts``, response bodies and stream chunks in
``responses``, the shared state in ``state``, the command in ``main``; this module
holds request validation and the routes.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from typing import List, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..decode.grammar import first_line
from .choices import choice_kwargs, merge_choices, stream_choices  # noqa: F401 (re-exported)
from .events import Delta, Done, EngineRequest, EngineUnavailable, Failed
from .http_guard import BODY_BYTES, GuardConfig, RequestGuard
from .prompts import forced_tool, prepare_chat, prepare_completion
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, bad_request,
                       check_draft_source, parse_request)
from .responses import ChatFormatter, CompletionFormatter
from .state import ServerState
from .structured import compile_constraint

log = logging.getLogger("mlx_mtp.server")

KEEPALIVE_SECONDS = 10.0  # SSE comment while nothing else is sent (long prefill)
FIRST_EVENT_WAIT = 2.0  # wait this long for the first event so early failures get a status
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 16  # n: independent choices of one request, each a row of the batch
MAX_TEMPERATURE = 2.0  # OpenAI's range
# Stop strings: OpenAI allows 4; a few more for clients that send their own set. Both caps
# bound the per-step hold-back and matching work of a stream.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


# --- request parameters ----------------------------------------------------------------
def check_model(state: ServerState, req):
    if req.model is not None and req.model not in state.aliases:
        raise APIError(404, f"The model `{req.model}` does not exist. This server serves "
                       f"`{state.model_name}`.", param="model", code="model_not_found")


def check_stop(stop) -> List[str]:
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"At most {MAX_STOP_STRINGS} stop sequences are supported "
                          f"(got {len(stop)}).", param="stop")
    long = [s for s in stop if len(s) > MAX_STOP_CHARS]
    if long:
        raise bad_request(f"Stop sequences may be at most {MAX_STOP_CHARS} characters long "
                          f"(got one of {len(long[0])}).", param="stop")
    return [s for s in stop if s]


def _or(value, default):
    return default if value is None else value


def check_logit_bias(bias, vocab_size: int):
    """OpenAI's ``logit_bias``: token id (a JSON string) -> bias in [-100, 100]."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise bad_request("logit_bias must be an object mapping token ids to biases.",
                          param="logit_bias")
    out = {}
    for key, value in bias.items():
        try:
            tok = int(key)
        except (TypeError, ValueError):
            raise bad_request(f"logit_bias keys must be token ids (got {key!r}).",
                              param="logit_bias")
        if not 0 <= tok < vocab_size:
            raise bad_request(f"logit_bias token id {tok} is outside the vocabulary "
                              f"(0..{vocab_size - 1}).", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not -100 <= value <= 100:
            raise bad_request(f"logit_bias values must be numbers in [-100, 100] "
                              f"(got {value!r} for token {tok}).", param="logit_bias")
        out[tok] = float(value)
    return out or None


def resolve_common(state: ServerState, req, n_prompt: int, max_tokens: Optional[int],
                   prompt_param: str = "messages"):
    """Validate generation fields shared by both endpoints -> engine keyword arguments."""
    from ..decode.sampling import SamplingParams
    from ..decode import check_num_draft_tokens

    check_model(state, req)
    n = 1 if req.n is None else req.n
    if isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"n must be between 1 and {MAX_CHOICES} (got {req.n}).", param="n")
    extra = req.model_extra or {}
    logit_bias = check_logit_bias(extra.get("logit_bias"), state.vocab_size)

    # Context: the prompt plus the completion must fit.
    ctx = state.context_length
    if n_prompt >= ctx:
        raise APIError(400, f"This model's maximum context length is {ctx} tokens. However, "
                       f"your prompt has {n_prompt} tokens. Please reduce the length of the "
                       "prompt.", param=prompt_param, code="context_length_exceeded")
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

    if req.temperature is not None and not 0 <= req.temperature <= MAX_TEMPERATURE:
        raise bad_request(f"temperature must be between 0 and {MAX_TEMPERATURE:g} "
                          f"(got {req.temperature}).", param="temperature")
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
            presence_penalty=_or(req.presence_penalty, d.get("presence_penalty", 0.0)),
            frequency_penalty=_or(req.frequency_penalty, d.get("frequency_penalty", 0.0)),
            repetition_penalty=_or(req.repetition_penalty, d.get("repetition_penalty", 1.0)),
            logit_bias=logit_bias,
            coupled=_or(req.mtp_coupled, bool(d.get("coupled", False))),
        )
    except ValueError as e:
        msg = str(e)
        raise bad_request(msg, param=msg.split(" ", 1)[0])

    k = req.num_draft_tokens
    if k is not None:
        try:
            check_num_draft_tokens(k)
        except ValueError as e:
            raise bad_request(str(e), param="num_draft_tokens")
        if k > 0 and state.num_mtp_layers == 0:
            raise bad_request("This server runs without an MTP head (--no-mtp); "
                              "num_draft_tokens must be 0.", param="num_draft_tokens")
    stop = check_stop(req.stop)
    return dict(max_tokens=max_tokens, sampling=sampling, stop=stop, num_draft_tokens=k,
                cache_prompt=req.cache_prompt is not False,
                draft_source=check_draft_source(req.draft_source))


def _parse_off_loop(raw: bytes, model_cls, tok=None):
    return parse_request(raw, model_cls)


DISCONNECTED = object()  # queued by _disconnected when the client goes away


async def _disconnected(request: Request, queue: asyncio.Queue):
    """Wait until the client disconnects (the body has been read), then tell ``queue``."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    queue.put_nowait(DISCONNECTED)


# --- the application -------------------------------------------------------------------------
def create_app(state: ServerState, guard: Optional[GuardConfig] = None):
    """The FastAPI app; ``guard``: size, time and browser limits (defaults if None)."""
    app = FastAPI(title="mlx-mtp", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.add_middleware(RequestGuard, config=guard or GuardConfig(
        check_origin=state.api_key is None))
    engine = state.engine

    def error_response(e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers or None)

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
        return error_response(APIError(500, f"Internal server error: {type(e).__name__}: "
                                       f"{first_line(e)}", code="internal_error"))

    expected_key = state.api_key.encode() if state.api_key is not None else None

    def key_matches(sent: Optional[str]) -> bool:
        # Constant time: the comparison must not reveal how much of a guess was right.
        return sent is not None and hmac.compare_digest(sent.strip().encode(), expected_key)

    def check_auth(request: Request):
        if expected_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if not ((scheme.lower() == "bearer" and key_matches(token))
                or key_matches(request.headers.get("x-api-key"))):
            raise APIError(401, "Invalid or missing API key (send 'Authorization: Bearer KEY').",
                           code="invalid_api_key",
                           headers={"WWW-Authenticate": 'Bearer realm="mlx-mtp"'})

    @app.get("/health")
    @app.get("/v1/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(request: Request):
        if state.protect_metrics:
            check_auth(request)
        return PlainTextResponse(engine.metrics.render(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict:
        return {
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "mlx-mtp",
            "root": state.model_name,
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

    async def parse_body(request: Request, model_cls):
        raw = await request.body()
        if len(raw) <= state.prompt_workers.small_body_bytes:
            return parse_request(raw, model_cls)
        return await state.prompt_workers.run(len(raw), _parse_off_loop, raw, model_cls)

    async def tokenize(fn, *args):
        """``fn(*args, tok=...)`` on a prompt worker (the lane follows the body's size)."""
        return await state.prompt_workers.run(BODY_BYTES.get(), fn, *args)

    def submit(ereq: EngineRequest):
        try:
            engine.submit(ereq)
        except OverflowError as e:
            raise APIError(503, str(e), code="server_overloaded",
                           type="service_unavailable_error")
        except EngineUnavailable as e:
            raise APIError(503, str(e), code=e.code, type="service_unavailable_error")

    async def run_request(request: Request, ereq_kwargs: dict, prompt: List[int],
                          boundaries: List[int], logprobs: Optional[int], fmt, stream: bool,
                          include_usage: bool):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def on_event(ev):
            loop.call_soon_threadsafe(queue.put_nowait, ev)

        ereq = EngineRequest(prompt=prompt, on_event=on_event, logprobs=logprobs,
                             boundaries=boundaries, **ereq_kwargs)
        submit(ereq)

        def failed(ev: Failed) -> APIError:
            return APIError(ev.status, ev.message, code=ev.code)

        if not stream:
            deltas: List[Delta] = []
            # The client going away is noticed at once, not between token events:
            # a task waits for the disconnect and wakes the loop below.
            watcher = asyncio.ensure_future(_disconnected(request, queue))
            try:
                while True:
                    ev = await queue.get()
                    if ev is DISCONNECTED:
                        engine.cancel(ereq)
                        return Response(status_code=499)
                    if isinstance(ev, Delta):
                        deltas.append(ev)
                    elif isinstance(ev, Done):
                        return fmt.response(deltas, ev)
                    elif isinstance(ev, Failed):
                        raise failed(ev)
            finally:
                watcher.cancel()
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

        # Formatters of other APIs (Anthropic, Responses) name their events and
        # frame errors their own way; OpenAI chat streams end with [DONE].
        encode = getattr(fmt, "encode_event", sse)
        trailer = getattr(fmt, "stream_trailer", "data: [DONE]\n\n")
        error_events = getattr(fmt, "error_events", lambda err: [err.body()])

        async def events():
            finished = False
            try:
                for c in fmt.start():
                    yield encode(c)
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
                            yield encode(c)
                    elif isinstance(ev, Done):
                        finished = True
                        for c in fmt.on_done(ev, include_usage):
                            yield encode(c)
                        if trailer:
                            yield trailer
                        return
                    elif isinstance(ev, Failed):
                        finished = True
                        for c in error_events(failed(ev)):
                            yield encode(c)
                        return
            finally:
                if not finished:
                    engine.cancel(ereq)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})

    async def run_choices(request: Request, kw: dict, n: int, make_fmt, prompt: List[int],
                          boundaries: List[int], logprobs: Optional[int], stream: bool,
                          include_usage: bool):
        """``n`` choices as ``n`` rows of the running batch (``choices``)."""
        if n == 1:
            return await run_request(request, kw, prompt, boundaries, logprobs, make_fmt(),
                                     stream, include_usage)
        if stream:
            events = await stream_choices(submit, engine.cancel, kw,
                                          [make_fmt() for _ in range(n)], prompt, boundaries,
                                          logprobs, include_usage, FIRST_EVENT_WAIT)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
        tasks = [asyncio.ensure_future(run_request(request, choice_kwargs(kw, i), prompt,
                                                   boundaries, logprobs, make_fmt(), False,
                                                   False)) for i in range(n)]
        try:
            results = await asyncio.gather(*tasks)
        finally:
            for t in tasks:  # one failed or the client left: free the other rows
                t.cancel()
        gone = next((r for r in results if isinstance(r, Response)), None)
        return gone if gone is not None else merge_choices(results)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request):
        check_auth(request)
        req = await parse_body(request, ChatCompletionRequest)
        check_model(state, req)
        prepared = await tokenize(prepare_chat, state, req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        kw = resolve_common(state, req, len(prepared.ids), max_tokens)
        kw["grammar"] = await tokenize(compile_constraint, state,
                                       (req.model_extra or {}).get("response_format"),
                                       prepared, forced_tool(req))
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

        def make_fmt():
            fmt = ChatFormatter(state, req.model or state.model_name, prepared, logprobs,
                                parse_tools)
            if prepared.forced_prefix:  # a forced tool call: the parser reads its opening
                fmt.parser.feed(prepared.forced_prefix)
            return fmt

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await run_choices(request, kw, req.n or 1, make_fmt, prepared.ids,
                                 prepared.boundaries, logprobs, bool(req.stream), include_usage)

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: Request):
        check_auth(request)
        req = await parse_body(request, CompletionRequest)
        check_model(state, req)
        if req.echo:
            raise bad_request("echo is not supported.", param="echo")
        if req.suffix:
            raise bad_request("suffix is not supported.", param="suffix")
        if req.best_of is not None and req.best_of != 1:
            raise bad_request("Only best_of=1 is supported.", param="best_of")
        ids = await tokenize(prepare_completion, state, req)
        kw = resolve_common(state, req, len(ids), req.max_tokens, prompt_param="prompt")
        kw["grammar"] = await tokenize(compile_constraint, state,
                                       (req.model_extra or {}).get("response_format"))
        logprobs = req.logprobs
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}.",
                              param="logprobs")
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await run_choices(
            request, kw, req.n or 1,
            lambda: CompletionFormatter(state, req.model or state.model_name, logprobs),
            ids, [len(ids) - 1] if len(ids) > 1 else [], logprobs, bool(req.stream),
            include_usage)

    from . import anthropic, openai_responses

    for api in (anthropic, openai_responses):
        api.add_routes(app, state, check_auth=check_auth, parse_body=parse_body,
                       tokenize=tokenize, run_request=run_request, resolve_common=resolve_common,
                       compile_constraint=compile_constraint)
    from .dashboard import register_dashboard

    register_dashboard(app, state, check_auth)  # the live page at / and its event stream
    return app
