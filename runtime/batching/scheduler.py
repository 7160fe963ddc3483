"""The batch scheduler: one thread runs the target calls of the batch's rows (a row alone runs
its own, on its thread).

Each row (a request's generation on its own thread, runtime/generate.py) submits its target
calls here and waits. A step of the scheduler gathers what the rows have submitted, waiting
a short window for rows still busy with their host work (verification, sampling, streaming),
then runs them as one call of the batched graph (graph.py): every row that asked for a plain
decode step as a decode row (slots in the range that did not ask take no token's cost, and
little attention: `Batcher._gap_pasts`), and every call of several tokens (a speculative step, a
prefill chunk) as a run, up to the graph's runs per call (more take further calls). At most
one prefill chunk joins a step while other rows decode, so a long prompt delays running rows
by one chunk per step (with no row decoding, one chunk of every row that is prefilling).

Speculative steps take seats (`take_seat`), one per run of the graph, so speculation alone
never needs a second call (a prefill chunk beside a full set of seats does). Rows join and
leave between steps: a row is part of whichever step its call reaches.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .gate import SpeculationGate
from .graph import BatchedGraph, Run
from .kv_slots import SlotKV

# A step waits for rows still busy with host work at most this fraction of the last step's time
# (and at most GATHER_MAX_S): a row that misses a step waits a whole step, and steps of a few rows
# each cost nearly what one of all rows does (16 rows of SmolLM2: 47 steps for 32 tokens when the
# wait was capped at 5 ms, 33 with this cap).
GATHER_FRACTION = 0.3
GATHER_MAX_S = 0.25
# The past a calibration call's rows attend to (a short prompt and some tokens): the trash row's
# whole context would make every decode row look as dear as a long one.
CALIBRATION_PAST = 64


@dataclass(eq=False)  # compared by identity: one pending call per row
class Work:
    slot: int
    ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    mask: np.ndarray  # [T, T]
    past: int
    prefill: bool = False
    logit_rows: np.ndarray | None = None  # the rows (0..T-1) whose logits the row reads; None: all
    done: threading.Event = field(default_factory=threading.Event)
    logits: np.ndarray | None = None  # [T, vocab], or [len(logit_rows), vocab]
    hidden: np.ndarray | None = None
    error: BaseException | None = None

    @property
    def tokens(self) -> int:
        return len(self.ids)


class Batcher:
    def __init__(self, graph: BatchedGraph, kv: SlotKV):
        self.graph, self.kv = graph, kv
        self._cond = threading.Condition()
        self._pending: list[Work] = []
        self._active: set[int] = set()  # slots with a request in progress
        self._waiting: dict[int, Work] = {}  # slots whose row waits on a call (submitted, not done)
        self._last_step_s = 0.0
        self.steps = 0
        self.observers: list = []  # callables (tokens computed, seconds, runs used, lone=) after each call
        self.gate: SpeculationGate | None = None  # told each call's works (gate.py)
        self.lone_calls = graph.has_lone_row  # a row alone runs the graph's lone-row branch
        self._seats: set[int] = set()  # slots whose next call is a speculative step
        self.seats = graph.runs
        self._closed = False
        self._running = False  # a step is running (on the scheduler's thread or a lone row's)
        self._thread = threading.Thread(target=self._loop, name="specdeploy-batcher", daemon=True)
        self._thread.start()

    # -- rows ---------------------------------------------------------------------
    def join(self, slot: int) -> None:
        with self._cond:
            self._active.add(slot)

    def leave(self, slot: int) -> None:
        with self._cond:
            self._active.discard(slot)
            self._seats.discard(slot)
            self._cond.notify_all()  # the step may stop waiting for this row

    def take_seat(self, slot: int) -> bool:
        """Whether `slot`'s next call may be a speculative step (a seat, freed when the call is done)."""
        with self._cond:
            if slot in self._seats or len(self._seats) < self.seats:
                self._seats.add(slot)
                return True
            return False

    @property
    def active(self) -> int:
        return len(self._active)

    def submit(self, work: Work) -> Work:
        """Queue one call and wait for it; raises what the call raised. A row alone runs its call
        on its own thread (no hand-off to the scheduler's and back: two thread wake-ups a step)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the batch scheduler is closed")
            direct = not self._running and not self._pending and len(self._active) <= 1
            self._waiting[work.slot] = work
            if direct:
                self._running = True
            else:
                self._pending.append(work)
                self._cond.notify_all()
        if direct:
            try:
                self._step([work])
            finally:
                with self._cond:
                    self._running = False
                    self._cond.notify_all()
        work.done.wait()
        if work.error is not None:
            raise work.error
        return work

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    # -- the loop -----------------------------------------------------------------
    def _gather(self) -> list[Work] | None:
        with self._cond:
            while (not self._pending or self._running) and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            deadline = time.perf_counter() + min(GATHER_MAX_S, GATHER_FRACTION * self._last_step_s)
            while len({w.slot for w in self._pending}) < len(self._active) and not self._closed:
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                self._cond.wait(left)
            # one prefill chunk per step while other rows decode; with none decoding, every row's
            # pending chunk (nobody waits on them)
            decoding = any(not w.prefill for w in self._pending)
            taken, prefills = [], 0
            for w in self._pending:
                if w.prefill:
                    if prefills and decoding:
                        continue
                    prefills += 1
                taken.append(w)
            self._pending = [w for w in self._pending if w not in taken]
            self._running = True
            return taken

    def _loop(self) -> None:
        while True:
            work = self._gather()
            if work is None:
                return
            try:
                self._step(work)
            finally:
                with self._cond:
                    self._running = False
                    self._cond.notify_all()

    def _step(self, work: list[Work]) -> None:
        start = time.perf_counter()
        decodes = [w for w in work if w.tokens == 1 and not w.prefill]
        runs = [w for w in work if w.tokens > 1 or w.prefill]
        per_call = self.graph.runs
        self._run(decodes, runs[:per_call])
        for i in range(per_call, len(runs), per_call):
            self._run([], runs[i : i + per_call])
        self._last_step_s = time.perf_counter() - start
        self.steps += 1

    def _run(self, decodes: list[Work], runs: list[Work]) -> float:
        start = time.perf_counter()
        work = decodes + runs
        tokens = sum(w.tokens for w in work)
        try:
            tokens = self._call(decodes, runs)
        except BaseException as exc:  # the rows' threads raise it
            for w in work:
                w.error = exc
        seconds = time.perf_counter() - start
        lone = self.lone_calls and len(work) == 1
        for observe in self.observers:
            observe(tokens, seconds, len(runs), lone=lone)
        if self.gate is not None:
            with self._cond:
                requests = len(self._active)
            self.gate.on_call(decodes, runs, seconds, requests)
        with self._cond:
            self._seats.difference_update(w.slot for w in work)
            for w in work:  # before its row wakes: from then on the row may be committing
                if self._waiting.get(w.slot) is w:
                    del self._waiting[w.slot]
        for w in work:
            w.done.set()
        return seconds

    def time_call(self, rows: int, tokens: int = 0) -> float:
        """Seconds of one placeholder call: `rows` decode rows, and a run of `tokens` tokens
        (0: none; with no decode row, a lone row's call), each at a past of CALIBRATION_PAST
        rows; for start-up only (it writes scratch rows of empty slots)."""
        past = min(CALIBRATION_PAST, self.kv.max_context - tokens - 1)
        decodes = [Work(s, np.zeros(1, np.int64), np.full(1, past), np.ones((1, 1), bool), past) for s in range(rows)]
        runs = [Work(rows % self.kv.slots, np.zeros(tokens, np.int64), past + np.arange(tokens),
                     np.tril(np.ones((tokens, tokens), bool)), past)]
        return self._run(decodes, runs if tokens else [])

    def _gap_pasts(self, lo: int, hi: int, runs: list[Work]) -> list[int | tuple[int, int, int]]:
        """Per slot lo..hi-1, the past at which it writes its token and up to which its attention
        reads should it take no part in the call (its output is dropped). The trash row's past
        costs attention over the whole context (SmolLM2, 4 decode rows with one such gap 78.5 ms
        vs 70.8 without; rows at slots 0, 5, 10, 15: 154 vs 79 at slots 0-3), so where nothing
        else touches the slot meanwhile it writes lower: a row waiting on a call writes nothing
        before it, and that call overwrites from its past on (a run in this one: the row just
        past its tokens is scratch); a slot no request holds is nobody's (a request that joins
        meanwhile writes its prompt in a later call). A row busy between its calls may be moving
        its accepted rows (commit): only the trash row is safe there."""
        with self._cond:
            active, waiting = set(self._active), dict(self._waiting)
        ends = {w.slot: w.past + w.tokens for w in runs}
        trash = self.kv.trash

        def past(slot: int) -> int:
            if slot in ends:
                return ends[slot] if ends[slot] < self.kv.max_context else trash
            if slot in waiting:
                return waiting[slot].past
            return trash if slot in active else 0

        return [past(s) for s in range(lo, hi)]

    def _call(self, decodes: list[Work], runs: list[Work]) -> int:
        """One call of the batched graph: `decodes` as decode rows over their slot range (slots in
        between take no part: `_gap_pasts`), `runs` as runs; returns the tokens it computed."""
        rows: list[tuple[int, int, int] | int] = []
        views = None
        decodes = sorted(decodes, key=lambda w: w.slot)  # the graph returns decode tokens in slot order
        if decodes:
            lo, hi = decodes[0].slot, decodes[-1].slot + 1
            rows = self._gap_pasts(lo, hi, runs) if hi - lo > len(decodes) else [self.kv.trash] * (hi - lo)
            for w in decodes:
                rows[w.slot - lo] = (int(w.ids[0]), int(w.positions[0]), w.past)
            views = self.kv.views(lo, hi)
        logits, hidden = self.graph.run(rows, views, [Run(w.ids, w.positions, w.mask, w.past,
                                                          self.kv.views(w.slot, w.slot + 1), w.logit_rows)
                                                      for w in runs])
        for at, w in enumerate(decodes):
            w.logits, w.hidden = logits[at : at + 1], hidden[at : at + 1]
        at = scored = len(decodes)
        for w in runs:
            m = w.tokens if w.logit_rows is None else len(w.logit_rows)
            w.logits, w.hidden = logits[scored : scored + m], hidden[at : at + w.tokens]
            at += w.tokens
            scored += m
        return at
