"""Health (``GET /health``, ``/v1/health``) and Prometheus metrics (``GET /metrics``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from ..pipeline import Pipeline


def router(pipe: Pipeline) -> APIRouter:
    r = APIRouter()
    state, engine = pipe.state, pipe.engine

    @r.get("/health")
    @r.get("/v1/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @r.get("/metrics")
    async def metrics(request: Request):
        if state.protect_metrics:
            pipe.check_auth(request)
        return PlainTextResponse(engine.metrics.render(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return r
