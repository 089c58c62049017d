"""What may reach the routes: an ASGI guard in front of the app, and a uvicorn
protocol that drops connections whose request headers never finish.

* Size: a ``Content-Length`` above the cap is answered 413 before anything is
  read; a body that streams past the cap (chunked) is cut off with a 413.
* Time: headers must arrive within ``read_timeout`` seconds of the connection
  (or of the first byte of the next request on a kept-alive connection), the
  body within ``read_timeout`` of the headers (else 408).
* Browsers: without an API key, a web page the user visits must not drive the
  local server (cross-site requests, DNS rebinding). A request whose ``Origin``
  is another site (not in ``--allowed-origins``, not this server) is refused,
  and on a loopback bind a ``Host`` that is not a local name is refused (403).
* POST bodies must be JSON: ``application/json`` (or ``*+json``), no type, or
  ``application/x-www-form-urlencoded`` (curl's ``-d`` default); ``text/plain``
  and form uploads, which a page can send cross-site without a preflight, get 415.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
from dataclasses import dataclass, field
from typing import Optional, Set

from .protocol import APIError

# Size of the current request's body (Content-Length, or what was read): picks the
# prompt worker lane (state.PromptWorkers) without passing it through every route.
BODY_BYTES: contextvars.ContextVar[int] = contextvars.ContextVar("body_bytes", default=0)
LOCAL_HOST_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
JSON_TYPES = ("application/json", "application/x-www-form-urlencoded")


def is_loopback(host: str) -> bool:
    h = host.strip("[]").lower()
    return h in LOCAL_HOST_NAMES or h.startswith("127.")


def host_name(value: str) -> str:
    """A Host header without its port: 'Example.com:8080' -> 'example.com', '[::1]:80' -> '::1'."""
    v = value.strip().lower()
    if v.startswith("["):
        return v[1:v.find("]")] if "]" in v else v
    return v.rsplit(":", 1)[0] if v.count(":") == 1 else v


def split_list(values) -> list:
    """``--allowed-origins a,b c`` -> ['a', 'b', 'c'] (comma-separated as mlx_lm.server's)."""
    out = []
    for v in values or []:
        out += [x.strip() for x in str(v).split(",") if x.strip()]
    return out


@dataclass
class GuardConfig:
    max_body_bytes: int = 16 << 20
    read_timeout: float = 30.0
    # Host names accepted (without port); None accepts any Host.
    allowed_hosts: Optional[Set[str]] = None
    allowed_origins: Set[str] = field(default_factory=set)  # "*": any origin
    check_origin: bool = True  # off when an API key protects the server

    def origin_allowed(self, origin: str, host: Optional[str]) -> bool:
        if "*" in self.allowed_origins or origin in self.allowed_origins:
            return True
        # Same origin: a page served from this very address.
        return host is not None and origin.lower().split("://", 1)[-1] == host.lower()

    def host_allowed(self, host: str) -> bool:
        if self.allowed_hosts is None or "*" in self.allowed_hosts:
            return True
        name = host_name(host)
        return name in self.allowed_hosts or name.endswith(".localhost")


async def send_error(send, e: APIError):
    body = json.dumps(e.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in e.headers.items()]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def add_cors(app, origins):
    """CORS headers on every answer (the outermost middleware); a preflight from an origin
    not allowed is answered as that origin's request would be: 403 with an error body."""
    from fastapi.middleware.cors import CORSMiddleware
    from fastapi.responses import JSONResponse

    class Cors(CORSMiddleware):
        def preflight_response(self, request_headers):
            origin = request_headers["origin"]
            if not self.is_allowed_origin(origin=origin):
                e = _origin_refused(origin)
                return JSONResponse(e.body(), status_code=e.status)
            return super().preflight_response(request_headers)

    app.add_middleware(Cors, allow_origins=list(origins), allow_methods=["*"],
                       allow_headers=["*"])


def _origin_refused(origin: Optional[str]) -> APIError:
    return APIError(403, f"Cross-origin requests from {origin or 'another site'} are not "
                    "allowed (start the server with --allowed-origins, or with --api-key).",
                    code="origin_not_allowed")


class RequestGuard:
    def __init__(self, app, config: GuardConfig):
        self.app = app
        self.config = config

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            self._check_headers(scope)
        except APIError as e:
            return await send_error(send, e)
        await self.app(scope, self._limited(receive), send)

    def _check_headers(self, scope):
        cfg = self.config
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host")
        if host is not None and not cfg.host_allowed(host):
            raise APIError(403, f"Host {host!r} is not allowed: this server listens on a "
                           "loopback address (start it with --allowed-hosts to accept other "
                           "names).", code="host_not_allowed")
        if cfg.check_origin:
            origin = headers.get("origin")
            cross = (not cfg.origin_allowed(origin, host) if origin is not None
                     else headers.get("sec-fetch-site") == "cross-site")
            if cross:
                raise _origin_refused(origin)
        if scope["method"] == "POST":
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype and not (ctype in JSON_TYPES or ctype.endswith("+json")):
                raise APIError(415, f"Request bodies must be JSON (Content-Type: "
                               f"application/json), not {ctype}.", param="Content-Type",
                               code="unsupported_media_type")
        length = headers.get("content-length", "").strip()
        if length.isdigit():
            BODY_BYTES.set(int(length))
            if int(length) > cfg.max_body_bytes:
                raise self._too_large()

    def _too_large(self) -> APIError:
        return APIError(413, f"The request body is larger than {self.config.max_body_bytes} "
                        "bytes (the server's --max-request-bytes).",
                        code="request_too_large", headers={"Connection": "close"})

    def _limited(self, receive):
        """``receive`` that enforces the size cap and the body deadline."""
        cap, timeout = self.config.max_body_bytes, self.config.read_timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        received = 0
        done = False

        async def limited():
            nonlocal received, done
            if done:
                return await receive()
            try:
                msg = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.001))
            except asyncio.TimeoutError:
                raise APIError(408, f"The request body did not arrive within {timeout:g} s.",
                               code="request_timeout", headers={"Connection": "close"})
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > cap:
                    raise self._too_large()
                done = not msg.get("more_body", False)
                BODY_BYTES.set(max(BODY_BYTES.get(), received))
            else:
                done = True
            return msg

        return limited


def timed_http_protocol(read_timeout: float):
    """uvicorn's HTTP protocol class, closing connections whose request headers take longer
    than ``read_timeout`` seconds (uvicorn itself only times out idle kept-alive ones)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class TimedHTTPProtocol(AutoHTTPProtocol):
        _header_timer = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def data_received(self, data):
            between_requests = self.cycle is None or self.cycle.response_complete
            if between_requests and self._header_timer is None:
                self._arm()
            before = self.cycle
            super().data_received(data)
            if self.cycle is not before:  # the headers are complete: a new request began
                self._disarm()

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def _arm(self):
            self._header_timer = self.loop.call_later(read_timeout, self._headers_too_slow)

        def _disarm(self):
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self):
            self._header_timer = None
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and not self.transport.is_closing():
                self.transport.close()

    return TimedHTTPProtocol
