"""A drafter's measured chance that its drafts are taken: one estimator for chains and trees.

A node of a proposal is taken only if the target's path reaches its parent, and acceptance comes
in runs: a copy that is right once is usually right for a while. Measured on SmolLM2-135M's own
greedy answers (6 prompts a set, prompt lookup's and suffix decoding's whole 14-token proposals),
the first draft was taken 18-66% of the time and each later one, given those before it, 49-100%.
One per-draft rate compounded (a^j) cannot fit both: at code's first-draft 0.46, the 8th draft
would be worth 0.002 against 0.24 measured. So `RankAcceptance` counts the root's children per
`kind` of proposal, which the drafter knows before the step (prompt lookup's matched n-gram
length: a 1-gram match's copy was taken 12-28% of the time, a 3-gram's 58-86%; suffix decoding's
match length), deeper nodes per depth, and siblings per rank (likeliest first).

Counts are hits over offers (a node is offered when the committed tokens walk to its parent, and
measured whether it was verified or not: a host drafter's whole proposal is walked with the
committed tokens, the bonus too, so a plain step still says whether its first draft would have
been taken), from a prior worth two offers (PRIOR_RATE for a first draft, PRIOR_RUN for a later
one), decayed per step so that about the last ten steps decide. The sizes chosen from them depend
only on verified steps (and their times: drafters/step_costs.py), never on a step's own random
draws, so sampling stays exact.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

import numpy as np

from ..tree import Tree

DECAY = 0.9  # weight of the history at each new step: about the last ten steps decide
PRIOR_RATE, PRIOR_WEIGHT = 0.5, 2.0  # before any step: a first draft taken half the time, worth two offers
DEPTHS = 4  # deeper nodes counted at depths 2, 3 and 4+ (a drafter's `depths`)
# A later draft's prior, given those before it were taken (measured: 49-100%). Optimistic on purpose: a
# step measures a draft only as deep as the target's tokens reach (the drafts verified and the bonus), so
# a rate priced too low would never be verified deep enough to be measured up; one too high is verified
# and measured down.
PRIOR_RUN = 0.8
RANKS = 4  # siblings of rank 3 and later share one estimate


class RankAcceptance:
    """A drafter's chance that its child of rank r is on the target's path where the parent is.

    Counted on every node of its proposal the committed tokens walked through that has children: each
    child's rank was offered once, the one the target took (if any) hit. Before any step (the prior):
    PRIOR_RATE^(1 + r), a geometric guess for a sibling list whose first is likeliest; measured, a
    bushy tree's later ranks are worth what they are taken, not what the first one is.

    With `kinds` and `depths` (prompt lookup, suffix decoding) the root's children are counted per
    kind of proposal (how long a context match it continues) and deeper nodes per depth (2, ...,
    `depths` and deeper): acceptance comes in runs, so a node below a taken one is taken far more
    often than the root's (prior PRIOR_RUN x PRIOR_RATE^r there). A step decays its kind's and the
    deeper levels' counts. One level (the default) is a fused method's per-part count."""

    def __init__(self, kinds: int = 1, depths: int = 1):
        self.kinds, self.depths = kinds, depths
        first = [PRIOR_RATE ** (1 + r) for r in range(RANKS)]
        deeper = [PRIOR_RUN * PRIOR_RATE ** r for r in range(RANKS)]
        self.hits = [[p * PRIOR_WEIGHT for p in first] for _ in range(kinds)] + \
            [[p * PRIOR_WEIGHT for p in deeper] for _ in range(depths - 1)]
        self.offered = [[PRIOR_WEIGHT] * RANKS for _ in range(kinds + depths - 1)]

    def _level(self, depth: int, kind: int) -> int:
        """The counts of a node at `depth` (1: the root's children) of a proposal of `kind`."""
        return kind if depth <= 1 or self.depths == 1 else self.kinds + min(depth, self.depths) - 2

    def at(self, rank: int, depth: int = 1, kind: int = 0) -> float:
        level, r = self._level(depth, kind), min(rank, RANKS - 1)
        return self.hits[level][r] / self.offered[level][r]

    def chain(self, drafts: int, kind: int = 0) -> list[float]:
        """The chance each of a chain's first `drafts` drafts is taken (every node its parent's only child)."""
        out, w = [], 1.0
        for depth in range(1, drafts + 1):
            w *= self.at(0, depth, kind)
            out.append(w)
        return out

    def observe(self, tree: Tree, tokens: np.ndarray, committed: Sequence[int], kind: int = 0) -> None:
        """One verified step of a proposal (`tree`, `tokens`) of `kind` and the tokens committed after its root."""
        for level in [kind] + list(range(self.kinds, self.kinds + self.depths - 1)):
            self.hits[level] = [DECAY * h for h in self.hits[level]]
            self.offered[level] = [DECAY * o for o in self.offered[level]]
        node, depth = 0, 1
        for tok in committed:
            kids = tree.children[node]
            hits, offered = self.hits[self._level(depth, kind)], self.offered[self._level(depth, kind)]
            for r in range(len(kids)):
                offered[min(r, RANKS - 1)] += 1.0
            rank = next((r for r, c in enumerate(kids) if tokens[c] == tok), -1)
            if rank < 0:
                break
            hits[min(rank, RANKS - 1)] += 1.0
            node, depth = kids[rank], depth + 1


# Bin edges of a draft's own probability of its pick (finer at the top, where near-identical drafts live).
CONFIDENCE_EDGES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)
CONFIDENCE_CAP = 2000.0  # offers a bin keeps: past it both counts halve, so the rates follow a slow drift


class ConfidenceAcceptance:
    """How often a draft model's pick is the target's token, by the draft's own probability of it.

    A draft's probability says how sure the draft is of its pick, not how often the target agrees: SmolLM2's
    int8 self-draft agrees with its float32 target on 97-99% of greedy tokens, yet stopped by the product
    of its probabilities it took 3.7 tokens a target call on chat, 7.6 priced by this table. Counted per
    bin of that probability (hits over offers, each bin's prior its own midpoint worth PRIOR_WEIGHT offers:
    the raw probability until measured), from every verified step: a draft is offered while the committed
    tokens walk down the chain, hit where it equals the target's token there. The counts depend only on
    committed tokens and the draft's own outputs, never on a step's random draws."""

    def __init__(self) -> None:
        lows, highs = (0.0, *CONFIDENCE_EDGES), (*CONFIDENCE_EDGES, 1.0)
        self.hits = [PRIOR_WEIGHT * (lo + hi) / 2 for lo, hi in zip(lows, highs)]
        self.offered = [PRIOR_WEIGHT] * len(self.hits)

    @staticmethod
    def _bin(prob: float) -> int:
        return bisect_right(CONFIDENCE_EDGES, prob)  # per draft token: 0.1 us against np.searchsorted's 2.5

    def chance(self, prob: float) -> float:
        """The measured chance that a draft picked with probability `prob` is the target's token."""
        b = self._bin(prob)
        return self.hits[b] / self.offered[b]

    def observe(self, probs: Sequence[float], drafts: Sequence[int], committed: Sequence[int]) -> None:
        """One verified chain: the drafts' probabilities, the drafts, the tokens committed after the root."""
        for prob, draft, token in zip(probs, drafts, committed):
            b = self._bin(prob)
            self.offered[b] += 1.0
            if self.offered[b] > CONFIDENCE_CAP:
                self.hits[b] /= 2
                self.offered[b] /= 2
            if draft != token:
                break
            self.hits[b] += 1.0
