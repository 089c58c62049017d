"""``n`` > 1: independent choices of one request, each a row of the running batch.

Choice ``i`` samples with a seed derived from the request's (``choice_kwargs``). Whole
responses are merged into one with ``n`` choices (``merge_choices``); a stream
interleaves the choices' chunks as they come, each chunk naming its choice by ``index``,
as OpenAI streams ``n`` > 1 (``stream_choices``): every choice opens with its own role
chunk and ends with its own ``finish_reason`` chunk (which carries that choice's
``timings`` and ``mtp``), and ``stream_options.include_usage`` adds one last chunk with
no choices and the usage of all of them.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Callable, List, Optional, Sequence

from .events import Admitted, Delta, Done, EngineRequest, Failed
from .protocol import APIError

# A stream sends a keep-alive comment after this long without a chunk (long prefill).
KEEPALIVE_SECONDS = 10.0


def choice_kwargs(kw: dict, i: int) -> dict:
    """Engine arguments of choice ``i``: a seed derived per choice (choice 0 keeps the
    request's seed, so n=1 and the first of n agree); unseeded choices draw their own."""
    sampling = kw["sampling"]
    if i == 0 or sampling.seed is None:
        return kw
    seed = (sampling.seed + i * 0x9E3779B97F4A7C15) % (1 << 64)
    return dict(kw, sampling=replace(sampling, seed=seed))


def merged_usage(usages: Sequence[dict]) -> dict:
    """The usage of n completions of one prompt: the prompt counts once (OpenAI's way)."""
    completion = sum(u["completion_tokens"] for u in usages)
    return dict(usages[0], completion_tokens=completion,
                total_tokens=usages[0]["prompt_tokens"] + completion)


def merge_choices(results: List[dict]) -> dict:
    """n whole responses of one prompt -> one response with n choices; usage sums the
    completions (the prompt counts once), as OpenAI's does."""
    out = dict(results[0])
    out["choices"] = [dict(r["choices"][0], index=i) for i, r in enumerate(results)]
    out["usage"] = merged_usage([r["usage"] for r in results])
    out["timings"] = dict(results[0]["timings"], **{
        k: sum(r["timings"][k] for r in results)
        for k in ("predicted_n", "draft_n", "draft_n_accepted")})
    out["mtp"] = dict(results[0]["mtp"], **{
        k: sum(r["mtp"][k] for r in results)
        for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")})
    return out


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def early_events(queue: asyncio.Queue, wait: float, event=lambda item: item) -> list:
    """What ``queue`` holds within ``wait`` seconds, up to the first event that is not
    ``Admitted``: a failure before the first token (e.g. out of memory in prefill) still
    gets a real HTTP status. ``event`` picks the event out of a queued item."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    items: list = []
    while not items or isinstance(event(items[-1]), Admitted):
        try:
            items.append(await asyncio.wait_for(queue.get(), max(0.0, deadline - loop.time())))
        except asyncio.TimeoutError:
            break
    return items


async def stream_choices(submit: Callable[[EngineRequest], None],
                         cancel: Callable[[EngineRequest], None], kw: dict, fmts: list,
                         prompt: List[int], boundaries: List[int], logprobs: Optional[int],
                         include_usage: bool, first_wait: float):
    """Run ``len(fmts)`` choices and stream them as one OpenAI SSE stream.

    ``fmts`` are OpenAI chat or completion formatters, one per choice; they get the
    choice's ``index`` and share the first one's id. Returns an async iterator of SSE
    strings, or raises APIError when a choice fails before anything was sent (within
    ``first_wait`` seconds), so that early failures get a real HTTP status.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    for i, fmt in enumerate(fmts):
        fmt.index, fmt.id, fmt.created = i, fmts[0].id, fmts[0].created

    def on_event(i):
        return lambda ev: loop.call_soon_threadsafe(queue.put_nowait, (i, ev))

    reqs = [EngineRequest(prompt=prompt, on_event=on_event(i), logprobs=logprobs,
                          boundaries=boundaries, **choice_kwargs(kw, i))
            for i in range(len(fmts))]
    try:
        for r in reqs:
            submit(r)
        early = await early_events(queue, first_wait, event=lambda item: item[1])
    except BaseException:
        for r in reqs:
            cancel(r)
        raise
    if early and isinstance(early[-1][1], Failed):
        for r in reqs:
            cancel(r)
        raise failed_error(early[-1][1])
    return _interleaved(queue, fmts, early, include_usage, reqs, cancel)


async def _interleaved(queue: asyncio.Queue, fmts: list, early: list, include_usage: bool,
                       reqs: List[EngineRequest], cancel: Callable[[EngineRequest], None]):
    """The choices' SSE chunks as their events come (``early``: those already taken)."""
    dones: List[Optional[Done]] = [None] * len(fmts)
    try:
        for fmt in fmts:
            for c in fmt.start():
                yield sse(c)
        pending = list(early)  # OpenAI chunks have no use for Admitted: passed over
        while any(d is None for d in dones):
            if pending:
                i, ev = pending.pop(0)
            else:
                try:
                    i, ev = await asyncio.wait_for(queue.get(), KEEPALIVE_SECONDS)
                except asyncio.TimeoutError:
                    yield ": keepalive\n\n"
                    continue
            if isinstance(ev, Delta):
                for c in fmts[i].on_delta(ev):
                    yield sse(c)
            elif isinstance(ev, Done):
                dones[i] = ev
                for c in fmts[i].on_done(ev, False):
                    yield sse(c)
            elif isinstance(ev, Failed):  # one choice failed: the stream ends with it
                yield sse(failed_error(ev).body())
                return
        if include_usage:
            f = fmts[0]
            yield sse({"id": f.id, "object": f.object_chunk, "created": f.created,
                       "model": f.model, "choices": [],
                       "usage": merged_usage([d.usage for d in dones])})
        yield "data: [DONE]\n\n"
    finally:
        for r in reqs:  # no-op for finished rows; frees the others (client gone, failure)
            cancel(r)


def failed_error(ev: Failed) -> APIError:
    headers = None if ev.retry_after is None else {"Retry-After": str(ev.retry_after)}
    return APIError(ev.status, ev.message, code=ev.code, headers=headers)
