"""What a step costs by its verify size, measured, and how many drafts pay for it.

A verify call's time is far from linear in its rows: widening a plain step (T=1) by one row costs
far more than widening a wide one (SmolLM2-135M on 2 cores, ms: float32 T=1/2/3/9/15
17.4/22.3/23.6/31.4/36.8; int4 8.3/9.6/11.2/16.8/23.7: an int4 row costs 2-3x a float32 row in
steps). A fixed price per row (`row_cost`) mispriced both: a first draft accepted 30% of the time
does not pay on float32 chat, and a chain of eight does not on int4. So the host drafters (prompt
lookup, suffix) keep a step's measured seconds per verify size on their export (`StepCosts`) and
verify the prefix of their best-first candidates that maximizes the expected tokens per second
(`best_prefix`): zero drafts, a plain step, when none pays. The fused drafter prices its model
part's rows with the same table (drafters/fused.py). The prior shape (`call_cost` for the first
row past the root, `row_cost` per row after it) prices a size until it is measured, scaled from
the nearest measured size.

Timing decides only how many candidates are verified, never which tokens are emitted. With
adaptation off (SPECDEPLOY_ADAPTIVE=0) or in a batched service (a row's step rides in the batch's
call, whose time is not its own: the batch's policy sizes drafts there) sizes are priced by the
prior shape alone, deterministically.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from ..adaptive import MIN_SAMPLES, STALL, Average, on_by_default
from ..errors import SpecDeployError


class StepCosts:
    """A step's seconds by its verify size T (the verify call, verification, the drafter's own host
    work): a running average per size measured, and for a size not measured yet (or fewer than
    MIN_SAMPLES times, at most) the nearest measured one's, scaled by the prior shape (call_cost,
    row_cost). A step timed over STALL x its size's average (another process, a cold cache) counts
    as STALL x."""

    def __init__(self, call_cost: float, row_cost: float) -> None:
        self.call_cost, self.row_cost = call_cost, row_cost
        self.by_size: dict[int, Average] = {}
        # each size's price since the last observation: a step prices up to 15 sizes (best_prefix), each
        # against the plain step's, and re-deriving them from the averages cost 88 us a step
        self._priced: dict[int, float] = {}

    def shape(self, t: float) -> float:
        """The prior: a step of verify size `t` in plain steps."""
        return 1 + self.call_cost * min(max(t - 1, 0.0), 1.0) + self.row_cost * max(t - 2, 0.0)

    def observe(self, t: int, seconds: float) -> None:
        self.by_size.setdefault(t, Average()).add(seconds, clip=STALL)
        self._priced.clear()

    @property
    def measured(self) -> bool:
        return bool(self.by_size)

    def _scaled(self, t: int, sizes: list[int]) -> float | None:
        """Size `t` priced from the nearest of `sizes` by the prior shape (None without any)."""
        if not sizes:
            return None
        near = min(sizes, key=lambda m: (abs(m - t), m))
        return self.by_size[near].value * self.shape(t) / self.shape(near)  # type: ignore[operator]

    def _at(self, t: int) -> float:
        price = self._priced.get(t)
        if price is None:
            price = self._priced[t] = self._price(t)
        return price

    def _price(self, t: int) -> float:
        own = self.by_size.get(t)
        if own is not None and own.count >= MIN_SAMPLES:
            return own.value  # type: ignore[return-value]
        # A size timed fewer times costs at most what the nearest settled size says by the prior shape: a
        # size's first call runs cold (ONNX Runtime sets its shape up), and one such step priced T=9 at 4x a
        # plain step on SmolLM2 int4 (1.6x when warm), so that no longer chain was drafted again to re-time it.
        others = [m for m in self.by_size if m != t]
        settled = [m for m in others if self.by_size[m].count >= MIN_SAMPLES]
        scaled = self._scaled(t, settled or others)
        if own is None or own.value is None:
            assert scaled is not None
            return scaled
        return own.value if scaled is None else min(own.value, scaled)

    def seconds(self, t: float) -> float:
        """A step's expected seconds at a (running average, so fractional) verify size; needs `measured`."""
        lo = max(1, math.floor(t))
        return self._at(lo) + (t - lo) * (self._at(lo + 1) - self._at(lo)) if t > lo else self._at(lo)

    def relative(self, t: float) -> float:
        """A step of verify size `t` in plain steps' time: measured where measured, else the prior shape."""
        return self.seconds(t) / self.seconds(1) if self.measured else self.shape(t)


def best_prefix(worths: Sequence[float], costs: StepCosts, base: int = 1) -> int:
    """How many of the candidates (best first, each a prefix-closed tree: a node after its parent)
    to verify: the prefix maximizing the expected tokens per step's time, (1 + sum of worths) over
    the step's time at verify size base + n. `worths[i]`: candidate i's chance of being on the
    target's path (its expected accepted tokens); `base`: the rows verified anyway (the root, and
    lookahead's window)."""
    best, best_n, gained = 1.0 / costs.relative(base), 0, 1.0
    for n, w in enumerate(worths, 1):
        gained += w
        rate = gained / costs.relative(base + n)
        if rate > best:
            best, best_n = rate, n
    return best_n


class StepTimer:
    """A drafter's step timing: from the start of its proposal to its update (its proposing, the verify
    call, verification), recorded under the step's verify size; inert where steps are not timed."""

    def __init__(self, costs: StepCosts, timed: bool) -> None:
        self.costs, self.timed = costs, timed
        self._start: float | None = None

    def proposing(self) -> None:
        self._start = time.perf_counter()

    def verified(self, size: int) -> None:
        """The step this proposal started was verified at `size` tokens (a step not proposed is not timed)."""
        if self.timed and self._start is not None:
            self.costs.observe(size, time.perf_counter() - self._start)
        self._start = None


def steps_timed(export) -> bool:
    """Whether a drafter times its steps: where the export's calls are this process's own steps (not a
    batched service's rows) and adaptation is on; else the prior shape alone prices sizes."""
    return bool(export.times_steps and on_by_default())


def step_timer(export, key: str, call_cost: float, row_cost: float) -> StepTimer:
    """A drafter's timer over its export's step costs under `key` (one per method config), inert
    where steps are not timed (steps_timed)."""
    if not steps_timed(export):
        return StepTimer(StepCosts(call_cost, row_cost), False)
    return StepTimer(export.part(f"step-costs:{key}", lambda: StepCosts(call_cost, row_cost)), True)


def cost_fields(config, method: str) -> None:
    """Validates a host drafter's prior shape: call_cost >= 0, 0 <= row_cost < 1."""
    for key, high in (("call_cost", math.inf), ("row_cost", 1.0)):
        value = getattr(config, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < high:
            bound = "a number >= 0" if high == math.inf else "a number in [0, 1)"
            raise SpecDeployError(f"config: {method}.{key} must be {bound}, got {value!r}")


def sized_by_steps(export, config) -> StepTimer | None:
    """The timer a host drafter sizes its proposals with; None where its config prices rows at 0 (free)."""
    if not config.call_cost and not config.row_cost:
        return None
    return step_timer(export, repr(config), config.call_cost, config.row_cost)
