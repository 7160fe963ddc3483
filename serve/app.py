"""The FastAPI app: OpenAI-compatible endpoints over a runtime Service, plus /health and /metrics.

A generation request goes: admission (429 at once past `--max-concurrent-requests`, before
any expensive work) -> JSON Content-Type (415) -> body, bounded in size and time -> parse
and validate -> chat template (killable child process, time limit) and tokenization (both
off the event loop) -> the Service's pool (its queue may still answer 429) -> a worker
thread per generation (runtime/aio.py). A client that goes away — while queued, during
prefill, while generating, mid-stream — cancels its request; so does the per-request
deadline. Errors: 4xx when the request is at fault, 5xx (`internal_error`) when we are;
a stream reports an error in-band and still ends with `data: [DONE]`.

Shutdown (serve/main.py): `begin_shutdown` refuses new requests (503) and aborts every
generation in flight, which answers at once — a 503 JSON, or for a stream an in-band error
then `data: [DONE]` — while its worker stops at its next step; `finish_shutdown` then waits
until no worker is inside ONNX Runtime, so that the interpreter can finalize safely.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from ..runtime.aio import AsyncRequest
from ..runtime.chat_template import ChatTemplateError, encode_rendered, template_source
from ..runtime.errors import SpecDeployError
from ..runtime.methods import AUTO
from ..runtime.pool import BusyError, PoolClosed
from ..runtime.tokenizer import text_and_offsets
from .admission import Admission, Admitted
from .chat import message_dicts
from .choices import Plan, combined_stats, merged
from .errors import (
    ApiError,
    InternalErrorMiddleware,
    bad_request,
    busy,
    error_body,
    internal,
    shutting_down,
    start_tracker,
    too_large,
)
from .header_limit import HeaderLimitMiddleware
from .limits import ServeLimits
from .metrics import Metrics, MetricsMiddleware
from .openai_format import DONE, Shape, sse, usage
from .ray_failover import PROXY_BODY_KEY
from .schemas import (
    ChatRequest,
    CompletionRequest,
    parse_json,
    served_schema,
    stop_strings,
    token_biases,
    validate,
)
from .security import AccessGuardMiddleware, ConnectionLimitMiddleware, RequestIdMiddleware
from .template_sandbox import TemplateFailure, TemplateSandbox, TemplateTimeout

log = logging.getLogger("specdeploy.serve")

THREAD_PARSE_BYTES = 64 << 10  # larger bodies are parsed off the event loop
START_MARGIN_S = 0.5  # past the queue's time limit, for a request of several generations (Server._start)
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left
REQUEST_BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest}


class _ClientGone(Exception):
    pass


class _Overrun(Exception):
    """Work past its time limit that runs on in a thread (which cannot be stopped): `error` is the answer;
    the request keeps its admission until `work` ends, so admission still bounds such threads."""

    def __init__(self, work: asyncio.Future, error: ApiError):
        super().__init__(error.message)
        self.work, self.error = work, error


class _Deadline:
    """The per-request time limit: when it passes, the request's generation is cancelled."""

    def __init__(self, seconds: float | None):
        self.loop = asyncio.get_running_loop()
        self.at = None if seconds is None else self.loop.time() + seconds
        self.seconds = seconds
        self.expired = False
        self._timer = None

    def watch(self, runs: list[AsyncRequest]) -> None:
        if self.at is not None:
            self._timer = self.loop.call_at(self.at, self._expire, runs)

    def _expire(self, runs: list[AsyncRequest]) -> None:
        self.expired = True
        for run in runs:
            run.cancel()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def error(self) -> ApiError:
        return ApiError(504, f"the request did not finish within the server's {self.seconds:g} s limit "
                        "(--request-timeout)", None, "deadline_exceeded")


class Server:
    """What the endpoints share: the service, its name, limits, chat template and metrics."""

    def __init__(self, service, model_name: str, chat: TemplateSandbox | None, metrics: Metrics,
                 limits: ServeLimits):
        self.service, self.model_name, self.chat, self.metrics = service, model_name, chat, metrics
        self.limits = limits
        self.model_len = limits.model_len(service.max_context)
        self.admission = Admission(limits.concurrent(service.pool.size, service.pool.queue_size))
        self.connection_limit = limits.connections(self.admission.limit)
        self.closing = False  # shutting down: no new generation, those in flight aborted
        self.runs: weakref.WeakSet[AsyncRequest] = weakref.WeakSet()  # generations not yet collected

    # -- shutdown ---------------------------------------------------------------------
    def begin_shutdown(self) -> None:
        """Admit nothing more and end every generation in flight with a 503 now (event loop thread)."""
        self.closing = True
        for run in list(self.runs):
            run.abort(shutting_down())

    def finish_shutdown(self, timeout: float) -> bool:
        """Blocking (run it off the event loop): wait up to `timeout` seconds for the workers to stop. True
        when no thread is inside ONNX Runtime any more (see Service.close) and the process may exit."""
        deadline = time.monotonic() + timeout
        stopped = self.service.close(timeout)
        for run in list(self.runs):  # what a worker does after freeing its instance (metrics, its last event)
            run.join(max(0.0, min(1.0, deadline - time.monotonic())))
        return stopped

    # -- admission and request parsing -------------------------------------------------
    def admit(self, request: Request) -> Admitted:
        if self.closing:
            raise shutting_down()
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type != "application/json":
            raise ApiError(415, "the request body must be JSON sent with 'Content-Type: application/json'",
                           None, "unsupported_media_type")
        # The body is read as it comes: a compressed one would fail as "not valid JSON", which is not why.
        codings = [c.strip().lower() for value in request.headers.getlist("content-encoding")
                   for c in value.split(",") if c.strip()]
        unsupported = [c for c in codings if c != "identity"]
        if unsupported:
            raise ApiError(415, f"Content-Encoding {', '.join(unsupported)} is not supported; send the body "
                           "uncompressed", None, "unsupported_content_encoding")
        admitted = None if self.service.pool.saturated() else self.admission.enter()
        if admitted is None:
            raise busy(f"server busy: {self.admission.active} requests in flight for {self.service.pool.size} "
                       f"workers and a queue of {self.service.pool.queue_size}; retry later")
        return admitted

    async def body(self, request: Request, schema):
        limit = self.limits.max_body_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_large(limit)
        raw = request.scope.get(PROXY_BODY_KEY)  # read by Ray Serve's proxy (ray_failover.py)
        if isinstance(raw, bytes):
            if len(raw) > limit:
                raise too_large(limit)
        else:
            raw = await self._receive(request, limit)
        data = await run_in_threadpool(parse_json, raw) if len(raw) > THREAD_PARSE_BYTES else parse_json(raw)
        body = validate(schema, data)
        if body.model != self.model_name:
            raise ApiError(404, f"the model '{body.model}' does not exist (this server serves '{self.model_name}')",
                           "model", "model_not_found")
        return body

    async def _receive(self, request: Request, limit: int) -> bytes:
        try:
            return await asyncio.wait_for(self._read(request, limit), self.limits.body_timeout_s)
        except ClientDisconnect:
            raise _ClientGone() from None
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s",
                           None, "request_timeout") from None

    @staticmethod
    async def _read(request: Request, limit: int) -> bytes:
        raw, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            raw.append(chunk)
        return b"".join(raw)

    async def encode(self, text: str, rendered: bool = False) -> list[int]:
        """Off the event loop; a tokenizer that takes too long is answered at once (its thread ends on its
        own: the body limit bounds how long it runs, admission how many run, see _Overrun)."""
        tok = self.service.tokenizer
        work = asyncio.ensure_future(run_in_threadpool(encode_rendered, tok, text) if rendered
                                     else run_in_threadpool(tok.encode, text))
        try:
            return await asyncio.wait_for(asyncio.shield(work), self.limits.tokenize_timeout_s)
        except asyncio.TimeoutError:
            raise _Overrun(work, internal(f"tokenizing the prompt took longer than "
                                          f"{self.limits.tokenize_timeout_s:g} s (--tokenize-timeout)",
                                          "tokenize_timeout")) from None

    async def completion_prompts(self, prompt) -> list[list[int]]:
        """The token ids of each prompt: OpenAI's string, token ids, or a list of either (a batch)."""
        def ids(tokens: list) -> bool:
            return all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)

        if isinstance(prompt, str) or isinstance(prompt, list) and ids(prompt):  # one prompt ([]: empty, refused)
            prompt = [prompt]
        elif not isinstance(prompt, list) or not all(isinstance(p, str) or isinstance(p, list) and ids(p)
                                                     for p in prompt):
            raise bad_request("'prompt' must be a string, a list of token ids, or a list of either",
                              "prompt", "invalid_type")
        vocab = self.service.meta.manifest.models["target"].vocab_size
        out = []
        for i, p in enumerate(prompt):
            if len(prompt) > 1 and not p:
                raise bad_request(f"prompt {i} of the list is empty", "prompt")
            if isinstance(p, str):
                out.append(await self.encode(p))
            elif any(not 0 <= t < vocab for t in p):
                raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
            else:
                out.append(list(p))
        return out

    async def chat_prompt(self, body: ChatRequest) -> list[int]:
        if self.chat is None:
            raise bad_request("this model's tokenizer has no chat template (chat_template.jinja, chat_template.json "
                              "or tokenizer_config.json 'chat_template'); use /v1/completions", "messages",
                              "no_chat_template")
        messages = message_dicts(body.messages)
        try:
            text = await run_in_threadpool(self.chat.render, messages)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from None
        except TemplateTimeout as exc:
            raise internal(str(exc), "chat_template_timeout") from None
        except TemplateFailure as exc:
            raise internal(str(exc), "chat_template_failed") from None
        return await self.encode(text, rendered=True)  # the template already wrote BOS and the like

    def options(self, body, prompt_ids: list[int], max_tokens: int | None, default_max: int | None,
                prompt_param: str, tokens_param: str) -> dict:
        svc = self.service
        method = svc.resolve(body.method)
        if method not in svc.methods:
            raise bad_request(svc.method_message(method), "method", "unknown_method")
        if not prompt_ids:
            raise bad_request("the prompt is empty", prompt_param)
        ctx, n, cap = self.model_len, len(prompt_ids), self.limits.max_tokens
        scoring = body.echoes() and body.alternatives() is not None  # the prompt's logprobs: 0 new tokens allowed
        # scoring alone (0 new tokens) reads the prefill's rows, which stop before the last token: a whole window
        if n > ctx or n == ctx and not (scoring and max_tokens == 0):
            raise bad_request(f"this model's maximum context length is {ctx} tokens; the prompt has {n} tokens "
                              "(it must leave room for at least one new token, unless it is only scored: echo, "
                              "logprobs and max_tokens 0)", prompt_param, "context_length_exceeded")
        if max_tokens == 0 and not scoring:
            raise bad_request(f"'{tokens_param}' must be at least 1 (0 only with echo and logprobs, to score the "
                              "prompt)", tokens_param, "invalid_value")
        if max_tokens is None:
            max_tokens = min(default_max or ctx, ctx - n, cap or ctx)
        elif cap is not None and max_tokens > cap:
            raise bad_request(f"'{tokens_param}' is {max_tokens}; this server allows at most {cap} "
                              "(--max-tokens)", tokens_param)
        elif n + max_tokens > ctx:
            raise bad_request(f"this model's maximum context length is {ctx} tokens; you requested {n + max_tokens} "
                              f"({n} in the prompt, {max_tokens} for the completion)", tokens_param,
                              "context_length_exceeded")
        return dict(prompt_ids=prompt_ids, method=method, max_new_tokens=max_tokens,
                    temperature=1.0 if body.temperature is None else body.temperature,
                    top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0, seed=body.sampling_seed(),
                    min_p=body.min_p or 0.0,
                    stop=stop_strings(body.stop, self.limits.max_stop, self.limits.max_stop_chars),
                    ignore_eos=bool(body.ignore_eos), sampling=body.sampling, logprobs=body.alternatives(),
                    repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                    frequency_penalty=body.frequency_penalty or 0.0, presence_penalty=body.presence_penalty or 0.0,
                    logit_bias=token_biases(body.logit_bias, svc.meta.manifest.models["target"].vocab_size),
                    prompt_logprobs=scoring)

    # -- running --------------------------------------------------------------------
    async def handle(self, request: Request, chat: bool):
        """One generation request from arrival to response; owns its admission until the response ends."""
        arrived = time.perf_counter()
        admitted = self.admit(request)
        deadline = _Deadline(self.limits.request_timeout_s)
        try:
            try:
                body = await self.body(request, REQUEST_BODIES[request.url.path])
            except _ClientGone:
                return Response(status_code=499)
            if chat:
                ids = await self.chat_prompt(body)
                max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
                param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
                options = [self.options(body, ids, max_tokens, None, "messages", param)]
            else:
                options = [self.options(body, ids, body.max_tokens, DEFAULT_COMPLETION_TOKENS, "prompt", "max_tokens")
                           for ids in await self.completion_prompts(body.prompt)]
            pool = self.service.pool
            plan = Plan.of(body, options, min(self.admission.limit, pool.size + pool.queue_size))
            if not admitted.widen(plan.runs - 1):
                raise busy(f"server busy: the request needs {plan.runs} generations and {self.admission.active - 1} "
                           f"of {self.admission.limit} places are held by others; retry later")
            runs = [self._run(request, plan.options(options, i)) for i in range(plan.runs)]
            deadline.watch(runs)
            if not await self._start(request, runs, deadline):
                return Response(status_code=499)
            shape = Shape(chat, self.model_name, self.service.tokenizer.token_bytes)
            # each prompt's (completions' echo: the prompt's text first)
            shapes = [shape.echoing(text_and_offsets(self.service.tokenizer, o["prompt_ids"])[0]) if body.echoes()
                      else shape for o in options]
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                cleanup = _Cleanup(runs, deadline, admitted)
                admitted = None  # the stream owns it now
                prompt_tokens = plan.prompt_tokens(options) if include_usage else 0
                return StreamingResponse(self.stream(request, runs, plan, shapes, prompt_tokens, include_usage,
                                                     arrived, deadline, cleanup),
                                         media_type="text/event-stream", background=BackgroundTask(cleanup),
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            try:
                await _unless_disconnected(request, _all(runs), runs)
            except _ClientGone:
                return Response(status_code=499)
            except Exception as exc:
                raise self.failure(request, exc) from None
            if deadline.expired:
                raise deadline.error()
            reqs = [run.request for run in runs]
            choices = [shapes[k // plan.per_prompt].choice(i, reqs[k].text, reqs[k].finish_reason,
                                                           reqs[k].logprobs if plan.shows_logprobs else None,
                                                           _prompt(reqs[k]))
                       for i, k in enumerate(plan.chosen(reqs))]
            usage_ = usage(plan.prompt_tokens(options), plan.completion_tokens(reqs))
            return JSONResponse(shape.response(choices, usage_, combined_stats(reqs)))
        except _Overrun as overrun:
            held, admitted = admitted, None
            deadline.stop()
            overrun.work.add_done_callback(lambda work: _release_after(work, held))
            raise overrun.error from None
        finally:
            if admitted is not None:
                deadline.stop()
                admitted.release()

    def _run(self, request: Request, options: dict) -> AsyncRequest:
        if self.closing:  # the shutdown began while the body was read or the prompt tokenized
            raise shutting_down()
        try:
            req = self.service.request(**options, request_id=request.state.request_id)
        except SpecDeployError as exc:  # the server checked the same things; this is a last line
            raise bad_request(str(exc)) from None
        run = AsyncRequest(req, on_finish=self.metrics.observe_generation)
        self.runs.add(run)
        return run

    async def _start(self, request: Request, runs: list[AsyncRequest], deadline: _Deadline) -> bool:
        """Wait until the first generation has a worker (a batch row), or one is refused; the others start as
        workers free up (Plan.options: without the queue's time limit). False if the client went away
        meanwhile. One refused ends them all."""
        starts = [asyncio.ensure_future(run.start()) for run in runs]
        for start in starts:  # those not awaited here raise again where the run is read (AsyncRequest.batches)
            start.add_done_callback(_retrieve)
        limit = self.service.pool.queue_timeout if len(runs) > 1 else None  # one run: the pool's own wait
        # a worker handed over at once still reaches this loop through a thread: a moment's margin past the limit
        waiting = asyncio.wait(starts, timeout=None if limit is None else limit + START_MARGIN_S,
                               return_when=asyncio.FIRST_COMPLETED)
        try:
            done, _ = await _unless_disconnected(request, waiting, runs)
        except _ClientGone:
            return False
        if not done:  # none of the request's generations got a worker within the queue's time limit
            for run in runs:
                run.cancel()
            raise busy(f"server busy: no worker became free within {limit:g} s; retry later")
        refused = next((start.exception() for start in done if start.exception() is not None), None)
        if refused is not None or not all(start.result() for start in done):
            for run in runs:
                run.cancel()
            if refused is not None:
                raise self.failure(request, refused) from None
            if deadline.expired:
                raise deadline.error()
            return False
        return True

    def failure(self, request: Request, exc: Exception) -> ApiError:
        """What to tell the client about an exception raised while queueing or generating."""
        if isinstance(exc, ApiError):
            return exc
        if isinstance(exc, BusyError):
            return busy(str(exc))
        if isinstance(exc, PoolClosed):
            return shutting_down()
        request_id = request.state.request_id
        log.error("request %s: internal error while generating", request_id, exc_info=exc)
        return internal(f"internal error while generating (request id {request_id}; details in the server log)")

    async def stream(self, request: Request, runs: list[AsyncRequest], plan: Plan, shapes: list[Shape],
                     prompt_tokens: int, include_usage: bool, arrived: float, deadline: _Deadline,
                     cleanup: "_Cleanup"):
        reqs, first, ended = [run.request for run in runs], True, False
        # the choices each generation shows (all of its prompt's where one greedy generation answers n)
        shows = {k: plan.shown_by(k) for k in range(len(runs))}
        shape = shapes[0]
        try:
            try:
                if shape.chat:
                    yield "".join(shape.chunk(None, role=True, index=i) for i in range(plan.n))
                # a token's logprobs ride with the chunk that carries its text (runtime/generate.py holds them
                # back with it); those of a token without text (EOS) in a chunk of no text
                wants = plan.shows_logprobs
                echo = set(range(len(runs))) if shape.echo is not None else set()  # the prompt's text first, once
                async for k, batch in merged(runs):  # one write per batch of ready tokens
                    req, mine = reqs[k], shapes[k // plan.per_prompt]
                    pieces = []
                    if k in echo and (batch is None or batch):  # prefilled (or ended: max_tokens 0, or cancelled)
                        pieces += [mine.echo_chunk(_prompt(req), i) for i in shows[k]]
                        echo.discard(k)
                    if batch is None:  # this generation ended
                        if deadline.expired:
                            raise deadline.error()
                        pieces += [mine.chunk(None, req.finish_reason, index=i) for i in shows[k]]
                    else:
                        pieces += [mine.chunk(event.text, logprobs=event.logprobs if wants else None, index=i)
                                   for event in batch if event.text or wants and event.logprobs for i in shows[k]]
                    if pieces:
                        if first and batch is not None:
                            self.metrics.ttft.labels(request.url.path).observe(time.perf_counter() - arrived)
                            first = False
                        yield "".join(pieces)
                if include_usage:
                    yield shape.usage_chunk(usage(prompt_tokens, plan.completion_tokens(reqs)), combined_stats(reqs))
            except Exception as exc:  # headers are gone: report in-band, as OpenAI does, then end as usual
                error = self.failure(request, exc)
                request.state.outcome = error.status
                yield sse(error.body())
            ended = True
            yield DONE
        finally:  # client gone (the response task was cancelled) or done: free the worker either way
            if not ended:
                request.state.outcome = 499
            cleanup()


def _prompt(req) -> tuple | None:
    """(prompt ids, their logprobs) of a request that asked for them (an echo with logprobs), once prefilled."""
    logprobs = req.prompt_logprobs
    return None if logprobs is None or len(logprobs) < len(req.prompt_ids) else (req.prompt_ids, logprobs)


class _Cleanup:
    """Ends a streamed request's hold on everything; safe to call twice (stream end and background task)."""

    def __init__(self, runs: list[AsyncRequest], deadline: _Deadline, admitted: Admitted):
        self.runs, self.deadline, self.admitted = runs, deadline, admitted

    def __call__(self) -> None:
        for run in self.runs:
            run.cancel()
        self.deadline.stop()
        self.admitted.release()


class _ShutdownCutoffMiddleware:
    """Outermost: a request still running when uvicorn's graceful shutdown times out (a client that stopped
    reading its stream, or sending its body) is cancelled by uvicorn, which would log it as "Exception in
    ASGI application" with a traceback (and answer a plain-text 500 if nothing was sent yet). It ends
    here: one log line, and a JSON 503 if its response had not started."""

    def __init__(self, app, server: Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, send_tracked = start_tracker(send)
        try:
            return await self.app(scope, receive, send_tracked)
        except asyncio.CancelledError:
            if not self.server.closing:
                raise
            request_id = scope.get("state", {}).get("request_id")
            log.warning("request %s: %s %s cut off: still running when the graceful shutdown timed out",
                        request_id, scope.get("method"), scope.get("path"))
            if not started[0]:
                await shutting_down().response()(scope, receive, send)


async def _all(runs: list[AsyncRequest]) -> list:
    """Every run's result; the first failure stops the others (asyncio.gather lets them run on). A task, so that
    cancelled (the client went away) it takes its own outcome rather than leaving a gathering future whose
    cancellation nobody retrieved (asyncio logs those, with a traceback)."""
    try:
        return await asyncio.gather(*(run.result() for run in runs))
    except BaseException:
        for run in runs:
            run.cancel()
        raise


def _retrieve(future: asyncio.Future) -> None:
    """Done callback: takes a future's outcome, so that an exception nobody awaits is not logged as lost."""
    if not future.cancelled():
        future.exception()


def _release_after(work: asyncio.Future, admitted: Admitted) -> None:
    """Done callback of an overrun's work: frees its admission and takes its outcome (nobody awaits it)."""
    admitted.release()
    _retrieve(work)


async def _unless_disconnected(request: Request, awaitable, runs: list[AsyncRequest]):
    """Await `awaitable`, but cancel the runs and raise _ClientGone if the client disconnects first."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        for run in runs:
            run.cancel()
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    for run in runs:
        run.cancel()
    task.cancel()
    raise _ClientGone()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def openapi_schema(app: FastAPI, server: Server) -> dict:
    """The app's OpenAPI document with the request bodies the endpoints validate by hand, narrowed
    to what this server serves: its one model, its methods, its --max-tokens."""
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in REQUEST_BODIES.items():
        body = served_schema(model)
        components.update(body.pop("$defs", {}))
        fields = body["properties"]
        fields["model"] = {**fields["model"], "enum": [server.model_name]}
        if "prompt" in fields:
            vocab = server.service.meta.manifest.models["target"].vocab_size
            fields["prompt"]["anyOf"][1]["items"]["maximum"] = vocab - 1
            fields["prompt"]["anyOf"][2]["items"]["anyOf"][1]["items"]["maximum"] = vocab - 1
        fields["method"] = {"anyOf": [{"type": "string", "enum": [AUTO, *server.service.methods]}, {"type": "null"}]}
        pool = server.service.pool
        for name in ("n", "best_of"):  # serve/choices.py
            if name in fields:
                most = min(server.admission.limit, pool.size + pool.queue_size)
                fields[name] = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": most}, {"type": "null"}]}
        if server.limits.max_tokens is not None:
            for name in ("max_tokens", "max_completion_tokens"):
                if name in fields:
                    fields[name] = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": server.limits.max_tokens},
                                              {"type": "null"}]}
        components[model.__name__] = body
        reference = {"$ref": f"#/components/schemas/{model.__name__}"}
        schema["paths"][path]["post"]["requestBody"] = {"required": True,
                                                        "content": {"application/json": {"schema": reference}}}
    return schema


def create_app(service, model_name: str | None = None, limits: ServeLimits | None = None,
               api_key: str | None = None, allowed_origins: list[str] | None = None) -> FastAPI:
    """The ASGI app for one loaded Service (see runtime/service.py).

    `api_key`: required as `Authorization: Bearer KEY` on every path but /health.
    `allowed_origins`: web origins that may call the API from a browser (CORS); none by default.
    """
    limits = limits or ServeLimits()
    manifest = service.meta.manifest
    name = model_name or Path(manifest.root).resolve().name
    tokenizer_dir = manifest.root / manifest.tokenizer.get("dir", "tokenizer")
    sandbox = None
    if template_source(tokenizer_dir) is not None:  # compiled in a child, where a template runs: fail at start-up
        sandbox = TemplateSandbox(tokenizer_dir, limits.template_processes, limits.template_timeout_s)
        try:
            sandbox.check()
        except SpecDeployError:
            sandbox.close()
            raise
    metrics = Metrics(service)
    server = Server(service, name, sandbox, metrics, limits)

    @asynccontextmanager
    async def lifespan(app):
        yield
        if sandbox is not None:
            sandbox.close()

    app = FastAPI(title="specdeploy", version="1", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.server = server
    # Outermost first at run time: request id, CORS (answers preflights), metrics (counts refusals too),
    # header size, connection limit, guard, our faults (a JSON 500 that all the others see).
    app.add_middleware(InternalErrorMiddleware)
    app.add_middleware(AccessGuardMiddleware, api_key=api_key, allowed_origins=list(allowed_origins or []))
    app.add_middleware(ConnectionLimitMiddleware, limit=server.connection_limit)
    app.add_middleware(HeaderLimitMiddleware, limit=limits.max_header_bytes)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                           expose_headers=["X-Request-Id"], max_age=600)
    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(_ShutdownCutoffMiddleware, server=server)

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
        # A fault in a middleware outside InternalErrorMiddleware: Starlette re-raises it after this
        # answer, and uvicorn logs its traceback (once).
        request_id = request.scope.get("state", {}).get("request_id")
        return internal(f"internal server error (request id {request_id}; details in the server log)").response()

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "chat_template": sandbox is not None, "max_model_len": server.model_len,
                "in_flight": server.admission.active, "max_concurrent_requests": server.admission.limit,
                **service.status()}

    @app.get("/metrics")
    async def metrics_endpoint():
        return Response(metrics.render(), media_type=metrics.content_type)

    document = []

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi():
        if not document:
            document.append(openapi_schema(app, server))
        return document[0]

    def model_card() -> dict:
        return {"id": name, "object": "model", "created": int(manifest.root.stat().st_mtime), "owned_by": "specdeploy",
                "max_context": server.model_len, "methods": list(service.methods),
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
        return await server.handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.handle(request, chat=True)

    return app
