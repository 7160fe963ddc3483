"""Back-pressure before any expensive work: a bounded count of generation requests in flight.

A generation request is admitted on arrival, before its body is read, parsed, rendered
through the chat template or tokenized, and counts until its response ends. Past the limit
it is refused with 429 at once. A request of several generations (`n`, `best_of`) holds a place
for each once its body says how many (`Admitted.widen`). Lives on the event loop only, so no lock.
"""

from __future__ import annotations


class Admission:
    def __init__(self, limit: int):
        self.limit = limit
        self.active = 0

    def enter(self) -> "Admitted | None":
        if self.active >= self.limit:
            return None
        self.active += 1
        return Admitted(self)


class Admitted:
    """One admitted request; release() is idempotent (the response's end and error paths both call it)."""

    __slots__ = ("_admission", "_places")

    def __init__(self, admission: Admission):
        self._admission = admission
        self._places = 1

    def widen(self, extra: int) -> bool:
        """Hold `extra` more places (the request's other generations); False, holding no more, if they are not free."""
        admission = self._admission
        if admission is None or admission.active + extra > admission.limit:
            return False
        admission.active += extra
        self._places += extra
        return True

    def release(self) -> None:
        if self._admission is not None:
            self._admission.active -= self._places
            self._admission = None
