"""The FastAPI app: OpenAI-compatible endpoints over a runtime Service, plus /health and /metrics.

Each generation runs in its own worker thread (runtime/aio.py), so the event loop only
parses, validates and relays events. Admission is the Service's pool: a full queue, or a
wait past the queue timeout, answers 429 before any response byte is sent. A client that
goes away — while queued, while generating, or mid-stream — cancels its request, and its
worker returns to the pool within one decode step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..runtime.aio import AsyncRequest
from ..runtime.errors import SpecDeployError
from ..runtime.pool import BusyError
from .chat import ChatTemplate, message_dicts
from .errors import ApiError, bad_request, busy, error_body
from .metrics import Metrics, MetricsMiddleware
from .openai_format import DONE, Shape, public_stats, sse, usage
from .schemas import ChatRequest, CompletionRequest, parse_json, stop_strings, validate

log = logging.getLogger("specdeploy.serve")

MAX_BODY_BYTES = 1 << 20
THREAD_TOKENIZE_CHARS = 16384  # longer prompts are tokenized off the event loop
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left


class _ClientGone(Exception):
    pass


class Server:
    """What the endpoints share: the service, its name, chat template and metrics."""

    def __init__(self, service, model_name: str, chat_template: ChatTemplate | None, metrics: Metrics):
        self.service, self.model_name, self.chat_template, self.metrics = service, model_name, chat_template, metrics

    # -- request parsing ------------------------------------------------------------
    async def body(self, request: Request, schema):
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes", None, "request_too_large")
        raw, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes", None, "request_too_large")
            raw.append(chunk)
        body = validate(schema, parse_json(b"".join(raw)))
        if body.model != self.model_name:
            raise ApiError(404, f"the model '{body.model}' does not exist (this server serves '{self.model_name}')",
                           "model", "model_not_found")
        return body

    async def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        tok = self.service.tokenizer
        fn = tok.encode if special_tokens else (lambda t: tok.tok.encode(t, add_special_tokens=False).ids)
        return await run_in_threadpool(fn, text) if len(text) > THREAD_TOKENIZE_CHARS else fn(text)

    async def completion_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return await self.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.service.meta.manifest.models["target"].vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
            return list(prompt)
        if isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
            raise bad_request("batched prompts are not supported: send one prompt per request", "prompt",
                              "unsupported_parameter")
        raise bad_request("'prompt' must be a string or a list of token ids", "prompt", "invalid_type")

    async def chat_prompt(self, body: ChatRequest) -> list[int]:
        if self.chat_template is None:
            raise bad_request("this model's tokenizer has no chat template (tokenizer_config.json 'chat_template'); "
                              "use /v1/completions", "messages", "no_chat_template")
        text = self.chat_template.render(message_dicts(body.messages))
        return await self.encode(text, special_tokens=False)  # the template already holds BOS etc.

    def options(self, body, prompt_ids: list[int], max_tokens: int | None, default_max: int | None,
                prompt_param: str) -> dict:
        svc = self.service
        method = body.method if body.method is not None else svc.default_method
        if method not in svc.methods:
            raise bad_request(svc.method_message(method), "method", "unknown_method")
        if not prompt_ids:
            raise bad_request("the prompt is empty", prompt_param)
        ctx, n = svc.max_context, len(prompt_ids)
        if n >= ctx:
            raise bad_request(f"this model's maximum context length is {ctx} tokens; the prompt has {n} tokens "
                              "(it must leave room for at least one new token)", prompt_param, "context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(default_max or ctx, ctx - n)
        elif n + max_tokens > ctx:
            raise bad_request(f"this model's maximum context length is {ctx} tokens; you requested {n + max_tokens} "
                              f"({n} in the prompt, {max_tokens} for the completion)", "max_tokens",
                              "context_length_exceeded")
        return dict(prompt_ids=prompt_ids, method=method, max_new_tokens=max_tokens,
                    temperature=1.0 if body.temperature is None else body.temperature,
                    top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0, seed=body.seed,
                    stop=stop_strings(body.stop), ignore_eos=bool(body.ignore_eos))

    # -- running --------------------------------------------------------------------
    async def generate(self, request: Request, body, options: dict, chat: bool):
        arrived = time.perf_counter()
        try:
            req = self.service.request(**options)
        except SpecDeployError as exc:
            raise bad_request(str(exc)) from None
        if self.service.pool.saturated():  # refuse at once, without a worker thread
            raise busy(_busy_message(self.service))
        run = AsyncRequest(req, on_finish=self.metrics.observe_generation)
        try:
            started = await _unless_disconnected(request, run.start(), run)
        except BusyError as exc:
            raise busy(str(exc)) from None
        except _ClientGone:
            return Response(status_code=499)
        if not started:
            return Response(status_code=499)
        shape = Shape(chat, self.model_name)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            async def free_worker():  # runs once the response ends, also after a disconnect cancelled it
                run.cancel()

            return StreamingResponse(self.stream(run, shape, include_usage, request.url.path, arrived),
                                     media_type="text/event-stream", background=BackgroundTask(free_worker),
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            await _unless_disconnected(request, run.result(), run)
        except _ClientGone:
            return Response(status_code=499)
        except SpecDeployError as exc:
            raise bad_request(str(exc)) from None
        return JSONResponse(shape.response(req.text, req.finish_reason, self.usage(req), public_stats(req.stats)))

    async def stream(self, run: AsyncRequest, shape: Shape, include_usage: bool, endpoint: str, arrived: float):
        req, first = run.request, True
        try:
            if shape.chat:
                yield shape.chunk(None, role=True)
            async for batch in run.batches():  # one write per batch of ready tokens
                pieces = [shape.chunk(event.text) for event in batch if event.text]
                if pieces:
                    if first:
                        self.metrics.ttft.labels(endpoint).observe(time.perf_counter() - arrived)  # queue included
                        first = False
                    yield "".join(pieces)
            yield shape.chunk(None, req.finish_reason)
            if include_usage:
                yield shape.usage_chunk(self.usage(req), public_stats(req.stats))
            yield DONE
        except Exception as exc:  # headers are gone: report in-band, as OpenAI does
            if not isinstance(exc, SpecDeployError):
                log.exception("stream failed")
            message = str(exc) if isinstance(exc, SpecDeployError) else "internal error while generating"
            yield sse(error_body(400 if isinstance(exc, SpecDeployError) else 500, message))
        finally:  # client gone (the response task was cancelled) or done: free the worker either way
            run.cancel()

    @staticmethod
    def usage(req) -> dict:
        return usage(len(req.prompt_ids), len(req.token_ids))


async def _unless_disconnected(request: Request, awaitable, run: AsyncRequest):
    """Await `awaitable`, but cancel the run and raise _ClientGone if the client disconnects first."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        run.cancel()
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    run.cancel()
    task.cancel()
    raise _ClientGone()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _busy_message(service) -> str:
    p = service.pool
    return f"server busy: all {p.size} workers are in use and the wait queue ({p.queue_size}) is full; retry later"


def create_app(service, model_name: str | None = None) -> FastAPI:
    """The ASGI app for one loaded Service (see runtime/service.py)."""
    manifest = service.meta.manifest
    name = model_name or Path(manifest.root).resolve().name
    template = ChatTemplate.from_tokenizer_dir(manifest.root / manifest.tokenizer.get("dir", "tokenizer"))
    metrics = Metrics(service)
    server = Server(service, name, template, metrics)
    app = FastAPI(title="specdeploy", version="1", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(MetricsMiddleware, metrics=metrics)

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(error_body(exc.status_code, str(exc.detail), None, code), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        return JSONResponse(error_body(400, "invalid request", None, "invalid_value"), status_code=400)

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        log.error("internal error on %s", request.url.path, exc_info=exc)
        return JSONResponse(error_body(500, "internal server error", None, "internal_error"), status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "chat_template": template is not None, **service.status()}

    @app.get("/metrics")
    async def metrics_endpoint():
        return Response(metrics.render(), media_type=metrics.content_type)

    def model_card() -> dict:
        return {"id": name, "object": "model", "created": int(manifest.root.stat().st_mtime), "owned_by": "specdeploy",
                "max_context": service.max_context, "methods": list(service.methods),
                "default_method": service.default_method}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != name:
            raise ApiError(404, f"the model '{model_id}' does not exist", "model", "model_not_found")
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await server.body(request, CompletionRequest)
        ids = await server.completion_prompt(body.prompt)
        options = server.options(body, ids, body.max_tokens, DEFAULT_COMPLETION_TOKENS, "prompt")
        return await server.generate(request, body, options, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await server.body(request, ChatRequest)
        ids = await server.chat_prompt(body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        options = server.options(body, ids, max_tokens, None, "messages")
        return await server.generate(request, body, options, chat=True)

    return app
