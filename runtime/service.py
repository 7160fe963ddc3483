"""Embedding API: load an export once, serve many concurrent requests from a pool of instances.

    svc = Service.load("build/export", pool_size=2, queue_size=8)
    print(svc.generate("Once upon a time", max_new_tokens=32).text)
    with svc.stream("Hello", method="draft") as req:   # waits for a free instance (BusyError if it can't)
        for event in req:
            print(event.text, end="")
    print(req.stats["acceptance_length"])

Thread-safe: call from any number of threads; `Request.cancel()` works from any thread.
See runtime/pool.py for why a pool of instances and what it costs in memory.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import SpecDeployError
from .generate import (
    Generation,
    GenerationResult,
    TokenEvent,
    checked_flag,
    checked_ids,
    checked_stop,
    validate_request,
)
from .kv_cache import cache_bytes, require_memory
from .loaded_export import LoadedExport
from .logprobs import TokenLogprob, checked_top
from .methods import AUTO, resolve_method
from .penalties import Penalties
from .pool import BusyError, ExportPool, PoolClosed, Ticket, check_wait
from .sampling import SamplingParams, as_int

__all__ = ["Service", "Request", "BusyError", "PoolClosed", "TokenEvent"]

log = logging.getLogger("specdeploy.runtime")


def _plain_int(value):
    """numpy's integers as Python ints; anything else as given (for its own check to refuse or take)."""
    n = as_int(value)
    return value if n is None else n


class Service:
    """One loaded export behind a bounded pool; thread-safe. Build it with Service.load()."""

    def __init__(self, pool: ExportPool, default_method: str, unavailable: dict[str, str] | None = None):
        self.pool = pool
        self.meta = pool.exports[0]  # read-only use: manifest, tokenizer, method configs (identical in all)
        self.unavailable = dict(unavailable or {})
        self.methods = [m for m in self.meta.methods if m not in self.unavailable]
        default_method = resolve_method(default_method, self.meta, self.methods)
        if default_method not in self.methods:
            raise SpecDeployError(self.method_message(default_method))
        self.default_method = default_method
        # Requests holding an instance, for close(); weak: a request dropped unread must still be
        # collected (its __del__ hands it to the reaper, which frees the instance).
        self._running: weakref.WeakSet[Request] = weakref.WeakSet()
        self._running_lock = threading.Lock()

    @classmethod
    def load(cls, export_dir: str | Path, pool_size: int = 1, queue_size: int = 8, queue_timeout: float = 30.0,
             backend: str | None = "auto", threads: int | None = None, method: str | None = None,
             verify_checksums: bool = True, warmup: bool = True, batch: int | None = None) -> "Service":
        """Open `pool_size` instances of one export (checksums are verified once).

        `batch`: serve up to `batch` requests as rows of one batched target graph instead
        (runtime/batching; ONNX Runtime CPU, pool_size is then ignored): plain steps of all
        rows run as one call, the weights and one calling thread are shared by all.

        `threads`: ORT intra-op threads per session. The instances share their sessions (one
        copy of the weights), so concurrent requests share each session's thread pool; by
        default the CPU backend sizes it so that its workers plus one calling thread per
        instance fill the cores (ignored under use_shared_threads, the process-wide pool).
        `warmup` opens every method's graphs now rather than in the first requests.
        `method`: what a request that names none runs; None or "auto": the export's recommended
        method among those it serves (runtime/methods.py, RECOMMENDED), as a request naming "auto".
        """
        # numpy's integers are integers: taken as Python ints here, so that the checks below and in the
        # pool (queue_size), the batch (batch) and ONNX Runtime's options (threads) see ints
        pool_size, queue_size, batch, threads = map(_plain_int, (pool_size, queue_size, batch, threads))
        if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 1:
            raise SpecDeployError(f"pool size must be an integer >= 1, got {pool_size!r}")
        pool_type = ExportPool
        if batch is not None:
            if backend not in (None, "auto", "ort-cpu"):
                raise SpecDeployError(f"batched serving runs on ort-cpu only, not {backend}")
            from .batching.batched_export import BatchedExport, RowPool

            exports: list[LoadedExport] = BatchedExport(export_dir, batch, threads, verify_checksums).rows()
            pool_type = RowPool
        else:
            first = LoadedExport(export_dir, backend=backend, threads=threads, verify_checksums=verify_checksums)
            check_pool_memory(first.manifest, pool_size)
            if threads is None and first.backend == "ort-cpu":
                threads = max(1, (os.cpu_count() or 1) - pool_size + 1)
                first = LoadedExport(export_dir, backend=first.backend, threads=threads, verify_checksums=False)
            exports = [first] + [first.sibling() for _ in range(pool_size - 1)]  # weights shared, KV per instance
        first = exports[0]
        unavailable: dict[str, str] = {}
        for export in exports:
            export.decoder("target")
            if warmup:
                for name in list(first.methods):
                    if name in unavailable:
                        continue
                    try:  # the graphs the method can call, and its drafter's
                        export.warm_up(name)
                    except SpecDeployError as exc:  # serve the other methods; say why this one is missing
                        unavailable[name] = str(exc)
                        log.warning("method %r is not available: %s", name, exc)
        return cls(pool_type(exports, queue_size, queue_timeout), AUTO if method is None else method, unavailable)

    # -- shutdown -----------------------------------------------------------------
    def close(self, timeout: float | None = 30.0) -> bool:
        """Stop serving: start no new request (PoolClosed), end those waiting in the queue (their start()
        returns False), cancel those running, and wait up to `timeout` seconds (None: for good) for
        every instance to come back. True when all did: then no thread of this service is inside ONNX
        Runtime, nor will one enter it, and the process may exit (an interpreter that finalizes while
        a thread is inside a `run` aborts when that thread returns: pybind11 takes the GIL back, Python
        ends the thread with pthread_exit, whose unwinding through C++ calls std::terminate).
        Safe to call more than once, from any thread."""
        if timeout is not None:  # checked before anything closes: a bad call must not half-close the service
            timeout = check_wait(timeout, "timeout")
        self.pool.close()
        with self._running_lock:
            running = list(self._running)
        for req in running:
            req.cancel()
        return self.pool.wait_idle(timeout)

    # -- introspection ------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.meta.tokenizer

    @property
    def max_context(self) -> int:
        return self.meta.manifest.max_context

    def status(self) -> dict:
        return {"pool_size": self.pool.size, "in_use": self.pool.in_use, "waiting": self.pool.waiting,
                "queue_size": self.pool.queue_size, "queue_timeout_s": self.pool.queue_timeout,
                "methods": list(self.methods), "default_method": self.default_method}

    # -- requests -----------------------------------------------------------------
    def request(self, prompt: str | None = None, prompt_ids: list[int] | None = None, *, method: str | None = None,
                max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                seed: int | None = None, stop: list[str] | str | None = None, ignore_eos: bool = False,
                timeout: float | None = None, request_id: str | None = None,
                sampling: str | None = None, logprobs: int | None = None, repetition_penalty: float = 1.0,
                frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                logit_bias: dict[int, float] | None = None, prompt_logprobs: bool = False,
                min_p: float = 0.0) -> "Request":
        """A validated request that has not started yet (SpecDeployError on bad input).

        `request_id` names it in logs and thread names (default: a random id). `sampling`
        ("seeded" or "rejection") picks how drafts are accepted when sampling; None: seeded when a seed is
        given, else the method's default.
        `logprobs` N (0-20): each token's log probability and its N likeliest alternatives'
        (TokenEvent.logprobs, GenerationResult.logprobs; runtime/logprobs.py); None: none. `prompt_logprobs`:
        the same for the prompt's tokens after the first (Request.prompt_logprobs, once prefilled).
        `repetition_penalty` (HF's), `frequency_penalty`, `presence_penalty` and `logit_bias` ({token id: bias},
        OpenAI's): runtime/penalties.py. `min_p` (HF's, after temperature, top-k and top-p): runtime/sampling.py.
        """
        if (prompt is None) == (prompt_ids is None):
            raise SpecDeployError("give exactly one of prompt (text) or prompt_ids")
        if prompt is not None and not isinstance(prompt, str):
            raise SpecDeployError(f"prompt must be a string, got {type(prompt).__name__}")
        ids = self.tokenizer.encode(prompt) if prompt is not None else checked_ids(prompt_ids)
        # Checked before queueing: a bad timeout raised inside the pool's wait would strand its queue ticket.
        if timeout is not None:
            timeout = check_wait(timeout, "timeout")
        ignore_eos = checked_flag(ignore_eos, "ignore_eos")
        logprobs = checked_top(logprobs)
        prompt_logprobs = checked_flag(prompt_logprobs, "prompt_logprobs")
        if request_id is not None and not isinstance(request_id, str):
            raise SpecDeployError(f"request_id must be a string, got {type(request_id).__name__}")
        method = self.resolve(method)
        if method not in self.methods:
            raise SpecDeployError(self.method_message(method))
        params = SamplingParams(temperature, top_k, top_p, seed, sampling, min_p)
        penalties = Penalties(repetition_penalty, frequency_penalty, presence_penalty, _bias_items(logit_bias))
        max_new_tokens = validate_request(self.meta, ids, max_new_tokens, prompt_logprobs)
        penalties.check_vocab(self.meta.manifest.models["target"].vocab_size)
        return Request(self, ids, method, params, max_new_tokens, checked_stop(stop), ignore_eos, timeout, request_id,
                       logprobs, penalties if penalties.active else None, prompt_logprobs)

    def stream(self, prompt: str | None = None, prompt_ids: list[int] | None = None, **options) -> "Request":
        """A started request: it holds an instance until iterated to the end, cancelled or closed."""
        req = self.request(prompt, prompt_ids, **options)
        req.start()
        return req

    def generate(self, prompt: str | None = None, prompt_ids: list[int] | None = None, **options) -> GenerationResult:
        with self.stream(prompt, prompt_ids, **options) as req:
            return req.result()

    def resolve(self, method: str | None) -> str:
        """The method a request naming `method` runs: the default for None, the recommended one for "auto"."""
        return self.default_method if method is None else resolve_method(method, self.meta, self.methods)

    def method_message(self, method: str) -> str:
        """Why `method` cannot be used here (for error messages)."""
        if method in self.unavailable:
            return f"method {method!r} is not available: {self.unavailable[method]}"
        return f"method {method!r} is not served by this export (available: {', '.join(self.methods)})"


def _bias_items(bias) -> tuple:
    """logit_bias as Penalties takes it: a mapping's items (Penalties checks them), or what was given."""
    if bias is None:
        return ()
    return tuple(bias.items()) if isinstance(bias, Mapping) else bias


def check_pool_memory(manifest, instances: int) -> None:
    """Each instance holds every model's KV cache of max_context positions: a pool whose caches could
    not all be resident is refused before any is made (a pool of 100,000 micro instances was still
    being built after 40 s)."""
    each = sum(cache_bytes(m, manifest.max_context, manifest.dtype) for m in manifest.models.values())
    require_memory(instances * each, f"a pool of {instances} instances ({manifest.max_context} positions each)",
                   "use a smaller pool")


# Started requests collected unread (Request.__del__), closed by one daemon thread: SimpleQueue.put
# is safe in a finalizer, where taking the pool's lock is not.
_DROPPED: queue.SimpleQueue = queue.SimpleQueue()
_reaper_lock = threading.Lock()
_reaper: threading.Thread | None = None


def _reap() -> None:
    while True:
        request = _DROPPED.get()
        try:
            request.close()
        except Exception:  # one bad close must not stop the reaper
            log.exception("closing a dropped request failed")
        del request


def _start_reaper() -> None:
    global _reaper
    with _reaper_lock:
        if _reaper is None:
            _reaper = threading.Thread(target=_reap, name="specdeploy-reaper", daemon=True)
            _reaper.start()


class Request:
    """One request: start() waits for an instance; iterate for TokenEvents; cancel() from any thread."""

    def __init__(self, service: Service, prompt_ids: list[int], method: str, params: SamplingParams,
                 max_new_tokens: int, stop: list[str], ignore_eos: bool, timeout: float | None,
                 request_id: str | None = None, logprobs: int | None = None, penalties: Penalties | None = None,
                 prompt_logprobs: bool = False):
        self.id = request_id or uuid.uuid4().hex
        self.service, self.prompt_ids, self.method = service, prompt_ids, method
        self.params, self.max_new_tokens, self.stop, self.ignore_eos = params, max_new_tokens, stop, ignore_eos
        self.timeout, self.top_logprobs, self.penalties = timeout, logprobs, penalties
        self.with_prompt_logprobs = prompt_logprobs
        self._ticket = Ticket()
        self._lock = threading.Lock()
        self._export = None
        self._gen: Generation | None = None
        self._started = False
        self._in_step = False
        self._cancelled = False
        self.error: BaseException | None = None  # what stopped a started request that failed
        self._created = time.perf_counter()
        self.queue_s = 0.0
        self._stats: dict = {}
        self._read = 0  # 0: not read yet, 1: an iterator is reading it, 2: read (to its end, or stopped)

    # -- lifecycle ----------------------------------------------------------------
    def start(self) -> bool:
        """Wait for an instance (BusyError past capacity); False if the request was cancelled meanwhile."""
        if self._started:
            return self._gen is not None
        self._started = True
        _start_reaper()
        export = self.service.pool.acquire(self.timeout, self._ticket)
        self.queue_s = time.perf_counter() - self._created
        if export is None:
            return False
        with self._lock:
            self._export = export
            with self.service._running_lock:
                self.service._running.add(self)
            if self._cancelled:
                self._release()
                return False
            try:
                options = export.generation_options(self.method) if hasattr(export, "generation_options") else {}
                self._gen = Generation(export, self.prompt_ids, method=self.method, params=self.params,
                                       max_new_tokens=self.max_new_tokens, stop=self.stop, ignore_eos=self.ignore_eos,
                                       logprobs=self.top_logprobs, penalties=self.penalties,
                                       prompt_logprobs=self.with_prompt_logprobs, **options)
            except BaseException as exc:
                self.error = exc
                self._release()
                raise
        return True

    def __iter__(self):
        if self._read == 1:  # a second reader would restart the generation over the first's cache
            raise SpecDeployError(f"request {self.id} is already being read: iterate it once")
        if self._read == 2 or not self.start():
            return
        self._read = 1
        steps = iter(self._gen)
        try:
            while True:
                with self._lock:
                    if self._export is None:  # closed between steps: never touch a returned instance
                        return
                    self._in_step = True
                try:
                    event = next(steps)
                except StopIteration:
                    return
                except BaseException as exc:
                    self.error = exc
                    raise
                finally:
                    self._in_step = False
                yield event
        finally:
            self._read = 2
            with self._lock:
                self._release()

    def cancel(self) -> None:
        """Stop at the next step (or leave the queue); the instance returns to the pool."""
        with self._lock:
            self._cancelled = True
            if self._gen is not None:
                self._gen.cancel()
        self.service.pool.withdraw(self._ticket)

    def close(self) -> None:
        """Cancel and free the instance: now if no step is running, else when that step ends."""
        self.cancel()
        with self._lock:
            if not self._in_step:
                self._release()

    def __enter__(self) -> "Request":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # A started request dropped unread (its handler raised before reading it) must not hold its
        # instance or batch row for good: collected, it is closed, by the reaper thread (a collection
        # can run in a thread that holds the pool's lock, which close() takes).
        if getattr(self, "_export", None) is not None:
            _DROPPED.put(self)

    def _release(self) -> None:  # caller holds self._lock
        if self._export is not None:
            self._stats = self._collect_stats()
            with self.service._running_lock:
                self.service._running.discard(self)
            self.service.pool.release(self._export)
            self._export = None

    # -- results ------------------------------------------------------------------
    def result(self) -> GenerationResult:
        for _ in self:
            pass
        return GenerationResult(self.text, self.token_ids, self.finish_reason, self.stats, self.logprobs,
                                self.prompt_logprobs)

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def text(self) -> str:
        return self._gen.text if self._gen is not None else ""

    @property
    def token_ids(self) -> list[int]:
        return list(self._gen.new_ids) if self._gen is not None else []

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """One per token id when the request asked for logprobs, else None."""
        if self.top_logprobs is None:
            return None
        return list(self._gen.logprobs or []) if self._gen is not None else []

    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """One per prompt token (the first None) when asked for, once the prompt is prefilled; else None."""
        return self._gen.scored_prompt() if self.with_prompt_logprobs and self._gen is not None else None

    @property
    def finish_reason(self) -> str:
        if self.error is not None:
            return "error"
        if self._gen is not None and self._gen.finish_reason is not None:
            return self._gen.finish_reason
        return "cancelled" if self._cancelled else "length"

    @property
    def stats(self) -> dict:
        """Per-request numbers: the generation's stats plus queue wait and end-to-end time."""
        return dict(self._stats) if self._stats else self._collect_stats()

    def _collect_stats(self) -> dict:
        stats: dict[str, Any] = {"method": self.method}
        if self._gen is not None:
            stats.update(self._gen.stats, new_tokens=len(self._gen.new_ids))
        stats.update(queue_s=self.queue_s, total_s=time.perf_counter() - self._created,
                     prompt_tokens=len(self.prompt_ids), finish_reason=self.finish_reason)
        return stats

