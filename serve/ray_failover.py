"""Replica failover in Ray Serve's HTTP proxy (a pure ASGI middleware, no Ray import).

When a replica dies mid-request, Ray Serve's proxy ends the HTTP exchange without a response
(or, for a stream, stops mid-body): its router drops the dead replica, but it does not resend
the request. Wrapped around the proxy's app, this middleware
- resends a generation request that got no response at all (its replica died before
  answering, queued requests included) to the deployment, so it lands on a live replica;
  the body is replayed from what the first attempt read. Generations have no side effects,
  so resending is safe; a client that went away is never resent.
- ends a stream whose replica died after its headers the way `specdeploy serve` ends a failed
  stream: an OpenAI-style error event, then `data: [DONE]`, then a clean end of the body.
- reads a generation request's body before handing it to the proxy and sends it inside the
  request's ASGI scope (PROXY_BODY_KEY; `Server.body` reads it there first). A replica otherwise
  pulls the body from the proxy's per-request queue, which gives each message once: when a replica
  died after pulling it, Ray's router can still retry the same request on another replica (a
  dying replica whose acceptance never arrived), and that replica waited for a body that never
  came (408 after the body timeout; seen once in CI).

Install it in every proxy with the supported hook, set where the Ray nodes start:
`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=specdeploy.serve.ray_failover:proxy_middlewares`
(`specdeploy serve --ray` does this for the cluster it starts).
"""

from __future__ import annotations

import asyncio
import logging

from .errors import error_body
from .openai_format import DONE, sse
from .security import GENERATION_PATHS, send_error

log = logging.getLogger("specdeploy.serve")

# The scope key of a generation request's whole body, read by the proxy (app.Server.body reads it first).
PROXY_BODY_KEY = "specdeploy.body"
# Pre-read at most this much for this long; a larger or slower body goes the usual way (the replica reads
# it under its own --max-body-bytes and body timeout), without that protection.
PREREAD_BYTES = 1 << 20  # ServeLimits' default max_body_bytes
PREREAD_TIMEOUT_S = 5.0
ATTEMPTS = 3  # the first try and two resends: two replicas dying under one request is already rare
RETRY_DELAY_S = 0.25  # doubled per resend: gives the router time to learn about the dead replica


def proxy_middlewares() -> list:
    """What RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH points at: the proxy's extra middlewares."""
    from starlette.middleware import Middleware

    return [Middleware(ReplicaFailover)]


def _is_generation(scope) -> bool:
    path = scope.get("path", "")
    return (scope["type"] == "http" and scope.get("method") == "POST"
            and any(path == p or path.endswith(p) for p in GENERATION_PATHS))


class ReplicaFailover:
    def __init__(self, app, attempts: int = ATTEMPTS, retry_delay_s: float = RETRY_DELAY_S,
                 preread_bytes: int = PREREAD_BYTES, preread_timeout_s: float = PREREAD_TIMEOUT_S):
        self.app, self.attempts, self.retry_delay_s = app, attempts, retry_delay_s
        self.preread_bytes, self.preread_timeout_s = preread_bytes, preread_timeout_s

    async def __call__(self, scope, receive, send):
        if not _is_generation(scope):
            return await self.app(scope, receive, send)
        replay = _Replay(receive)
        body = await replay.preread(self.preread_bytes, self.preread_timeout_s)
        if replay.disconnected:
            return
        if body is not None:
            scope = {**scope, PROXY_BODY_KEY: body}
        for attempt in range(self.attempts):
            out = _Watch(send)
            await self.app(scope, replay.receiver(), out)
            if out.finished or replay.disconnected:
                return
            if out.started:  # headers and part of a body went out: end it cleanly, never resend
                await out.end_broken()
                return
            log.warning("%s %s got no response (replica gone?); resending (%d/%d)", scope.get("method"),
                        scope.get("path"), attempt + 1, self.attempts - 1)
            if attempt + 1 < self.attempts:
                await asyncio.sleep(self.retry_delay_s * 2 ** attempt)
        await send_error(send, 503, "no replica could serve the request; retry later", "replica_unavailable",
                         {"Retry-After": "1"})


class _Replay:
    """The client's request messages, recorded so that a resend sees the same body."""

    def __init__(self, receive):
        self.receive, self.seen, self.disconnected = receive, [], False

    def receiver(self):
        position = 0

        async def receive():
            nonlocal position
            if position < len(self.seen):
                position += 1
                return self.seen[position - 1]
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.disconnected = True  # never recorded: a resend must not see it
            else:
                self.seen.append(message)
                position += 1
            return message

        return receive

    async def preread(self, limit: int, timeout_s: float) -> bytes | None:
        """The whole body, if it comes within `limit` bytes and `timeout_s`; else None. What was read stays
        recorded, so every attempt is still sent the same messages."""
        receive = self.receiver()

        async def read() -> bytes | None:
            size = 0
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return None
                size += len(message.get("body", b""))
                if size > limit:
                    return None
                if not message.get("more_body", False):
                    return b"".join(m.get("body", b"") for m in self.seen)

        try:
            return await asyncio.wait_for(read(), timeout_s)
        except asyncio.TimeoutError:
            return None


class _Watch:
    """Forwards the response and remembers how far it got."""

    def __init__(self, send):
        self.send, self.started, self.finished, self.event_stream = send, False, False, False

    async def __call__(self, message):
        if message["type"] == "http.response.start":
            self.started = True
            self.event_stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                    for k, v in message.get("headers", ()))
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.finished = True
        await self.send(message)

    async def end_broken(self) -> None:
        tail = b""
        if self.event_stream:  # what a failed stream of `specdeploy serve` ends with
            body = error_body(502, "the replica serving this stream failed; retry the request", None,
                              "replica_failed")
            tail = (sse(body) + DONE).encode()
        try:
            await self.send({"type": "http.response.body", "body": tail, "more_body": False})
        except Exception:  # the client is gone as well
            pass
