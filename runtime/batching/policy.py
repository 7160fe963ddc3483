"""Load-adaptive speculation: per step, each row's draft size (or none) from measured costs.

In a batch, a row's plain step rides in the one T=1 call of all rows and costs only that
call's marginal row, while a speculative step is a single-row call of its own (scheduler.py)
that every row of the step waits for. A row speculates with k drafts when the tokens it adds
are worth what the step's time grows by, at the batch's current rate of tokens per second:

    (E(k) - 1) * decode(n) / n  >  single(k + 1) - (decode(n) - decode(n - 1))

decode(n): seconds of a T=1 call over n rows; single(T): a one-row call of T tokens; both
measured (`CostModel`: at start-up by `calibrate`, then every call the scheduler runs). E(k):
the tokens a step of k drafts yields, from the row's measured acceptance (a per-draft rate:
drafts accepted over drafts accepted plus steps cut short, the method's rate over all rows
as the prior). With one row this is the batch-1 rule (speculate while tokens per second
beat plain decoding); as rows join, decode(n) / n falls and speculation shrinks toward plain
decoding. Either kind of step is lossless, so the choice never changes a row's tokens.
"""

from __future__ import annotations

import bisect
import threading

import numpy as np

from ..drafters.base import DecodeState, Drafter, Proposal
from ..tree import Tree

EMA = 0.2  # weight of the newest timing of a call shape
PRIOR_STEPS = 4.0  # speculative steps the method's rate counts for in a row's estimate
DRAFT_SIZES = (1, 2, 3, 4, 6, 8, 11, 14)  # draft sizes the policy weighs (capped by each proposal)


class CostModel:
    """Seconds of the batch's calls: T=1 decode calls by rows, single-row calls by T."""

    def __init__(self):
        self.decode: dict[int, float] = {}
        self.single: dict[int, float] = {}
        self._lock = threading.Lock()

    def observe(self, rows: int, tokens: int, seconds: float, replace: bool = False) -> None:
        """A call's time (`replace`: as the shape's time, not blended into it)."""
        table = self.decode if tokens == 1 else self.single
        key = rows if tokens == 1 else tokens
        with self._lock:
            old = table.get(key)
            table[key] = seconds if old is None or replace else (1 - EMA) * old + EMA * seconds

    def calibrate(self, batcher, rows: list[int], tokens: list[int], repeats: int = 2) -> None:
        """Time each call shape before serving: a warm-up call, then the fastest of `repeats`."""
        for r, t in [(r, 1) for r in rows] + [(1, t) for t in tokens if t > 1]:
            batcher.time_call(r, t)
            self.observe(r, t, min(batcher.time_call(r, t) for _ in range(repeats)), replace=True)

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

    def decode_s(self, rows: int) -> float:
        with self._lock:
            return self._interpolate(self.decode, rows) if rows > 0 else 0.0

    def single_s(self, tokens: int) -> float:
        with self._lock:
            if tokens == 1:
                return self._interpolate(self.decode, 1)
            return self._interpolate(self.single, tokens)


class Acceptance:
    """Drafts accepted and steps cut short (a draft rejected) over speculative steps."""

    def __init__(self):
        self.accepted = 0.0
        self.cut = 0.0
        self.steps = 0

    def add(self, accepted: int, cut: bool) -> None:
        self.accepted += accepted
        self.cut += cut
        self.steps += 1

    def rate(self, prior: "Acceptance | None" = None) -> float:
        """Per-draft acceptance rate; a prior (the method's, over all rows) counts as PRIOR_STEPS steps."""
        a, c = self.accepted, self.cut
        if prior is not None and prior.steps:
            a += prior.accepted * PRIOR_STEPS / prior.steps
            c += prior.cut * PRIOR_STEPS / prior.steps
        return (a + 1.0) / (a + c + 2.0)  # Laplace: no samples reads as one half


def expected_tokens(rate: float, drafts: int) -> float:
    """Tokens a step of a `drafts`-long chain yields when each draft is accepted with `rate`
    (the accepted prefix plus the target's own next token)."""
    return float(np.sum(rate ** np.arange(drafts + 1)))


class SpeculationPolicy:
    def __init__(self, costs: CostModel, enabled: bool = True):
        self.costs, self.enabled = costs, enabled
        self.methods: dict[str, Acceptance] = {}
        self._lock = threading.Lock()

    def draft_size(self, rows: int, rate: float, most: int) -> int:
        """Drafts for a row's next step (0: plain) with `rows` rows running, at most `most`."""
        if most < 1:
            return 0
        if not self.enabled:
            return most
        step = self.costs.decode_s(rows)
        marginal = step - self.costs.decode_s(rows - 1)
        per_token = step / rows  # seconds per token the batch makes now
        best, best_k = 0.0, 0
        for k in sorted({min(k, most) for k in DRAFT_SIZES}):
            gain = (expected_tokens(rate, k) - 1) * per_token - (self.costs.single_s(k + 1) - marginal)
            if gain > best:
                best, best_k = gain, k
        return best_k

    def observe(self, method: str, accepted: int, cut: bool) -> None:
        with self._lock:
            self.methods.setdefault(method, Acceptance()).add(accepted, cut)

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
    """A row's drafter under the batch's policy: asks it for the step's draft size, drafts
    only then, and reports what was accepted. The inner drafter sees every step as before
    (a plain step is a root-only proposal, as when the batch-1 adaptive policy decodes plainly)."""

    def __init__(self, inner: Drafter, policy: SpeculationPolicy, active_rows, most: int):
        self.inner, self.policy, self.active_rows, self.most = inner, policy, active_rows, most
        self.name, self.deterministic = inner.name, inner.deterministic
        self.default_sampling = inner.default_sampling
        self.acceptance = Acceptance()

    def prefilled(self, target_out) -> None:
        self.inner.prefilled(target_out)

    def start(self, state: DecodeState) -> None:
        self.inner.start(state)

    def propose(self, state: DecodeState) -> Proposal:
        rate = self.acceptance.rate(self.policy.prior(self.name))
        k = self.policy.draft_size(max(1, self.active_rows()), rate, self.most)
        if k == 0:
            return Proposal.root_only(state.tokens[-1])
        return truncated(self.inner.propose(state), k)

    def update(self, state: DecodeState, proposal: Proposal, verdict, target_out) -> None:
        if proposal.size > 1 and proposal.aux_tokens is None:
            depth = int(proposal.tree.depth.max())
            cut = verdict.accepted_drafts < depth
            self.acceptance.add(verdict.accepted_drafts, cut)
            self.policy.observe(self.name, verdict.accepted_drafts, cut)
        self.inner.update(state, proposal, verdict, target_out)
