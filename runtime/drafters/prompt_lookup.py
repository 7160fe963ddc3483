"""Prompt lookup: copy the tokens that followed the latest earlier match of the suffix n-gram."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..config import positive_int
from ..errors import SpecDeployError
from ..tree import Tree
from .acceptance import DEPTHS, RankAcceptance
from .base import DecodeState, Drafter, Proposal
from .step_costs import StepTimer, best_prefix, cost_fields, sized_by_steps


@dataclass(frozen=True)
class PromptLookupConfig:
    method: ClassVar[str] = "prompt-lookup"

    k: int = 14  # tokens copied per proposal; copying is free and a no-match step verifies the root
    #              alone, so a long k costs only on partial matches: +13% (code) / +42% (grounded)
    #              over k=4 (verify T = k + 1, the lookahead graph's size)
    max_ngram: int = 3  # longest suffix n-gram matched first
    min_ngram: int = 1
    # the prior shape of a step's time by verify size, in plain steps, until sizes are measured
    # (drafters/step_costs.py): call_cost for the first draft's row, row_cost for each after it; a chain
    # is only as long as its expected tokens per second say. Both 0: every copied token is verified
    # (rows are free, e.g. a GPU)
    call_cost: float = 0.2
    row_cost: float = 0.05

    def __post_init__(self):
        positive_int(self.k, "prompt-lookup.k")
        cost_fields(self, "prompt-lookup")
        positive_int(self.max_ngram, "prompt-lookup.max_ngram")
        positive_int(self.min_ngram, "prompt-lookup.min_ngram")
        if self.min_ngram > self.max_ngram:
            raise SpecDeployError(f"config: prompt-lookup.min_ngram ({self.min_ngram}) exceeds max_ngram "
                                  f"({self.max_ngram})")

    @property
    def verify_tokens(self) -> int:
        return self.k + 1


def build(export, config: PromptLookupConfig) -> PromptLookupDrafter:
    return PromptLookupDrafter(config.k, config.max_ngram, config.min_ngram, sized_by_steps(export, config))


def find_continuation(tokens: np.ndarray, k: int, max_ngram: int, min_ngram: int) -> np.ndarray:
    return find_match(tokens, k, max_ngram, min_ngram)[0]


def find_match(tokens: np.ndarray, k: int, max_ngram: int, min_ngram: int) -> tuple[np.ndarray, int]:
    """Up to k tokens that followed an earlier occurrence of the longest suffix n-gram
    (longest n first): the most recent occurrence followed by k tokens, else the one
    followed by the most (the earliest); and n. Empty (and 0) when nothing matches.

    Inside a repeated run the most recent occurrence overlaps the suffix and leaves
    only a token or two to copy; an earlier one copies the full k."""
    length = len(tokens)
    # ends[n-1]: end positions of the earlier n-grams equal to the suffix n-gram (the suffix
    # itself excluded), grown one token at a time: one pass over the context, then
    # only over the survivors. This runs every step, so it must stay cheap.
    ends = [np.flatnonzero(tokens[: length - 1] == tokens[-1])]
    for n in range(2, min(max_ngram, length - 1) + 1):
        e = ends[-1][ends[-1] >= n - 1]
        e = e[tokens[e - (n - 1)] == tokens[length - n]]
        if not len(e):
            break
        ends.append(e)
    for n in range(min(len(ends), max_ngram), min_ngram - 1, -1):
        hits = ends[n - 1]
        if len(hits):
            full = hits[hits + 1 + k <= length]
            start = int(full[-1] if len(full) else hits[0]) + 1
            return tokens[start : start + k], n
    return tokens[:0], 0


class PromptLookupDrafter(Drafter):
    name = "prompt-lookup"
    # a chain only as long as its acceptance pays for its rows (acceptance.py, step_costs.py)
    sizes_own_rows = True

    def __init__(self, k: int, max_ngram: int, min_ngram: int, timer: StepTimer | None = None):
        """`timer` None: every copied token is verified (rows are free)."""
        self.k, self.max_ngram, self.min_ngram, self.timer = k, max_ngram, min_ngram, timer
        self.copied = np.zeros(0, dtype=np.int64)  # this step's whole copy, before its length was chosen
        self.root = self.copied  # this step's root token ([1])
        self.matched = 0  # its n-gram's length
        self.rate = RankAcceptance(max_ngram + 1, DEPTHS)

    def start(self, state: DecodeState) -> None:
        # the first draft's acceptance per matched n-gram length (a longer match's copy is taken far more
        # often), each later one's per depth: each prompt's own
        self.rate = RankAcceptance(self.max_ngram + 1, DEPTHS)

    def propose(self, state: DecodeState) -> Proposal:
        if self.timer is not None:
            self.timer.proposing()
        tokens = np.asarray(state.tokens, dtype=np.int64)
        self.root = tokens[-1:]
        self.copied, self.matched = find_match(tokens, self.k, self.max_ngram, self.min_ngram)
        if self.timer is not None:
            return self.sized(self.timer.costs)
        return Proposal(Tree.chain(len(self.copied)), np.concatenate([self.root, self.copied]))

    def sized(self, costs) -> Proposal:
        n = len(self.copied)
        if n:
            n = best_prefix(self.rate.chain(n, self.matched), costs)
        return Proposal(Tree.chain(n), np.concatenate([self.root, self.copied[:n]]))

    def update(self, state, proposal, verdict, target_out) -> None:
        if self.timer is not None:
            self.timer.verified(proposal.size)
        if len(self.copied):  # the whole copy measured: the committed tokens (the bonus too) walked down it
            committed = state.tokens[len(state.tokens) - len(verdict.path):]
            whole = np.concatenate([proposal.tokens[:1], self.copied])
            self.rate.observe(Tree.chain(len(self.copied)), whole, committed, self.matched)
        self.copied = self.copied[:0]  # a step this drafter did not propose (a batch's plain one) measures nothing
