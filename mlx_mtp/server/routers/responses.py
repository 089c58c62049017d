"""The OpenAI Responses API: ``POST /v1/responses`` (also without the ``/v1`` prefix;
translation and formatting in ``server/openai_responses.py``)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..openai_responses import ResponseFormatter, ResponsesRequest, to_chat_request
from ..images import engine_kwargs
from ..params import resolve_common
from ..pipeline import Pipeline
from ..prompts import forced_tool, prepare_chat
from ..structured import compile_constraint


def router(pipe: Pipeline) -> APIRouter:
    r = APIRouter()
    state = pipe.state

    @r.post("/v1/responses")
    @r.post("/responses")
    async def responses(request: Request):
        pipe.check_auth(request)
        req = await pipe.parse_body(request, ResponsesRequest)
        chat = to_chat_request(req)
        prepared = await pipe.tokenize(prepare_chat, state, chat)
        kw = resolve_common(state, chat, len(prepared.ids), req.max_output_tokens)
        kw.update(engine_kwargs(state, prepared))
        kw["grammar"] = await pipe.tokenize(compile_constraint, state,
                                            (chat.model_extra or {}).get("response_format"),
                                            prepared, forced_tool(chat))
        fmt = ResponseFormatter(state, req.model or state.model_name, prepared, req, req.tools)
        return await pipe.run_request(request, kw, prepared.ids, prepared.boundaries, None, fmt,
                                      bool(req.stream), False)

    return r
