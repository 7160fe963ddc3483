"""Prompt lookup: copy the tokens that followed the latest earlier match of the suffix n-gram."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..config import positive_int
from ..errors import SpecDeployError
from ..tree import Tree
from .base import DecodeState, Drafter, Proposal
from .draft_length import DraftLength


@dataclass(frozen=True)
class PromptLookupConfig:
    method: ClassVar[str] = "prompt-lookup"

    k: int = 14  # tokens copied per proposal; copying is free and a no-match step verifies the root
    #              alone, so a long k costs only on partial matches: +13% (code) / +42% (grounded)
    #              over k=4 (verify T = k + 1, the lookahead graph's size)
    max_ngram: int = 3  # longest suffix n-gram matched first
    min_ngram: int = 1
    # cost of one more verify row, in plain decode steps: copy only as many tokens as the
    # acceptance so far pays for (drafters/draft_length.py); 0: always up to k (rows are free, a GPU)
    row_cost: float = 0.05

    def __post_init__(self):
        positive_int(self.k, "prompt-lookup.k")
        if isinstance(self.row_cost, bool) or not isinstance(self.row_cost, (int, float)) or not \
                0 <= self.row_cost < 1:
            raise SpecDeployError(f"config: prompt-lookup.row_cost must be a number in [0, 1), got {self.row_cost!r}")
        positive_int(self.max_ngram, "prompt-lookup.max_ngram")
        positive_int(self.min_ngram, "prompt-lookup.min_ngram")
        if self.min_ngram > self.max_ngram:
            raise SpecDeployError(f"config: prompt-lookup.min_ngram ({self.min_ngram}) exceeds max_ngram "
                                  f"({self.max_ngram})")

    @property
    def verify_tokens(self) -> int:
        return self.k + 1


def build(export, config: PromptLookupConfig) -> PromptLookupDrafter:
    return PromptLookupDrafter(config.k, config.max_ngram, config.min_ngram, config.row_cost)


def find_continuation(tokens: np.ndarray, k: int, max_ngram: int, min_ngram: int) -> np.ndarray:
    """Up to k tokens that followed an earlier occurrence of the longest suffix n-gram
    (longest n first): the most recent occurrence followed by k tokens, else the one
    followed by the most (the earliest). Empty when nothing matches.

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
            return tokens[start : start + k]
    return tokens[:0]


class PromptLookupDrafter(Drafter):
    name = "prompt-lookup"
    sizes_own_rows = True  # DraftLength: a chain only as long as its acceptance pays for

    def __init__(self, k: int, max_ngram: int, min_ngram: int, row_cost: float = 0.0):
        self.k, self.max_ngram, self.min_ngram = k, max_ngram, min_ngram
        self.length = DraftLength(k, row_cost)

    def start(self, state: DecodeState) -> None:
        self.length.reset()

    def propose(self, state: DecodeState) -> Proposal:
        tokens = np.asarray(state.tokens, dtype=np.int64)
        cont = find_continuation(tokens, self.length(), self.max_ngram, self.min_ngram)
        return Proposal(Tree.chain(len(cont)), np.concatenate([tokens[-1:], cont]))

    def update(self, state, proposal, verdict, target_out) -> None:
        self.length.observe(proposal.tree.size - 1, verdict.accepted_drafts)
