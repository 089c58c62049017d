"""The Anthropic Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``
(translation and formatting in ``server/anthropic.py``; its error shape comes from the
``AnthropicErrors`` middleware the app adds)."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request

from ...decode.grammar import first_line
from ..anthropic import CountTokensRequest, MessageFormatter, MessagesRequest, to_chat_request
from ..images import engine_kwargs
from ..params import resolve_common
from ..pipeline import Pipeline
from ..prompts import forced_tool, prepare_chat
from ..protocol import APIError
from ..structured import compile_constraint

log = logging.getLogger("mlx_mtp.server")


def router(pipe: Pipeline) -> APIRouter:
    r = APIRouter()
    state = pipe.state

    async def prepare(request: Request, model_cls):
        pipe.check_auth(request)
        req = await pipe.parse_body(request, model_cls)
        chat = to_chat_request(req)
        if chat.model is not None and chat.model not in state.aliases:
            raise APIError(404, f"The model `{chat.model}` does not exist. This server serves "
                           f"`{state.model_name}`.", param="model")
        return req, chat, await pipe.tokenize(prepare_chat, state, chat)

    @r.post("/v1/messages")
    async def messages(request: Request):
        try:
            req, chat, prepared = await prepare(request, MessagesRequest)
            kw = resolve_common(state, chat, len(prepared.ids), req.max_tokens)
            kw.update(engine_kwargs(state, prepared))
            kw["grammar"] = await pipe.tokenize(compile_constraint, state, None, prepared,
                                                forced_tool(chat))
            fmt = MessageFormatter(state, req.model or state.model_name, prepared, kw["stop"])
            return await pipe.run_request(request, kw, prepared.ids, prepared.boundaries, None,
                                          fmt, bool(req.stream), False)
        except APIError:
            raise
        except Exception as e:  # the app's own handler for these answers outside middleware
            log.exception("Unhandled error on /v1/messages")
            raise APIError(500, f"Internal server error: {type(e).__name__}: {first_line(e)}")

    @r.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        _, _, prepared = await prepare(request, CountTokensRequest)
        return {"input_tokens": len(prepared.ids)}

    return r
