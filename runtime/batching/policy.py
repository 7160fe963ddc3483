"""Load-adaptive speculation: per step, each row's draft size (or none) from measured costs.

In a batch, every row's step rides in one call of the batched graph (scheduler.py): a plain
step adds one token to the call, a speculative step of k drafts adds k + 1. A row speculates
with k drafts when the tokens it adds are worth what the call's time grows by, at the batch's
current rate of tokens per second:

    (E(k) - 1) * call(n) / n  >  k * token + run + draft

call(N): seconds of a call of N tokens as decode rows; token: the slope of a line fitted to
those times, or to a lone row's calls of 1 to 16 tokens where the graph has them (one noisy
timing never makes a draft look free); run: what a row's tokens cost
more as a run of their own (its attention node beside the decode rows', graph.py) than as
decode rows; all measured (`CostModel`: at start-up by `calibrate`, then scaled by every
call the scheduler runs to the machine's current load); draft: the method's measured time
to propose (an EAGLE or draft model's calls run on the same cores as the target's, and the
row is not ready for the call until it is done; a draft model's per draft, k of them: its
stop rule, not k, sizes its chain; a fused drafter's model part prices itself at the batch's
rates, `price`, and is not charged here again); n: the rows running. E(k): the tokens a
step of k drafts yields, 1 + S(1) + ... + S(k), from the row's measured acceptance (S(j):
the chance that at least j drafts are accepted, recent steps weighing most, the method's
over all rows as the prior: `Acceptance`). With one row this is the batch-1 rule (speculate
while tokens per second beat plain decoding); as rows join, call(n) / n falls while a
token's cost stays, so speculation shrinks toward plain decoding. A row kept plain still
probes with one draft now and then (EXPLORE), so a rate that fell low can rise again. A
speculative step also needs one of the scheduler's seats (one run of the call each). Either
kind of step is lossless, so the choice never changes a row's tokens.
"""

from __future__ import annotations

import bisect
import threading
import time

import numpy as np

from ..drafters.base import BatchPrice, DecodeState, Drafter, Proposal
from ..tree import Tree
from .gate import SpeculationGate

EMA = 0.2  # weight of the newest timing of a call size
PRIOR_STEPS = 2.0  # speculative steps the method's acceptance counts for in a row's estimate
UNSEEN_WEIGHT = 0.25  # steps a one-half chance of surviving each depth counts for (Acceptance.survival)
# Acceptance is weighed toward recent steps (a copy starts or stops matching mid-answer): each new
# speculative step keeps this share of a row's history, and of the method's over all rows.
ROW_DECAY, METHOD_DECAY = 0.9, 0.95
# A row the policy keeps plain still probes with one draft once its plain steps' worth (at the
# batch's rate per token) is 1 / EXPLORE times the probe's cost: without it, a rate that fell low
# never sees another sample and the row (and, through the prior, every row of its method) stays
# plain for good, whatever the drafter would propose now.
EXPLORE = 0.05
DRAFT_SIZES = (1, 2, 3, 4, 6, 8, 11, 14)  # draft sizes the policy weighs (capped by each proposal)


class CostModel:
    """Seconds of a call of the batched graph by the tokens it computes, and what each run in it
    costs beyond that: the cost curve's shape as measured (`calibrate`, or `replace` timings),
    times how much slower calls run now than then (`load`), which every call the scheduler runs
    refines. A shared machine's load moves every call's time alike: refining each size's time
    only from calls of that size left the sizes a row's drafts add up to at their start-up
    times, so beside a loaded plain step a token looked cheaper than it was."""

    def __init__(self) -> None:
        self.calls: dict[int, float] = {}  # calls of decode rows only, by tokens, as measured
        # a lone row's calls by tokens, as measured (the batched graph's lone-row branch: its
        # attention alone, no run's own cost; empty for a graph without it)
        self.lone: dict[int, float] = {}
        self._run_s = 0.0  # as measured, negative noise included (clipped where used)
        self.load = 1.0  # calls' time now over the measured curve's: an average of each call's ratio
        self._lock = threading.Lock()
        self._version = 0  # bumped by each measured size: the slope is fitted once per change, not per step
        self._slope: tuple[int, float] = (-1, 0.0)  # (the version it was fitted at, the slope)

    def observe(self, tokens: int, seconds: float, runs: int = 0, replace: bool = False, lone: bool = False) -> None:
        """A call's time. `replace`: a measurement of the curve (a call of `tokens` decode rows,
        or with `runs` runs: the run's cost, its time beyond as many decode rows' tokens; `lone`:
        a lone row's call of `tokens`); otherwise it refines `load` (the first call of a size
        with nothing measured is its time; calls beyond the largest size measured, prefill
        chunks, only extrapolate the curve and are left out)."""
        with self._lock:
            if lone and (replace or self.lone):
                self._observe_lone(tokens, seconds, replace)
                return
            base = self._interpolate(self.calls, tokens)
            if replace and runs:
                self._run_s = (seconds - base) / runs
            elif replace or not self.calls:
                if not runs:
                    self._version += 1
                    self.calls[tokens] = seconds
            elif tokens <= max(self.calls):
                predicted = base + runs * max(0.0, self._run_s)
                if predicted > 0:
                    self.load = (1 - EMA) * self.load + EMA * seconds / predicted

    def _observe_lone(self, tokens: int, seconds: float, replace: bool) -> None:
        if replace:
            self._version += 1
            self.lone[tokens] = seconds
        elif tokens <= max(self.lone):
            predicted = self._interpolate(self.lone, tokens)
            if predicted > 0:
                self.load = (1 - EMA) * self.load + EMA * seconds / predicted

    def calibrate(self, batcher, rows: list[int], tokens: list[int], repeats: int = 3) -> None:
        """Time call sizes before serving: `rows` decode rows alone, and one decode row with a
        run of t - 1 tokens for each t of `tokens`, and (a graph with a lone-row branch) a lone
        row's call of 1 and of each t tokens; a warm-up call, then the fastest of `repeats`."""
        shapes = [(r, 0) for r in rows] + [(1, t - 1) for t in tokens if t > 1]
        if batcher.lone_calls:  # one decode row is a lone call: timed as such, not on the rows' curve
            shapes = [(r, t) for r, t in shapes if (r, t) != (1, 0)] + [(0, t) for t in sorted({1, *tokens})]
        for r, t in shapes:
            batcher.time_call(r, t)
        # The repeats in turns over every shape, not each shape's back to back: a run's cost is a
        # difference of two shapes' times, and a shared machine's load drifts between them
        best: dict[tuple[int, int], float] = {}
        for _ in range(repeats):
            for shape in shapes:
                seconds = batcher.time_call(*shape)
                best[shape] = min(best.get(shape, seconds), seconds)
        for (r, t), seconds in best.items():
            if not r:
                self.observe(t, seconds, replace=True, lone=True)
            elif not t:
                self.observe(r, seconds, replace=True)
        for table in (self.calls, self.lone):  # more tokens never take less time: a dip is noise
            top = 0.0  # (SmolLM2 at load 5: 2 rows 62.7 ms, 4 rows 57.8, and past 4 a falling slope)
            for size in sorted(table):
                top = table[size] = max(top, table[size])
        runs = [seconds - self._interpolate(self.calls, r + t) for (r, t), seconds in best.items() if r and t]
        if runs:
            self._run_s = float(np.median(runs))
        self.load = 1.0

    @property
    def run_s(self) -> float:
        return self.load * max(0.0, self._run_s)

    @run_s.setter
    def run_s(self, seconds: float) -> None:
        self._run_s = seconds / self.load

    @staticmethod
    def _interpolate(table: dict[int, float], x: int) -> float:
        keys = sorted(table)
        if not keys:
            return 0.0
        i = bisect.bisect_left(keys, x)
        if i < len(keys) and keys[i] == x:
            return table[x]
        if i == 0:  # below the smallest measured: proportional
            return table[keys[0]] * x / keys[0]
        if i == len(keys):  # beyond the largest: the last slope
            if len(keys) == 1:
                return table[keys[0]] * x / keys[0]
            a, b = keys[-2], keys[-1]
            return table[b] + (table[b] - table[a]) / (b - a) * (x - b)
        a, b = keys[i - 1], keys[i]
        return table[a] + (table[b] - table[a]) * (x - a) / (b - a)

    def lone_s(self, tokens: int) -> float | None:
        """Seconds of a lone row's call of `tokens` now; None without lone-row timings."""
        with self._lock:
            return self.load * self._interpolate(self.lone, tokens) if self.lone else None

    def call_s(self, tokens: int) -> float:
        with self._lock:
            return self.load * self._interpolate(self.calls, tokens) if tokens > 0 else 0.0

    def token_s(self) -> float:
        """Seconds a token adds to a call: the least-squares slope over the call sizes measured
        (a lone row's calls where measured: more sizes, and a token adds the same linear-layer
        work to any call; the rows' curve starts at two rows, a call of parts apart)."""
        with self._lock:
            if self._slope[0] != self._version:
                table = self.lone if len(self.lone) >= 2 else self.calls
                if len(table) < 2:
                    return 0.0
                x, y = np.array(list(table)), np.array(list(table.values()))
                self._slope = (self._version, max(0.0, float(np.polyfit(x, y, 1)[0])))
            return self.load * self._slope[1]


class Acceptance:
    """How deep a row's drafts are accepted: per depth j, the weight of speculative steps that
    verified a j-th draft and of those that rejected it there, each older step weighing `decay`
    times the next. Copied text is accepted in runs (a copy is right for a long stretch or wrong
    from its first token), so a per-draft rate a^j, fitted to a mix of both, overvalues a few
    drafts of a copy that is wrong as often as not (a row of 4 clients drafted 4 of them at
    2.5 tokens per call and ran no faster than plain); the chance S(j) that at least j drafts
    are accepted is the product of each depth's survival (Kaplan-Meier)."""

    def __init__(self, decay: float = 1.0, depth: int = max(DRAFT_SIZES)):
        self.decay = decay
        self.reached = np.zeros(depth)
        self.failed = np.zeros(depth)
        self.steps = 0.0

    def add(self, accepted: int, drafted: int) -> None:
        """A step that verified drafts up to depth `drafted` and accepted `accepted` of them."""
        d = self.decay
        self.reached *= d
        self.failed *= d
        self.steps = d * self.steps + 1
        self.reached[: min(accepted + 1, drafted)] += 1  # the accepted ones, and the one rejected
        if accepted < min(drafted, len(self.failed)):
            self.failed[accepted] += 1

    def survival(self, prior: "Acceptance | None" = None) -> np.ndarray:
        """S(1..depth); a prior (the method's, over all rows) counts as PRIOR_STEPS steps, and
        every depth as UNSEEN_WEIGHT steps more at a one-half chance of surviving it (a depth
        without samples reads as that; a light weight, as it compounds over the depths: one
        sample's worth left a row that never missed at S(14) < 0.3)."""
        reached, failed = self.reached, self.failed
        if prior is not None and prior.steps:
            reached = reached + prior.reached * PRIOR_STEPS / prior.steps
            failed = failed + prior.failed * PRIOR_STEPS / prior.steps
        return np.cumprod(1.0 - (failed + UNSEEN_WEIGHT / 2) / (reached + UNSEEN_WEIGHT))


def expected_tokens(survival: float | np.ndarray, drafts: int) -> float:
    """Tokens a step of a `drafts`-long chain yields (the accepted prefix plus the target's own
    next token): `survival` S(1..) (Acceptance.survival), or a per-draft rate a (S(j) = a^j)."""
    if np.ndim(survival) == 0:
        return float(np.sum(float(survival) ** np.arange(drafts + 1)))
    return 1.0 + float(np.sum(np.asarray(survival)[:drafts]))


class SpeculationPolicy:
    def __init__(self, costs: CostModel, enabled: bool = True):
        self.costs, self.enabled = costs, enabled
        self.sizes = DRAFT_SIZES  # draft sizes it weighs
        self.methods: dict[str, Acceptance] = {}
        self.draft_times: dict[str, float] = {}
        self.catchup_times: dict[str, float] = {}  # a draft model's seconds per token it catches up on
        self._lock = threading.Lock()

    def draft_size(self, rows: int, survival: float | np.ndarray, most: int, draft_s: float = 0.0,
                   plain_steps: int = 0, per_draft: bool = False, catchup_s: float = 0.0) -> int:
        """Drafts for a row's next step (0: plain) with `rows` rows running, at most `most`;
        `survival`: the row's S(1..) (Acceptance.survival), or a per-draft rate a (S(j) = a^j);
        `draft_s`: seconds its drafter takes to propose, or (`per_draft`: a draft model) one
        draft; `plain_steps`: the row's plain steps since its last speculative one (enough of
        them buy a probe of one draft: EXPLORE); `catchup_s`: what a draft model first spends
        feeding those steps' tokens, a probe's price too (at 4 clients, probes that each fed a
        draft model dozens of tokens while the batch waited ran at 0.92-0.95x plain batching)."""
        if most < 1:
            return 0
        if not self.enabled:
            return most
        lone = self.costs.lone_s(1) if rows == 1 else None
        if lone is not None:  # a row alone: its calls are the graph's lone-row calls, as measured
            per_token = lone

            def added(k: int) -> float:  # seconds k drafts add to the row's call
                return max(0.0, (self.costs.lone_s(k + 1) or 0.0) - lone)
        else:
            per_token = self.costs.call_s(rows) / rows  # seconds per token the batch makes decoding plainly
            token, run = self.costs.token_s(), self.costs.run_s

            def added(k: int) -> float:
                return k * token + run

        def drafting(k: int) -> float:  # a draft model's calls, one per draft; else its measured proposal
            return k * draft_s if per_draft else draft_s

        best, best_k = 0.0, 0
        for k in sorted({min(k, most) for k in self.sizes}):
            gain = (expected_tokens(survival, k) - 1) * per_token - (added(k) + drafting(k))
            if gain > best:
                best, best_k = gain, k
        if best_k == 0 and EXPLORE * plain_steps * per_token >= added(1) + drafting(1) + catchup_s:
            return 1  # a probe
        return best_k

    def price(self, rows: int) -> BatchPrice | None:
        """A row's drafting in seconds of the batch's call with `rows` running (a drafter that decides itself
        whether to call its model weighs it so: drafters/fused.py); None for a row alone (its calls are its
        own: the batch-1 rules hold) or with the policy off."""
        if not self.enabled or rows <= 1:
            return None
        return BatchPrice(rows, self.costs.call_s(rows) / rows, self.costs.token_s(), self.costs.run_s)

    def observe(self, method: str, accepted: int, drafted: int) -> None:
        with self._lock:
            self.methods.setdefault(method, Acceptance(METHOD_DECAY)).add(accepted, drafted)

    def observe_draft(self, method: str, seconds: float) -> None:
        """A proposal's time (the method's average, over all rows)."""
        with self._lock:
            old = self.draft_times.get(method)
            self.draft_times[method] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def observe_catchup(self, method: str, seconds: float, tokens: int) -> None:
        with self._lock:
            old, new = self.catchup_times.get(method), seconds / tokens
            self.catchup_times[method] = new if old is None else (1 - EMA) * old + EMA * new

    def catchup_s(self, method: str, tokens: int) -> float:
        """Seconds a draft model takes to feed `tokens` committed without it (0 until measured)."""
        return tokens * self.catchup_times.get(method, 0.0)

    def draft_s(self, method: str) -> float:
        """Seconds the method takes to propose (0 until measured: a method drafts once to learn it)."""
        return self.draft_times.get(method, 0.0)

    def prior(self, method: str) -> Acceptance | None:
        return self.methods.get(method)


def truncated(proposal: Proposal, drafts: int) -> Proposal:
    """The proposal's first `drafts` nodes after the root (parents precede children: still a tree)."""
    if proposal.aux_tokens is not None or proposal.tree.size <= drafts + 1:
        return proposal
    n = drafts + 1
    tree = Tree(proposal.tree.parents[:n], proposal.tree.ranks[:n] if proposal.tree.ranks else ())
    probs = None if proposal.draft_probs is None else proposal.draft_probs[:n]
    return Proposal(tree, proposal.tokens[:n], probs)


class LoadAwareDrafter(Drafter):
    """A row's drafter under the batch's policy: asks it for the step's draft size (and the
    batcher for a seat), drafts only then, and reports what was accepted. The inner drafter
    sees every step as before (a plain step is a root-only proposal, as when the batch-1
    adaptive policy decodes plainly). A disabled policy drafts every step without a seat (the
    scheduler then takes further calls), so the steps stay batch-1's. Under a `gate` (gate.py)
    every row decodes plainly in the epochs the gate keeps plain, and reports what its
    speculative steps committed."""

    def __init__(self, inner: Drafter, policy: SpeculationPolicy, batcher, slot: int, most: int,
                 gate: SpeculationGate | None = None):
        self.inner, self.policy, self.batcher, self.slot, self.most = inner, policy, batcher, slot, most
        self.gate = gate
        self._gated = False  # this step was kept plain by the gate, not by the policy
        self.name, self.deterministic = inner.name, inner.deterministic
        self.default_sampling = inner.default_sampling
        self.acceptance = Acceptance(ROW_DECAY)
        self.plain_steps = 0  # since the last speculative step

    def prefilled(self, target_out) -> None:
        self.inner.prefilled(target_out)

    def start(self, state: DecodeState) -> None:
        self.inner.start(state)

    def propose(self, state: DecodeState) -> Proposal:
        self._gated = self.gate is not None and not self.gate.speculate
        if self._gated:
            return Proposal.root_only(state.tokens[-1])
        survival = self.acceptance.survival(self.policy.prior(self.name))
        per_draft = self.inner.cost_per_draft
        catchup = self.policy.catchup_s(self.name, self.plain_steps) if per_draft else 0.0
        k = self.policy.draft_size(max(1, self.batcher.active), survival, self.most, self.policy.draft_s(self.name),
                                   self.plain_steps, per_draft, catchup)
        if k and self.policy.enabled and not self.batcher.take_seat(self.slot):
            k = 0
        if k == 0:
            return Proposal.root_only(state.tokens[-1])
        self.inner.batch_price = self.policy.price(max(1, self.batcher.active))
        start = time.perf_counter()
        proposal = self.inner.propose(state)
        seconds = time.perf_counter() - start
        if not per_draft:  # less what the drafter priced itself (a fused drafter's model part: drafters/fused.py)
            self.policy.observe_draft(self.name, max(0.0, seconds - self.inner.self_priced_s))
            return truncated(proposal, k)
        # A draft model: the policy said whether to draft; its own stop rule says how many (it drafts
        # long runs where it is confident, which a k fitted to its average acceptance cut short: one
        # row of a batched service at 0.97x plain decoding with the policy's k, 1.28x drafting freely).
        calls_s, calls = self.inner.draft_calls
        if calls:  # its first call also feeds what the model missed: timed apart from a draft's
            self.policy.observe_draft(self.name, calls_s / calls)
        caught_s, caught = self.inner.catchup
        if caught:
            self.policy.observe_catchup(self.name, caught_s, caught)
        return proposal

    def update(self, state: DecodeState, proposal: Proposal, verdict, target_out) -> None:
        if proposal.size > 1:
            self.plain_steps = 0
            if self.gate is not None:
                self.gate.committed(self.slot, verdict.accepted_drafts + 1)
        elif not self._gated:  # a gated epoch's plain steps buy no probe
            self.plain_steps += 1
        if proposal.size > 1 and proposal.aux_tokens is None:
            depth = int(proposal.tree.depth.max())
            self.acceptance.add(verdict.accepted_drafts, depth)
            self.policy.observe(self.name, verdict.accepted_drafts, depth)
        self.inner.update(state, proposal, verdict, target_out)
