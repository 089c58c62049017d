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

This module assembles the app: the guard middleware, the error envelopes (Anthropic's on
its paths), and one router per API (``routers``: status, openai, anthropic, responses,
dashboard), each built by ``router(pipe)`` over the shared request path (``pipeline``).
Request fields are validated in ``params``; prompts are prepared in ``prompts``, bodies and
stream chunks rendered in ``responses``.
"""

from __future__ import annotations

import logging
from typing import Optional

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..decode.grammar import first_line
from .anthropic import AnthropicErrors
from .http_guard import GuardConfig, RequestGuard
from .pipeline import Pipeline
from .protocol import APIError
from .routers import APIS
from .state import ServerState

log = logging.getLogger("mlx_mtp.server")


def _error_response(e: APIError):
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers or None)


def _add_error_handlers(app):
    """Every error in the OpenAI envelope; an unhandled one says only its first line."""

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        msg = {404: f"Not found: {request.url.path}",
               405: f"Method {request.method} not allowed on {request.url.path}"}.get(
                   e.status_code, str(e.detail))
        return _error_response(APIError(e.status_code, msg, code=None,
                                        type="invalid_request_error"))

    @app.exception_handler(Exception)
    async def _unhandled(request, e: Exception):
        log.exception("Unhandled error on %s", request.url.path)
        return _error_response(APIError(500, f"Internal server error: {type(e).__name__}: "
                                        f"{first_line(e)}", code="internal_error"))


def create_app(state: ServerState, guard: Optional[GuardConfig] = None):
    """The FastAPI app; ``guard``: size, time and browser limits (defaults if None)."""
    app = FastAPI(title="mlx-mtp", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.add_middleware(RequestGuard, config=guard or GuardConfig(
        check_origin=state.api_key is None))
    app.add_middleware(AnthropicErrors)  # outside the guard: its errors are reshaped too
    _add_error_handlers(app)
    pipe = Pipeline(state)
    for api in APIS:
        app.include_router(api.router(pipe))
    return app
