"""The OpenAI routes: chat and text completions (streaming or not; also without the ``/v1``
prefix) and the model list with its MTP capability."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..images import engine_kwargs
from ..params import MAX_TOP_LOGPROBS, check_model, resolve_common
from ..pipeline import Pipeline
from ..prompts import forced_tool, prepare_chat, prepare_completion
from ..protocol import APIError, ChatCompletionRequest, CompletionRequest, bad_request
from ..responses import ChatFormatter, CompletionFormatter
from ..structured import compile_constraint


def model_card(state) -> dict:
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
            "prefix_cache": state.engine.prefix_cache.enabled,
            "images": state.images is not None,
        },
    }


def _chat_logprobs(req):
    """``logprobs``/``top_logprobs`` -> how many alternatives to return (None: none)."""
    if req.logprobs:
        top = req.top_logprobs or 0
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}.",
                              param="top_logprobs")
        return top
    if req.top_logprobs:
        raise bad_request("top_logprobs requires logprobs=true.", param="top_logprobs")
    return None


def _check_completion(req):
    if req.echo:
        raise bad_request("echo is not supported.", param="echo")
    if req.suffix:
        raise bad_request("suffix is not supported.", param="suffix")
    if req.best_of is not None and req.best_of != 1:
        raise bad_request("Only best_of=1 is supported.", param="best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}.",
                          param="logprobs")


def router(pipe: Pipeline) -> APIRouter:
    r = APIRouter()
    state = pipe.state

    @r.get("/v1/models")
    async def list_models(request: Request):
        pipe.check_auth(request)
        return {"object": "list", "data": [model_card(state)]}

    @r.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request):
        pipe.check_auth(request)
        if model_id not in state.aliases:
            raise APIError(404, f"The model `{model_id}` does not exist.", param="model",
                           code="model_not_found")
        return model_card(state)

    @r.post("/v1/chat/completions")
    @r.post("/chat/completions")
    async def chat_completions(request: Request):
        pipe.check_auth(request)
        req = await pipe.parse_body(request, ChatCompletionRequest)
        check_model(state, req)
        prepared = await pipe.tokenize(prepare_chat, state, req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        kw = resolve_common(state, req, len(prepared.ids), max_tokens)
        kw.update(engine_kwargs(state, prepared))
        kw["grammar"] = await pipe.tokenize(compile_constraint, state,
                                            (req.model_extra or {}).get("response_format"),
                                            prepared, forced_tool(req))
        logprobs = _chat_logprobs(req)

        def make_fmt():
            return ChatFormatter(state, req.model or state.model_name, prepared, logprobs)

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await pipe.run_choices(request, kw, req.n or 1, make_fmt, prepared.ids,
                                      prepared.boundaries, logprobs, bool(req.stream),
                                      include_usage)

    @r.post("/v1/completions")
    @r.post("/completions")
    async def completions(request: Request):
        pipe.check_auth(request)
        req = await pipe.parse_body(request, CompletionRequest)
        check_model(state, req)
        _check_completion(req)
        ids = await pipe.tokenize(prepare_completion, state, req)
        kw = resolve_common(state, req, len(ids), req.max_tokens, prompt_param="prompt")
        kw["grammar"] = await pipe.tokenize(compile_constraint, state,
                                            (req.model_extra or {}).get("response_format"))
        logprobs = req.logprobs
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await pipe.run_choices(
            request, kw, req.n or 1,
            lambda: CompletionFormatter(state, req.model or state.model_name, logprobs),
            ids, [len(ids) - 1] if len(ids) > 1 else [], logprobs, bool(req.stream),
            include_usage)

    return r
