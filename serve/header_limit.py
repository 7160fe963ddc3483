"""Request headers over --max-header-bytes: an OpenAI-style JSON 431, however they arrive.

uvicorn's h11 parser holds at most `h11_max_incomplete_event_size` bytes of an unfinished
request head, and past it answered a plain-text 400 and closed the socket at once: a client
still sending (a 200 KB cookie) then read a connection reset instead of any answer, because
closing a socket with unread input sends a TCP RST. And a head that arrives in one read is
parsed whole, whatever its size (100 KB went through). So:

- `HeaderLimitedH11Protocol` (uvicorn's `http=` protocol class): where h11 gives up, it
  answers 431 (head too large) or 400 (malformed) in JSON with `Connection: close`, then
  closes the lingering way (as Apache and nginx do): it shuts its sending side, reads and
  discards what the client still sends, and closes once the client has finished, has sent
  LINGER_BYTES more, or LINGER_S have passed.
- `HeaderLimitMiddleware`: a head h11 parsed whole but over the limit gets the same 431.

And a connection must bring a whole request head within `head_timeout_s` (--header-timeout) of
opening, or of the first byte of its next request when kept alive (uvicorn closes a kept-alive
connection that sends nothing, and timed nothing else): sockets that sent nothing or half a
request line stayed open for good, and past uvicorn's connection limit (`security.uvicorn_limit`)
every client, /health included, got a plain-text 503. One that sent part of a head gets a JSON
408 (as a slow body does); one that sent nothing is closed.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_body
from .security import send_error

LINGER_S = 5.0  # at most this long reading what a refused client still sends
LINGER_BYTES = 64 << 20  # ... and at most this much of it


def too_large_message(limit: int) -> str:
    return f"request headers over {limit} bytes (the server's --max-header-bytes)"


def head_bytes(scope) -> int:
    """A parsed request's head as its client sent it, near enough: request line and header lines."""
    path = scope.get("raw_path") or scope.get("path", "").encode()
    line = len(scope.get("method", "")) + len(path) + len(scope.get("query_string", b"")) + 12
    return line + sum(len(k) + len(v) + 4 for k, v in scope.get("headers", ()))


class HeaderLimitMiddleware:
    """431 for a request whose head is over `limit` bytes (one h11 parsed whole)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and head_bytes(scope) > self.limit:
            return await send_error(send, 431, too_large_message(self.limit), "headers_too_large",
                                    {"Connection": "close"})
        return await self.app(scope, receive, send)


class HeaderLimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, answering an unparseable request head in JSON and closing without a reset,
    and closing a connection that brings no whole request head in time (`with_head_timeout`)."""

    head_timeout_s: float | None = None
    _lingering = False
    _linger_timer = None
    _head_timer = None
    _drained = 0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def handle_events(self) -> None:
        super().handle_events()
        if self._in_request():  # a whole head arrived
            self._stop_head_timer()

    def _in_request(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _await_head(self) -> None:
        self._stop_head_timer()
        if self.head_timeout_s:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._lingering or self.transport.is_closing() or self._in_request():
            return
        buffered, _ = self.conn.trailing_data
        if buffered:  # part of a head: say why, as a slow body's 408 does
            self._refuse(408, b"Request Timeout", f"the request head did not arrive within {self.head_timeout_s:g} s",
                         "request_timeout")
            return
        try:  # nothing sent: closed, as uvicorn closes an idle kept-alive connection
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:
            pass
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._lingering:  # the answer is sent: what the client still sends is read and dropped
            self._drained += len(data)
            if self._drained > LINGER_BYTES:
                self.transport.close()
            return
        if self._head_timer is None and not self._in_request():  # a kept-alive connection's next head begins
            self._await_head()
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:  # uvicorn calls it when h11 refuses the request
        limit = self.config.h11_max_incomplete_event_size
        buffered, _ = self.conn.trailing_data  # h11 gives up waiting for a head's end past its limit
        if limit is not None and len(buffered) > limit:
            status, message, code = 431, too_large_message(limit), "headers_too_large"
        else:
            status, message, code = 400, "malformed HTTP request", "invalid_http_request"
        self._refuse(status, b"Request Header Fields Too Large" if status == 431 else b"Bad Request", message, code)

    def _refuse(self, status: int, phrase: bytes, message: str, code: str) -> None:
        """Answer `status` in JSON with Connection: close, then close the lingering way."""
        self._stop_head_timer()
        body = json.dumps(error_body(status, message, None, code)).encode()
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (status, phrase, len(body), body))
        self._linger()

    def _linger(self) -> None:
        self._lingering = True
        if self.transport.can_write_eof():  # not under TLS: the answer and a FIN go out, reading goes on
            self.transport.write_eof()
        self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)

    def eof_received(self) -> None:
        if self._lingering:
            self.transport.close()  # the client has sent everything: nothing is left unread

    def connection_lost(self, exc: Exception | None) -> None:
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        self._stop_head_timer()
        super().connection_lost(exc)


def with_head_timeout(seconds: float | None) -> type[HeaderLimitedH11Protocol]:
    """The protocol class (uvicorn's `http=`) for a server whose connections bring a request head within `seconds`."""
    return type("HeaderLimitedH11Protocol", (HeaderLimitedH11Protocol,), {"head_timeout_s": seconds})
