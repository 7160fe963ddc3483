"""Who may call the server, and how many at once: API key, browser origins, request ids, a
connection limit (pure ASGI middlewares).

A browser page of any origin can POST to a server it can reach (loopback included, and via
DNS rebinding even "same-origin"), so: no CORS headers unless `--allowed-origins` names the
origins, and a request that carries an `Origin` header outside that list is refused (403).
Non-browser clients send no `Origin`. With an API key (`--api-key` or SPECDEPLOY_API_KEY)
every path but /health needs `Authorization: Bearer KEY`, compared in constant time.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import resource
import time
import uuid

from .errors import error_body

log = logging.getLogger("specdeploy.serve")

OPEN_PATHS = frozenset({"/health"})  # load balancers probe it without credentials
MONITOR_PATHS = frozenset({"/health", "/metrics"})
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


async def send_error(send, status: int, message: str, code: str, headers: dict | None = None) -> None:
    body = json.dumps(error_body(status, message, None, code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class RequestIdMiddleware:
    """Accepts a client's `X-Request-Id` (or makes one), returns it, logs one line per request with it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = _header(scope, b"x-request-id")
        request_id = given if given and _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        status, start = [None], time.perf_counter()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            final = state.get("outcome") or status[0]
            level = logging.INFO if scope.get("path") in GENERATION_PATHS else logging.DEBUG
            log.log(level, "request %s: %s %s -> %s in %.3f s", request_id, scope.get("method"),
                    scope.get("path"), final if final is not None else "no response", time.perf_counter() - start)


class AccessGuardMiddleware:
    def __init__(self, app, api_key: str | None, allowed_origins: list[str]):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.allowed_origins = frozenset(allowed_origins)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        origin = _header(scope, b"origin")
        if origin is not None and origin not in self.allowed_origins:
            return await send_error(send, 403, f"requests from the web origin '{origin[:100]}' are not allowed "
                                    "(the server's --allowed-origins)", "origin_not_allowed")
        if self.api_key is not None and scope.get("path") not in OPEN_PATHS and not self._authorized(scope):
            return await send_error(send, 401, "missing or incorrect API key: send 'Authorization: Bearer KEY'",
                                    "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        return await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        scheme, _, token = (_header(scope, b"authorization") or "").partition(" ")
        given = token.strip().encode("latin-1") if scheme.lower() == "bearer" else b""
        return hmac.compare_digest(given, self.api_key)


class ConnectionLimitMiddleware:
    """At most `limit` HTTP requests in progress at once; past it, an OpenAI-style JSON 503 at once.

    Counted here rather than left to uvicorn's `limit_concurrency`, which answers a plain-text
    503: uvicorn's limit is set a little higher (`uvicorn_limit`) as the hard backstop for what
    this cannot see (idle keep-alive connections, requests not yet parsed). /health and /metrics
    are neither counted nor refused, so a saturated server can still be watched.
    """

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit
        self.active = 0  # event loop only: no lock

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in MONITOR_PATHS:
            return await self.app(scope, receive, send)
        if self.active >= self.limit:
            return await send_error(send, 503, f"server at its connection limit ({self.limit} requests in "
                                    "progress, --max-connections); retry later", "too_many_connections",
                                    {"Retry-After": "1"})
        self.active += 1
        try:
            return await self.app(scope, receive, send)
        finally:
            self.active -= 1


IDLE_CONNECTIONS = 1024  # open connections uvicorn allows beyond the app's limit (uvicorn_limit)
FD_RESERVE = 128  # file descriptors kept for the process's own files and sessions


def uvicorn_limit(connection_limit: int) -> int:
    """uvicorn's own limit for a server that refuses past `connection_limit` itself: above it, so that
    uvicorn's plain-text 503 is only a backstop (it counts the connection being answered, hence + 1).
    uvicorn counts open connections, idle ones too, so it leaves room for IDLE_CONNECTIONS of them (each
    closed after --header-timeout: serve/header_limit.py): at + 18, 91 sockets that sent nothing shut
    every client out, /health included. Within the process's file limit, less FD_RESERVE for its own files."""
    limit = connection_limit + max(IDLE_CONNECTIONS, connection_limit // 4) + 1
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        limit = min(limit, max(connection_limit + 1, soft - FD_RESERVE))
    return limit
