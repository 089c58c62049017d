"""What every API's routes share: the API key, body parsing and tokenization on the prompt
workers, submission to the engine, and turning engine events into a response (a body, or
an SSE stream in the formatter's framing). The routes of each API (``routers/``) only
translate requests and pick a formatter."""

from __future__ import annotations

import asyncio
import hmac
from typing import List, Optional

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from .choices import (KEEPALIVE_SECONDS, choice_kwargs, early_events, failed_error,
                      merge_choices, sse, stream_choices)
from .events import Admitted, Delta, Done, EngineRequest, EngineUnavailable, Failed
from .http_guard import BODY_BYTES
from .memory_budget import OverBudget
from .protocol import APIError, parse_request
from .state import ServerState

FIRST_EVENT_WAIT = 2.0  # wait this long for the first event so early failures get a status
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

DISCONNECTED = object()  # queued by _disconnected when the client goes away


def _parse_off_loop(raw: bytes, model_cls, tok=None):
    return parse_request(raw, model_cls)


async def _disconnected(request: Request, queue: asyncio.Queue):
    """Wait until the client disconnects (the body has been read), then tell ``queue``."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    queue.put_nowait(DISCONNECTED)


class Pipeline:
    """The request path of one server (its state and engine)."""

    def __init__(self, state: ServerState):
        self.state, self.engine = state, state.engine
        self._key = state.api_key.encode() if state.api_key is not None else None

    # -- admission -------------------------------------------------------------------
    def _key_matches(self, sent: Optional[str]) -> bool:
        # Constant time: the comparison must not reveal how much of a guess was right.
        return sent is not None and hmac.compare_digest(sent.strip().encode(), self._key)

    def check_auth(self, request: Request):
        if self._key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if not ((scheme.lower() == "bearer" and self._key_matches(token))
                or self._key_matches(request.headers.get("x-api-key"))):
            raise APIError(401, "Invalid or missing API key (send 'Authorization: Bearer KEY').",
                           code="invalid_api_key",
                           headers={"WWW-Authenticate": 'Bearer realm="mlx-mtp"'})

    async def parse_body(self, request: Request, model_cls):
        raw = await request.body()
        workers = self.state.prompt_workers
        if len(raw) <= workers.small_body_bytes:
            return parse_request(raw, model_cls)
        return await workers.run(len(raw), _parse_off_loop, raw, model_cls)

    async def tokenize(self, fn, *args):
        """``fn(*args, tok=...)`` on a prompt worker (the lane follows the body's size)."""
        return await self.state.prompt_workers.run(BODY_BYTES.get(), fn, *args)

    def submit(self, ereq: EngineRequest):
        try:
            self.engine.submit(ereq)
        except OverBudget as e:
            raise APIError(429, str(e), code=e.code,
                           headers={"Retry-After": str(e.retry_after)})
        except OverflowError as e:
            raise APIError(503, str(e), code="server_overloaded",
                           type="service_unavailable_error")
        except EngineUnavailable as e:
            raise APIError(503, str(e), code=e.code, type="service_unavailable_error")

    # -- one request -----------------------------------------------------------------
    async def run_request(self, request: Request, ereq_kwargs: dict, prompt: List[int],
                          boundaries: List[int], logprobs: Optional[int], fmt, stream: bool,
                          include_usage: bool):
        """Submit one row and answer with ``fmt``: a whole body, or an SSE stream."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def on_event(ev):
            loop.call_soon_threadsafe(queue.put_nowait, ev)

        ereq = EngineRequest(prompt=prompt, on_event=on_event, logprobs=logprobs,
                             boundaries=boundaries, **ereq_kwargs)
        self.submit(ereq)
        if not stream:
            return await self._collect(request, queue, ereq, fmt)
        try:
            early = await early_events(queue, FIRST_EVENT_WAIT)
        except BaseException:
            self.engine.cancel(ereq)
            raise
        if early and isinstance(early[-1], Failed):
            raise failed_error(early[-1])
        return StreamingResponse(self._events(queue, ereq, fmt, early, include_usage),
                                 media_type="text/event-stream", headers=SSE_HEADERS)

    async def _collect(self, request: Request, queue: asyncio.Queue, ereq, fmt):
        deltas: List[Delta] = []
        # The client going away is noticed at once, not between token events:
        # a task waits for the disconnect and wakes the loop below.
        watcher = asyncio.ensure_future(_disconnected(request, queue))
        try:
            while True:
                ev = await queue.get()
                if ev is DISCONNECTED:
                    self.engine.cancel(ereq)
                    return Response(status_code=499)
                if isinstance(ev, Delta):
                    deltas.append(ev)
                elif isinstance(ev, Done):
                    return fmt.response(deltas, ev)
                elif isinstance(ev, Failed):
                    raise failed_error(ev)
        finally:
            watcher.cancel()
            self.engine.cancel(ereq)  # no-op once finished; frees the slot if we were cancelled

    async def _events(self, queue: asyncio.Queue, ereq, fmt, early: list, include_usage: bool):
        # Formatters of other APIs (Anthropic, Responses) name their events and frame
        # errors their own way; OpenAI chat streams end with [DONE]. ``on_admitted``: what a
        # formatter sends once the prompt's prefix-cache hit is known (Anthropic's start).
        encode = getattr(fmt, "encode_event", sse)
        trailer = getattr(fmt, "stream_trailer", "data: [DONE]\n\n")
        error_events = getattr(fmt, "error_events", lambda err: [err.body()])
        on_admitted = getattr(fmt, "on_admitted", lambda ev: [])
        finished = False
        try:
            for c in fmt.start():
                yield encode(c)
            pending = list(early)
            while True:
                if pending:
                    ev = pending.pop(0)
                else:
                    try:
                        ev = await asyncio.wait_for(queue.get(), KEEPALIVE_SECONDS)
                    except asyncio.TimeoutError:
                        yield ": keepalive\n\n"
                        continue
                if isinstance(ev, Admitted):
                    for c in on_admitted(ev):
                        yield encode(c)
                elif isinstance(ev, Delta):
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
                    for c in error_events(failed_error(ev)):
                        yield encode(c)
                    return
        finally:
            if not finished:
                self.engine.cancel(ereq)

    async def run_choices(self, request: Request, kw: dict, n: int, make_fmt,
                          prompt: List[int], boundaries: List[int], logprobs: Optional[int],
                          stream: bool, include_usage: bool):
        """``n`` choices as ``n`` rows of the running batch (``choices``)."""
        if n == 1:
            return await self.run_request(request, kw, prompt, boundaries, logprobs,
                                          make_fmt(), stream, include_usage)
        if stream:
            events = await stream_choices(self.submit, self.engine.cancel, kw,
                                          [make_fmt() for _ in range(n)], prompt, boundaries,
                                          logprobs, include_usage, FIRST_EVENT_WAIT)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        tasks = [asyncio.ensure_future(self.run_request(request, choice_kwargs(kw, i), prompt,
                                                        boundaries, logprobs, make_fmt(),
                                                        False, False)) for i in range(n)]
        try:
            results = await asyncio.gather(*tasks)
        finally:
            for t in tasks:  # one failed or the client left: free the other rows
                t.cancel()
        gone = next((r for r in results if isinstance(r, Response)), None)
        return gone if gone is not None else merge_choices(results)
