"""How many chain drafts are worth verifying, from the acceptance seen so far.

A chain's j-th draft is accepted only if all before it are: with a per-draft acceptance
rate a, it adds a^j expected tokens to the step, and one more verify row (plus, for a
draft model, one more draft call) costs `cost` of a plain decode step, which yields one
token. So drafts pay up to the largest j with a^j >= cost. On a CPU a verify row is not
free (SmolLM2-135M, 2 cores: T=4/9/15 calls cost 1.1/1.4/1.7x a T=1 call, ~0.05 per row),
and a fixed long chain verified at low acceptance is slower than plain decoding.

`a` is estimated as a censored geometric: accepted drafts over accepted drafts plus
rejections (a step that accepted all it proposed saw no rejection), decayed so that the
last ~10 steps weigh most (acceptance changes when the answer starts or stops copying).
The length depends only on verified steps, so proposals stay deterministic given the
past and sampling stays exact.
"""

from __future__ import annotations

import math

DECAY = 0.9  # weight of the history at each new step: about the last ten steps decide
PRIOR_RATE, PRIOR_WEIGHT = 0.5, 2.0  # before any step: a = 0.5, worth two drafts


class DraftLength:
    def __init__(self, most: int, cost: float, least: int = 1):
        self.most, self.cost, self.least = most, cost, min(least, most)
        self.reset()

    def reset(self) -> None:
        """A new request: acceptance is each prompt's own."""
        self.accepted, self.rejected = PRIOR_RATE * PRIOR_WEIGHT, (1 - PRIOR_RATE) * PRIOR_WEIGHT

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def __call__(self) -> int:
        """Drafts to propose next step (least <= n <= most)."""
        a = self.rate
        if self.cost <= 0 or a >= 1:
            return self.most
        if a <= 0:
            return self.least
        n = math.floor(math.log(self.cost) / math.log(a))
        return max(self.least, min(self.most, n))

    def observe(self, proposed: int, accepted: int) -> None:
        """A verified chain of `proposed` drafts, of which the first `accepted` were accepted."""
        if proposed <= 0:
            return  # nothing drafted: says nothing about acceptance
        self.accepted = DECAY * self.accepted + accepted
        self.rejected = DECAY * self.rejected + (1.0 if accepted < proposed else 0.0)
