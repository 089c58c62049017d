"""The live page at ``/`` with its static files, and its data feed (``server/dashboard.py``
says what each route serves)."""

from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..dashboard import PAGE_HEADERS, SNAPSHOT_INTERVAL, DashboardFeed, static_files
from ..pipeline import Pipeline
from ..protocol import APIError


def router(pipe: Pipeline) -> APIRouter:
    r = APIRouter()
    files = static_files()
    feed = DashboardFeed(pipe.state)
    engine = pipe.engine

    def static(name: str) -> Response:
        if name not in files:
            raise APIError(404, f"Not found: /static/{name}", code=None,
                           type="invalid_request_error")
        body, media_type = files[name]
        return Response(body, media_type=media_type, headers=PAGE_HEADERS)

    @r.get("/", include_in_schema=False)
    async def page():
        return static("index.html")

    @r.get("/static/{name}", include_in_schema=False)
    async def static_file(name: str):
        return static(name)

    @r.get("/v1/dashboard")
    async def dashboard_snapshot(request: Request):
        pipe.check_auth(request)
        return JSONResponse(feed.snapshot())

    @r.get("/v1/dashboard/events")
    async def dashboard_events(request: Request):
        pipe.check_auth(request)

        async def events():
            # Ends with the engine (shutdown must not wait for viewers); Starlette
            # cancels it when the client goes away.
            while engine.alive:
                yield f"data: {json.dumps(feed.snapshot())}\n\n"
                await asyncio.sleep(SNAPSHOT_INTERVAL)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})

    return r
