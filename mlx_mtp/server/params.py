"""Generation fields every API shares, validated into the engine's keyword arguments
(sampling, stop strings, context length, draft settings)."""

from __future__ import annotations

from typing import List, Optional

from ..decode import check_num_draft_tokens
from ..drafters.registry import SOURCES
from .protocol import APIError, bad_request, check_draft_source
from .state import ServerState

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

    return dict(max_tokens=max_tokens, sampling=sampling, stop=check_stop(req.stop),
                cache_prompt=req.cache_prompt is not False, **drafting(state, req))


def drafting(state: ServerState, req) -> dict:
    """A request's ``num_draft_tokens`` (None: the server's K; 0: no drafts from any
    source) and ``draft_source`` (None: the server's), checked."""
    k = req.num_draft_tokens
    if k is not None:
        try:
            check_num_draft_tokens(k)
        except ValueError as e:
            raise bad_request(str(e), param="num_draft_tokens")
        if k > 0 and state.num_mtp_layers == 0 and not state.block_drafter:
            raise bad_request("This server runs without an MTP head (--no-mtp or "
                              "--num-draft-tokens 0); num_draft_tokens must be 0.",
                              param="num_draft_tokens")
    source = check_draft_source(req.draft_source)
    if source is not None and SOURCES[source].drafter is not None \
            and SOURCES[source].drafter.needs_taps and not state.block_drafter:
        raise bad_request(f"draft_source {source} needs a block drafter, which this server "
                          "was not started with (--draft-model)", param="draft_source")
    if k == 0 and source is not None and SOURCES[source].drafter is not None:
        raise bad_request(f"num_draft_tokens 0 turns drafting off, draft_source {source} asks "
                          "for context drafts: leave out one of the two.",
                          param="num_draft_tokens")
    return dict(num_draft_tokens=k, draft_source=source)
