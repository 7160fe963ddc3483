"""How many chain drafts are worth verifying, from the acceptance seen so far.

A chain's j-th draft is accepted only if all before it are, and acceptance comes in runs: a copy
that is right once is usually right for a while. Measured on SmolLM2-135M's own greedy answers
(6 prompts a set, prompt lookup's whole 14-token copies), the first draft was taken 18-47% of the
time and each later one, given those before it were, 57-95%. So the chance a step takes its j-th
draft is the first draft's rate times the conditional rates of depths 2..j, each measured apart
(`ChainAcceptance`). One per-draft rate compounded (a^j) cannot fit both: at code's first-draft
0.46, the 8th draft would be worth 0.002 against 0.24 measured. The first draft's rate is kept
per `kind` of proposal, which the drafter knows before the step: prompt lookup's matched n-gram
length (a 1-gram match's copy was taken 12-28% of the time, a 3-gram's 58-86%).

The chain verified is the prefix that maximizes the expected tokens per step's time
(drafters/step_costs.py: a step's time by verify size, measured; zero drafts, a plain step,
when no prefix pays): on a CPU a verify row is not free, and the first costs most (SmolLM2-135M
float32 on 2 cores: T=2 1.28x a plain step, then ~0.05 a row; int4: ~0.15 a row).

Each rate is hits over offers (a draft is offered when all before it were taken, and measured
whether verified or not: a host drafter's whole candidate is walked with the committed tokens,
the bonus too, so a plain step still says whether its first draft would have been taken), from
a prior worth two offers (0.5 for a first draft, PRIOR_RUN for a later one), each of the last ~10
offers weighing most. The length depends only on verified steps and their times, so proposals
never depend on the step's own random draws and sampling stays exact.
"""

from __future__ import annotations

from .step_costs import StepCosts, best_prefix

DECAY = 0.9  # weight of the history at each new step: about the last ten steps decide
PRIOR_RATE, PRIOR_WEIGHT = 0.5, 2.0  # before any step: a = 0.5, worth two drafts


DEPTHS = 4  # conditional rates kept for depths 2, 3, 4 and 5+ (deeper ones share the last)
# A later draft's prior, given those before it were taken (measured: 57-95%). Optimistic on purpose: a
# step measures a draft only as deep as the target's tokens reach (the drafts verified and the bonus), so
# a rate priced too low would never be verified deep enough to be measured up; one too high is verified
# and measured down.
PRIOR_RUN = 0.8


class Rate:
    """Hits over offers from the prior, each new offer keeping DECAY of the history."""

    def __init__(self, prior: float = PRIOR_RATE) -> None:
        self.hits, self.offers = prior * PRIOR_WEIGHT, PRIOR_WEIGHT

    @property
    def value(self) -> float:
        return self.hits / self.offers

    def add(self, hit: bool) -> None:
        self.hits = DECAY * self.hits + hit
        self.offers = DECAY * self.offers + 1.0


class ChainAcceptance:
    """The chance a chain's drafts are taken: the first's per kind of proposal, each later one's given
    those before it (per depth). `costs` None: rows are free (a GPU), every draft up to `most` is verified."""

    def __init__(self, most: int, costs: StepCosts | None, kinds: int = 1):
        self.most, self.costs, self.kinds = most, costs, kinds
        self.reset()

    def reset(self) -> None:
        """A new request: acceptance is each prompt's own."""
        self.first = [Rate() for _ in range(self.kinds)]
        self.deeper = [Rate(PRIOR_RUN) for _ in range(DEPTHS)]

    def worths(self, kind: int, drafts: int) -> list[float]:
        """The chance each of the first `drafts` drafts is taken."""
        out, w = [], self.first[kind].value
        for j in range(1, drafts + 1):
            if j > 1:
                w *= self.deeper[min(j - 2, DEPTHS - 1)].value
            out.append(w)
        return out

    def __call__(self, kind: int = 0, available: int | None = None) -> int:
        """Drafts to verify next step (0 <= n <= most) of a proposal of `kind`, of `available` candidates."""
        most = self.most if available is None else min(available, self.most)
        if self.costs is None:
            return most
        return best_prefix(self.worths(kind, most), self.costs)

    def observe(self, kind: int, measured: int, taken: int) -> None:
        """A chain of `kind` measured to `measured` drafts, of which the first `taken` were taken."""
        for j in range(1, min(taken + 1, measured) + 1):  # offered: all before it taken
            (self.first[kind] if j == 1 else self.deeper[min(j - 2, DEPTHS - 1)]).add(j <= taken)
