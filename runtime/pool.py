"""A fixed set of Export instances lent out one request at a time, with a bounded FIFO wait queue.

Why a pool of whole instances rather than one shared session with a batching scheduler:

* Memory: the instances share what does not change per request: the loaded manifest,
  tokenizer and configs (`LoadedExport.sibling`) and every ONNX Runtime session, hence the
  weights (runtime/backends/sessions.py: one session per graph and process, concurrent
  `run` calls each with its own IO binding). An instance owns only its KV caches (N
  instances: N caches of `max_context` rows) and its bindings. A single-session scheduler
  could also batch requests for better accelerator utilisation.
* But the exported graphs are batch-1 and static-shape, and speculative steps differ per
  request (each request has its own tree, acceptance length and cache length), so batching
  would need batch-dimension graphs, ragged/paged KV and per-request tree masks — a
  different export. With batch-1 graphs the pool is what gives concurrency: ORT releases
  the GIL in `run`, so N requests really run in parallel, each isolated in its own state
  (no locking inside the decode loop, a fault in one request cannot corrupt another).

Admission is bounded on both sides: at most `size` requests run, at most `queue_size` wait
(FIFO, each for at most `queue_timeout` seconds); anything beyond gets BusyError at once.
"""

from __future__ import annotations

import numbers
import threading
import time
from collections import deque

from .errors import SpecDeployError


class BusyError(SpecDeployError):
    """Every instance is busy and the wait queue is full, or the wait timed out (HTTP 429)."""


class PoolClosed(SpecDeployError):
    """The pool was closed (the service is shutting down): no new request gets an instance."""


class Ticket:
    """One waiter's place in the queue; `ExportPool.withdraw(ticket)` gives it up from any thread."""

    __slots__ = ("event", "export", "withdrawn")

    def __init__(self):
        self.event = threading.Event()
        self.export = None
        self.withdrawn = False


def check_wait(seconds, what: str) -> float:
    """Seconds a queue wait may take, as threading's waits accept them (past TIMEOUT_MAX, about 292
    years, Event.wait raised OverflowError inside the wait: `inf` too), or one clear error."""
    if (isinstance(seconds, bool) or not isinstance(seconds, numbers.Real)
            or not 0 <= float(seconds) <= threading.TIMEOUT_MAX):
        raise SpecDeployError(f"{what} must be a number of seconds from 0 to {threading.TIMEOUT_MAX:.0f}, "
                              f"got {seconds!r}")
    return float(seconds)


class ExportPool:
    def __init__(self, exports: list, queue_size: int = 0, queue_timeout: float = 30.0):
        if not exports:
            raise SpecDeployError("an export pool needs at least one instance")
        if isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size < 0:
            raise SpecDeployError(f"queue size must be an integer >= 0, got {queue_size!r}")
        self.queue_timeout = check_wait(queue_timeout, "queue timeout")
        self.exports = list(exports)
        self.queue_size = queue_size
        self._free = list(exports)  # a stack: the most recently used instance is reused first (warm caches)
        self._leased: set[int] = set()
        self._waiters: deque[Ticket] = deque()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when the last leased instance comes back
        self.closed = False

    @property
    def size(self) -> int:
        return len(self.exports)

    @property
    def in_use(self) -> int:
        return len(self._leased)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def saturated(self) -> bool:
        """True when a new acquire would be refused right now (a cheap pre-check, not a promise)."""
        return not self._free and len(self._waiters) >= self.queue_size

    def acquire(self, timeout: float | None = None, ticket: Ticket | None = None):
        """An instance, waiting in FIFO order up to `timeout` (default: the pool's queue timeout).

        Returns None if the ticket was withdrawn while waiting; raises BusyError when the
        queue is full or the wait timed out.
        """
        timeout = self.queue_timeout if timeout is None else timeout
        ticket = ticket or Ticket()
        with self._lock:
            if ticket.withdrawn:
                return None
            if self.closed:
                raise PoolClosed("the service is shutting down: it starts no new requests")
            if self._free and not self._waiters:
                return self._lease(self._free.pop())
            if len(self._waiters) >= self.queue_size:
                raise BusyError(
                    f"server busy: all {self.size} workers are in use and the wait queue "
                    f"({self.queue_size}) is full; retry later"
                )
            self._waiters.append(ticket)
        start = time.monotonic()
        try:
            ticket.event.wait(timeout)
        except BaseException:  # a Ctrl-C while waiting: a ticket left queued would take the next free instance
            self.withdraw(ticket)
            if ticket.export is not None:  # handed over just before: give it back
                self.release(ticket.export)
            raise
        with self._lock:
            if ticket.export is not None:  # handed over (possibly just as the wait timed out)
                return ticket.export
            if ticket.withdrawn:
                return None
            self._waiters.remove(ticket)
        raise BusyError(f"server busy: no worker became free within {time.monotonic() - start:.1f} s; retry later")

    def withdraw(self, ticket: Ticket) -> None:
        """Give up waiting (a cancelled request); a no-op if the ticket already got its instance."""
        with self._lock:
            ticket.withdrawn = True
            if ticket in self._waiters:
                self._waiters.remove(ticket)
                ticket.event.set()

    def release(self, export) -> None:
        """Return an instance: straight to the longest waiter if there is one (no barging)."""
        with self._lock:
            if id(export) not in self._leased:
                raise ValueError("releasing an export that is not leased from this pool")
            self._leased.discard(id(export))
            if self._waiters:
                ticket = self._waiters.popleft()
                ticket.export = self._lease(export)
                ticket.event.set()
            else:
                self._free.append(export)
                if not self._leased:
                    self._idle.notify_all()

    def close(self) -> None:
        """Lend no more instances: later acquires raise PoolClosed, waiters get None (as if withdrawn).
        Instances already lent stay with their requests until released (see wait_idle)."""
        with self._lock:
            self.closed = True
            while self._waiters:
                ticket = self._waiters.popleft()
                ticket.withdrawn = True
                ticket.event.set()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds (None: for good) until no instance is leased; True if none is."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._leased, timeout)

    def _lease(self, export):
        self._leased.add(id(export))
        return export
