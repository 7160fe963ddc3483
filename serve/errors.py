"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}, never a traceback.

4xx: the client's request is at fault; 5xx (type `internal_error`): ours. Messages never
carry the server's absolute paths (an export's location, a tokenizer file): those are cut
down to their last component before a message leaves the server.
"""

from __future__ import annotations

import logging
import os
import re

from fastapi.responses import JSONResponse

log = logging.getLogger("specdeploy.serve")

TYPES = {401: "invalid_request_error", 429: "rate_limit_error"}
# not after a URL's scheme ("http://host/...") or as a "//" authority, which echoed values carry
_ABSOLUTE_PATH = re.compile(r"(?<![\w/.~:-])/(?!/)[^\s'\"`,;:()\[\]{}<>]+")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_type(status: int) -> str:
    return "internal_error" if status >= 500 else TYPES.get(status, "invalid_request_error")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    message = text(strip_paths(message))
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def text(message: str) -> str:
    """`message` as it can be sent: a lone surrogate echoed from a request (JSON's "\\ud800") would make the
    UTF-8 response fail to render, so it is written as its escape."""
    return message.encode("utf-8", "backslashreplace").decode("utf-8")


def strip_paths(message: str) -> str:
    """Absolute paths that exist on this machine (or whose folder does) -> their last component."""
    def short(match: re.Match) -> str:
        path = match.group(0).rstrip(".")
        if path.count("/") < 2 or not (os.path.exists(path) or os.path.isdir(os.path.dirname(path))):
            return match.group(0)  # "/v1/completions", "/s": not a file of ours
        return os.path.basename(path) + match.group(0)[len(path):]

    return _ABSOLUTE_PATH.sub(short, message)


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body over {limit} bytes", None, "request_too_large")


def busy(message: str) -> ApiError:
    return ApiError(429, message, None, "server_busy", headers={"Retry-After": "1"})


def shutting_down() -> ApiError:
    """A generation request the server will not finish: it is shutting down (SIGINT, SIGTERM)."""
    return ApiError(503, "the server is shutting down; retry later", None, "server_shutting_down")


def internal(message: str = "internal server error", code: str = "internal_error") -> ApiError:
    return ApiError(500, message, None, code)


def start_tracker(send):
    """`send` wrapped to note whether the response has started: ([started], wrapped send)."""
    started = [False]

    async def send_tracked(message):
        started[0] = started[0] or message["type"] == "http.response.start"
        await send(message)

    return started, send_tracked


class InternalErrorMiddleware:
    """Our own faults (an exception no handler answered): one traceback in the log, with the request id,
    and a JSON 500. Innermost of our middlewares and not re-raised: re-raised, Starlette's outermost
    error middleware would answer outside them (no request id, logged as no response) and uvicorn
    would log the traceback a second time ("Exception in ASGI application")."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, send_tracked = start_tracker(send)
        try:
            await self.app(scope, receive, send_tracked)
        except Exception as exc:
            state = scope.setdefault("state", {})
            request_id = state.get("request_id")
            log.error("request %s: internal error on %s", request_id, scope.get("path"), exc_info=exc)
            if started[0]:  # the status is out: the client sees the response end early
                state["outcome"] = 500
                return
            message = f"internal server error (request id {request_id}; details in the server log)"
            await internal(message).response()(scope, receive, send)
