"""Whether the batch speculates at all: the batch's throughput measured both ways.

The row policy (policy.py) prices a row's drafts by a model of the target call's cost. What the
model cannot see is what a speculative step costs the batch outside the call: the rows' host
work between calls (drafting, verifying a tree, sampling several rows), which the scheduler
waits for, and the cores it takes from the call on a shared machine. Through the server, prompt
lookup's rows at 1.1-1.2 tokens per call ran at 0.86-1.07x plain batching from run to run (4 and
16 clients), while the model said each draft paid.

So the gate measures it. The scheduler's calls are grouped into epochs of EPOCH_CALLS. In an
epoch rows either speculate (as the row policy says) or all decode plainly. An epoch's rate is
the tokens its rows committed per second, per request in the batch (a slot held: so an epoch
with more requests running is not faster for it). Not per row in a call: a row busy drafting
misses calls, so a speculating epoch's calls hold fewer rows than its requests, and per row in a
call it looked faster than it was (SmolLM2 `auto`, 4 clients through the server: the gate read
speculation 1.23x plain per row in a call while the batch ran 0.93x plain batching's throughput).
Two neighbouring epochs, one each way, with about as many requests, give one sample of
log(speculating / plain), averaged per batch size bucket (requests' bit length: 1, 2-3, 4-7,
8-15, 16-31 ...). Each bucket runs the winning mode, and the other one now and then,
so a change of workload is seen: an epoch of the losing mode costs what it loses against the
winner, so it runs once in as many epochs as keep that cost under EXPLORE_COST of the bucket's
throughput (`explore_every`: 1 in 5 when the modes are close, up to 1 in 20 when one is far
behind). Until a bucket has FIRST_PAIRS samples the modes alternate. A row alone keeps the row
policy (its batch-1 rule measures its own calls).

What it resolves: run as an A/A control (both modes plain), its ratios read 0.96-1.04 at 4-15
rows of SmolLM2, so it separates the two ways when they differ by more than about 5%; through
the server, gated and ungated batching were within noise of each other (16 clients: +8% in one
run, -2% in another).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

EPOCH_CALLS = 6  # calls of the batched graph per epoch (16 rows of SmolLM2: about a second)
FIRST_PAIRS = 2  # samples a bucket takes alternating, before it picks a mode
# The losing mode's share of a bucket's epochs, once picked: 1 in explore_every(). At 1 in 5 always,
# exploring cost 4% where speculation ran 0.81x plain (64 clients through the server) and 5-7%
# where it ran 1.3-1.5x (2-4 clients).
EXPLORE_EVERY, MAX_EXPLORE_EVERY = 5, 20
EXPLORE_COST = 0.01  # the share of throughput exploring may cost, where MAX_EXPLORE_EVERY allows
WEIGHT = 0.3  # the newest sample's weight in a bucket's average log ratio
LOG_CLIP = 0.7  # a sample's log ratio is clipped to +-this (2x): one odd epoch moves the average little
# A gap between two calls longer than this (and than IDLE_CALLS calls) is the server idling between
# requests, not rows' host work: the epoch counts the call's own time for it.
IDLE_S, IDLE_CALLS = 1.0, 5


@dataclass
class _Epoch:
    speculate: bool
    seconds: float = 0.0  # from the previous call's end to each of its calls' ends, idle gaps excluded
    calls: int = 0
    requests: int = 0  # requests in the batch (slots held) at its calls, summed over its calls
    tokens: int = 0  # committed by those rows: 1 per plain row, a speculative row's path as reported


@dataclass
class _Bucket:
    log_ratio: float = 0.0  # average log(speculating rate / plain rate)
    pairs: int = 0
    rates: dict[bool, tuple[int, float]] = field(default_factory=dict)  # mode -> (epoch number, rate)
    since_explore: int = 0


def explore_every(log_ratio: float) -> int:
    """Epochs per epoch of the losing mode, for a bucket whose modes' rates differ by `log_ratio`:
    such an epoch makes 1 - exp(-|log_ratio|) fewer tokens than the winner's would."""
    loss = 1.0 - math.exp(-abs(log_ratio))
    return min(MAX_EXPLORE_EVERY, max(EXPLORE_EVERY, math.ceil(loss / EXPLORE_COST)))


class SpeculationGate:
    def __init__(self, clock=time.perf_counter) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._number = 0  # the running epoch
        self._epochs: dict[int, _Epoch] = {0: _Epoch(True)}
        self._last_end: float | None = None  # the previous call's end
        self._runs: dict[int, int] = {}  # slot -> epoch of its speculative call, until it reports
        self._buckets: dict[int, _Bucket] = {}
        self._last_requests = 0

    @property
    def speculate(self) -> bool:
        """Whether rows may speculate in the running epoch."""
        with self._lock:
            return self._epochs[self._number].speculate or self._last_requests < 2

    # -- from the scheduler's thread, after each call ------------------------------
    def on_call(self, decodes: list, runs: list, seconds: float, requests: int) -> None:
        """A call's works (the scheduler's `Work`s) and its `seconds`, with `requests` in the batch (slots
        held, whether or not their rows are in this call): a decode row commits one token; a run that is
        not a prefill chunk is a speculative step, its tokens reported by its row (`committed`)."""
        with self._lock:
            now = self._clock()
            gap = seconds if self._last_end is None else now - self._last_end
            self._last_end = now
            epoch = self._epochs[self._number]
            epoch.seconds += seconds if gap > max(IDLE_S, IDLE_CALLS * seconds) else gap
            epoch.calls += 1
            steps = [w for w in runs if not w.prefill]
            epoch.requests += requests
            epoch.tokens += len(decodes)
            for w in steps:
                self._runs[w.slot] = self._number
            self._last_requests = requests
            if epoch.calls >= EPOCH_CALLS:
                self._next_epoch()

    def committed(self, slot: int, tokens: int) -> None:
        """A row's speculative step committed `tokens` (from its thread, after the call)."""
        with self._lock:
            number = self._runs.pop(slot, None)
            if number is not None and number in self._epochs:
                self._epochs[number].tokens += tokens

    # -- epochs ------------------------------------------------------------------------
    def _next_epoch(self) -> None:
        # the epoch before the one ending is complete now (its rows reported before calling again)
        done = self._epochs.pop(self._number - 1, None)
        if done is not None:
            self._measure(self._number - 1, done)
        mode = self._choose(self._bucket_of(self._epochs[self._number]), self._epochs[self._number].speculate)
        self._number += 1
        self._epochs[self._number] = _Epoch(mode)

    @staticmethod
    def _bucket_of(epoch: _Epoch) -> int:
        return int(round(epoch.requests / max(1, epoch.calls))).bit_length()

    def _measure(self, number: int, epoch: _Epoch) -> None:
        requests = epoch.requests / max(1, epoch.calls)
        seconds = epoch.seconds
        if requests < 2 or seconds <= 0 or not epoch.tokens:
            return
        bucket = self._buckets.setdefault(self._bucket_of(epoch), _Bucket())
        rate = epoch.tokens / seconds / requests
        other = bucket.rates.get(not epoch.speculate)
        bucket.rates[epoch.speculate] = (number, rate)
        if other is not None and other[0] == number - 1:  # neighbours: one sample
            spec, plain = (rate, other[1]) if epoch.speculate else (other[1], rate)
            sample = max(-LOG_CLIP, min(LOG_CLIP, math.log(spec / plain)))
            bucket.log_ratio = sample if not bucket.pairs else (1 - WEIGHT) * bucket.log_ratio + WEIGHT * sample
            bucket.pairs += 1

    def _choose(self, key: int, current: bool) -> bool:
        """The next epoch's mode: the bucket's winner, or the other one now and then (alternating
        until the bucket has its first samples). Epochs are measured one late, so the first
        alternation runs a few epochs more than FIRST_PAIRS pairs."""
        bucket = self._buckets.get(key)
        if bucket is None or bucket.pairs < FIRST_PAIRS:
            return not current
        winner = bucket.log_ratio > 0
        bucket.since_explore += 1
        if bucket.since_explore >= explore_every(bucket.log_ratio):
            bucket.since_explore = 0
            return not winner
        return winner

    def state(self) -> dict:
        """Per bucket (requests' bit length): the average speculating / plain rate ratio and its samples."""
        with self._lock:
            return {key: {"ratio": round(math.exp(b.log_ratio), 3), "pairs": b.pairs}
                    for key, b in sorted(self._buckets.items())}
