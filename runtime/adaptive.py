"""Adaptive speculation: per step, speculate only while it beats plain decoding.

A speculative step pays for a draft and a wider verify call than a plain step (the
root alone, the T=1 graph). On a real model a wide verify costs well over a T=1 step,
so when few drafts are accepted, speculating is slower than plain decoding. The policy
compares the two kinds of step by their measured rates: tokens per second of
speculative steps (averages of the tokens a step yields and of its seconds) against one
token per plain step's seconds. Speculation breaks even at `spec_seconds / plain_seconds`
tokens per step.

- Speculating, it falls back to plain decoding once the tokens a step yields are below
  break-even by more than their standard error: tokens per step vary a lot from step
  to step, and a method that wins on average must not be switched off by an unlucky
  stretch.
- Plain, it probes speculation again after a backoff that doubles while probes lose
  (clearly: by more than the standard error) and resets when one wins (acceptance
  comes back, e.g. the answer starts copying the prompt); the backoff counts probe
  costs, so an expensive drafter is probed as rarely, in time, as a cheap one. A probe
  that lifts the average to break-even resumes.
- While speculation wins, a plain step is re-timed now and then, so a stale plain time
  cannot keep a losing method on.

The loop (runtime/generate.py) asks `speculate()` before the step drafts anything and
reports the finished step to `observe()`; a plain step verifies `Proposal.root_only`
and still calls the drafter's `update`, as near the context end. The decision depends
only on committed steps (their tokens and timings), never on the step's own random
draws, and either kind of step is lossless given the past: sampling stays exact.

What a loaded export measured (`Memory`) carries from request to request: both step
times, as a prior worth a few steps that the request's own steps soon outweigh, and
whether speculation was losing, so a method that kept losing starts the next request
plain instead of paying for speculative steps (and the drafter's catch-up on the prompt)
from its first step. Acceptance is each request's own (prompts differ): such a request
probes at its first drafting step and then on its own backoff, from the shortest. A
losing method pays a few probes per request (the backoff doubles to its cap in four);
carrying the backoff and its wait instead held a code request that copies plain for
its first ~35 steps after chat requests that copied nothing.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

# Weight of the newest step once an average has `1 / ALPHA` samples (before that, the plain
# mean): about the last ten steps decide, and a probe that copies a long span still lifts
# the average past break-even at once.
ALPHA = 0.1
PRIOR_WEIGHT = 2  # samples an earlier request's average counts for in a new request
MIN_SAMPLES = 3  # samples before an average's spread is known (one or two equal ones say nothing)
# Timing noise only slows steps down (another process, a cold cache): a step timed over STALL x
# the average counts as STALL x, and one under 1/STALL x shows the average holds stalls.
STALL = 2.0
MIN_BACKOFF = 2  # probe costs of plain decoding before the first probe after speculation lost
MAX_BACKOFF = 32  # cap of the doubling backoff; also how often a winning run re-times a plain step
MAX_CONFIGS = 64  # method configs a Memory keeps
ENV = "SPECDEPLOY_ADAPTIVE"  # "0": speculate every step unless a request asks otherwise (the global switch)


def on_by_default() -> bool:
    return os.environ.get(ENV, "1").strip() != "0"


@dataclass
class Average:
    """The mean of the first samples, then an exponential moving average (weight `alpha`),
    with the matching moving variance."""

    alpha: float = ALPHA
    value: float | None = None
    count: float = 0
    var: float = 0.0

    def _weight(self) -> float:
        return max(self.alpha, 1 / self.count) if self.count else 1.0

    def add(self, x: float, clip: float | None = None) -> None:
        """`clip` (times): a sample over clip x the average counts as clip x; one under 1/clip x
        restarts the average from it."""
        self.count += 1
        if self.value is None or clip is not None and x * clip < self.value:
            self.value, self.var = x, 0.0
            return
        if clip is not None:
            x = min(x, clip * self.value)
        w, d = self._weight(), x - self.value
        self.value += w * d
        self.var = (1 - w) * (self.var + w * d * d)

    @property
    def stderr(self) -> float:
        """Standard error of the average (sd * sqrt(weight): exact for a mean, conservative for the
        EMA); unknown (infinite) below MIN_SAMPLES samples."""
        return math.sqrt(self.var * self._weight()) if self.count >= MIN_SAMPLES else math.inf

    def prior(self) -> "Average":
        """This average as the start of a new one, worth PRIOR_WEIGHT samples."""
        return Average(self.alpha, self.value, min(self.count, PRIOR_WEIGHT), self.var)


@dataclass
class Speculated:
    """A method config's speculative steps (seconds, tokens) and whether its policy ended plain
    (a new request takes the seconds as a prior, starts its own tokens and, ended plain, probes
    first). The backoff is not carried: it says how clearly the last request lost (see `resume`)."""

    seconds: Average = field(default_factory=Average)
    tokens: Average = field(default_factory=Average)
    plain_mode: bool = False


@dataclass
class Memory:
    """What one loaded export measured, carried from request to request (an instance serves
    one request at a time): plain step seconds, and per method config (its repr) `Speculated`."""

    plain: Average = field(default_factory=Average)
    spec: dict[str, Speculated] = field(default_factory=dict)


class AdaptivePolicy:
    """Speculate or decode plainly, step by step (see the module docstring)."""

    def __init__(self, plain_seconds: Average | None = None, spec: Speculated | None = None,
                 min_backoff: int = MIN_BACKOFF, max_backoff: int = MAX_BACKOFF):
        spec = spec or Speculated()
        self.plain_seconds = plain_seconds or Average()
        self.spec_seconds, self.spec_tokens = spec.seconds, spec.tokens
        self.min_backoff, self.max_backoff = min_backoff, max_backoff
        self.backoff = min_backoff
        self.plain_mode = spec.plain_mode  # speculation was last found losing
        self.wait = 0  # plain steps left before the next probe (plain mode)
        self.since_plain = 0  # speculative steps since a plain step was last timed
        self.seen_spec = False
        self.after_plain = False  # the last step was plain: the next drafting step catches up on it
        self.start_probe = self.plain_mode  # the request's own probe (module docstring)
        self.warm_plain = self.plain_seconds.value is not None  # a fresh export's first plain step runs a cold graph

    # -- what the loop asks ------------------------------------------------------
    def speculate(self) -> bool:
        if self.spec_tokens.value is None or self.spec_seconds.value is None:
            return True  # learn what speculation yields first
        if self.plain_seconds.value is None:
            return False
        if self.plain_mode:
            return self.start_probe or self.wait <= 0  # a probe once the backoff ran out
        return self.since_plain < self.max_backoff  # else re-time a plain step

    def observe(self, speculated: bool, seconds: float, tokens: int) -> None:
        """One finished step: whether it verified drafts (more than the root: a drafter that
        proposed nothing made a plain step), its wall seconds (draft + verify + update) and
        the tokens it committed."""
        start_probe = speculated and self.start_probe
        if speculated:
            self.start_probe = False  # (a step that drafted nothing was no probe)
            self.spec_tokens.add(tokens)
            if self.seen_spec and not self.after_plain:
                self.spec_seconds.add(seconds, STALL)
            elif self.seen_spec and self.spec_seconds.value is not None:
                # a probe may lower the estimate, never raise it: one made high by early steps on
                # cold graphs (a fresh export's first calls of each size) must not keep a method
                # plain for the rest of the request, as nothing else would re-time it
                self.spec_seconds.add(min(seconds, self.spec_seconds.value))
            # else: a request's first drafting step also pays the drafter's catch-up on the
            # prompt (draft model prefill, EAGLE head) and, on a fresh export, cold graphs; the
            # first after plain steps (a probe) its catch-up on their tokens, one call over as many
            # rows as steps went plain (SmolLM2's int4 self-draft: a probe after 10 plain steps took
            # 2x a drafting step). Neither time is a full sample of a drafting step's: timed, probes
            # raised the break-even with the plain run before them and kept a winning method plain
            # (1.21x ar without the policy on chat, 0.99x with it).
            self.seen_spec = True
            self.after_plain = False
            self.since_plain += 1
        else:
            self.after_plain = True
            if self.warm_plain:
                self.plain_seconds.add(seconds, STALL)
            self.warm_plain = True
            self.since_plain = 0
            self.wait -= 1
        even = self.break_even()
        if even is None or self.spec_tokens.value is None:
            return
        if self.spec_tokens.value >= even:
            self.plain_mode, self.backoff = False, self.min_backoff
        elif self.plain_mode:
            if speculated and not start_probe:  # a probe lost: back off further only if speculation clearly loses
                self.wait = self._probe_wait()
                if self.loses():
                    self.backoff = min(2 * self.backoff, self.max_backoff)
        elif self.loses():
            self._fall_back()

    def break_even(self) -> float | None:
        """Tokens per speculative step at which speculating is as fast as plain decoding (None: not timed yet)."""
        if self.spec_seconds.value is None or self.plain_seconds.value is None:
            return None
        return self.spec_seconds.value / self.plain_seconds.value

    def loses(self) -> bool:
        """Speculative steps yield fewer tokens than break-even, by more than the average's standard error."""
        even = self.break_even()
        return even is not None and self.spec_tokens.value is not None and \
            self.spec_tokens.value + self.spec_tokens.stderr < even

    def _fall_back(self) -> None:
        self.plain_mode, self.wait = True, self._probe_wait()
        self.backoff = min(2 * self.backoff, self.max_backoff)
        # Acceptance changes while nothing speculates: the probes weigh in as a fresh mean (the
        # estimate so far counts as PRIOR_WEIGHT samples), so a run of probes settles it either way.
        self.spec_tokens.count = min(self.spec_tokens.count, PRIOR_WEIGHT)

    def _probe_wait(self) -> int:
        """Plain steps before the next probe: `backoff` probes' worth of time."""
        even = self.break_even()  # timed by the time anything loses; one probe's worth until then
        return math.ceil(self.backoff * (even if even is not None else 1.0))

    # -- memory across requests of one loaded export --------------------------------
    @classmethod
    def resume(cls, memory: Memory, key: str) -> "AdaptivePolicy":
        spec = memory.spec.get(key) or Speculated()
        # The backoff restarts: it says how clearly the last request's acceptance lost, and a new
        # request's is its own (a code answer that copies after a chat answer that copied nothing
        # waited out the chat request's backoff plain: prompt lookup 2.0 tokens per call on it vs 4.0)
        return cls(memory.plain.prior(), Speculated(spec.seconds.prior(), Average(), spec.plain_mode))

    def remember(self, memory: Memory, key: str) -> None:
        memory.plain = self.plain_seconds
        memory.spec.pop(key, None)
        memory.spec[key] = Speculated(self.spec_seconds, self.spec_tokens, self.plain_mode)
        while len(memory.spec) > MAX_CONFIGS:  # requests' overrides make configs: forget the least recent
            memory.spec.pop(next(iter(memory.spec)))
