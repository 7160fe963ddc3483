"""asyncio bridge: run a service Request in its own thread, receive its events on the event loop.

The decode loop stays synchronous (ORT releases the GIL during `run`), so an asyncio app
keeps answering other requests while generations run:

    run = AsyncRequest(svc.request("Hello", max_new_tokens=32))
    await run.start()            # BusyError here, before any response is sent
    async for event in run:      # TokenEvents as they are produced
        ...
    run.cancel()                 # e.g. the client went away: frees the instance within one step
    run.abort(error)             # e.g. shutdown: as cancel, and the reader gets `error` now, not after the step
"""

from __future__ import annotations

import asyncio
import threading
from typing import Callable

from .service import Request

_STARTED, _EVENT, _DONE, _ERROR = "started", "event", "done", "error"


class AsyncRequest:
    def __init__(self, request: Request, on_finish: Callable[[Request], None] | None = None):
        """`on_finish(request)` runs in the worker thread once a started request has freed its instance."""
        self.request = request
        self._on_finish = on_finish
        self._loop = asyncio.get_running_loop()
        # Unbounded, but never larger than the request's max_new_tokens events.
        self._queue: asyncio.Queue = asyncio.Queue()
        self._thread = threading.Thread(target=self._run, name=f"specdeploy-{str(request.id)[:8]}", daemon=True)
        self._started: asyncio.Future | None = None  # start()'s outcome, for every caller after the first
        self._aborted = False

    async def start(self) -> bool:
        """Wait (without blocking the loop) for an instance; raises what Request.start raises. Iterating
        or awaiting result() starts the request if this was not awaited; awaiting it again returns
        (or raises) what the first call did."""
        if self._started is not None:
            return await asyncio.shield(self._started)
        self._started = self._loop.create_future()
        self._thread.start()
        try:
            kind, value = await self._queue.get()
        except BaseException:  # the caller was cancelled while queued: leave the queue
            self.request.cancel()
            self._started.cancel()
            raise
        if kind == _ERROR:
            self._started.set_exception(value)
            self._started.exception()  # retrieved: no "never retrieved" warning when nobody asks again
            raise value
        self._started.set_result(kind == _STARTED)
        return kind == _STARTED

    def __aiter__(self):
        return self._events()

    async def _events(self):
        async for batch in self.batches():
            for event in batch:
                yield event

    async def batches(self):
        """Lists of the events that are ready, so that a consumer can write them in one go.

        Each batch waits on the loop at least once, which lets it notice a disconnect
        before writing a backlog to a dead socket.
        """
        if not await self.start():  # started here if the caller did not; cancelled while queued: no events
            return
        ended = False
        try:
            while True:
                batch = []
                item = await self._queue.get()
                while True:
                    kind, value = item
                    if kind != _EVENT:
                        ended = True
                        break
                    batch.append(value)
                    if self._queue.empty():
                        break
                    item = self._queue.get_nowait()
                if batch:
                    yield batch
                if ended:
                    if kind == _ERROR:
                        raise value
                    return
                await asyncio.sleep(0)
        finally:
            if not ended:  # the consumer stopped early (client disconnect): free the instance
                self.request.cancel()

    async def result(self):
        """The whole generation, as `Request.result()` gives it (a GenerationResult), once it has ended."""
        async for _ in self:
            pass
        return self.request.result()  # read to its end: no step runs here

    def cancel(self) -> None:
        self.request.cancel()

    def abort(self, error: BaseException) -> None:
        """Cancel, and end what the reader sees with `error` at once (start(), the events, result() raise
        it after the events already produced) rather than when the worker ends its step: a step may take
        long, a shutdown should not wait on it to answer. The worker still frees its instance when the
        step ends (Service.close waits for that). Event loop thread only; later calls do nothing."""
        self.request.cancel()
        if not self._aborted:
            self._aborted = True
            self._queue.put_nowait((_ERROR, error))

    def join(self, timeout: float | None = None) -> bool:
        """Wait (blocking) up to `timeout` seconds for the worker thread to end; True if it has (or never started)."""
        if self._thread.ident is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- worker thread --------------------------------------------------------------
    def _run(self) -> None:
        req, started = self.request, False
        try:
            try:
                started = req.start()
            except BaseException as exc:
                self._put((_ERROR, exc))
                return
            if not started:  # cancelled while queued
                self._put((_DONE, None))
                return
            self._put((_STARTED, None))
            try:
                for event in req:
                    if not self._put((_EVENT, event)):
                        req.cancel()
                self._put((_DONE, None))
            except BaseException as exc:
                self._put((_ERROR, exc))
        finally:
            req.close()
            if (started or req.error is not None) and self._on_finish is not None:  # those that got an instance
                try:
                    self._on_finish(req)
                except Exception:  # observers must never take the worker down
                    pass

    def _put(self, item) -> bool:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
            return True
        except RuntimeError:  # the loop is closed (shutdown): nobody is listening any more
            return False
