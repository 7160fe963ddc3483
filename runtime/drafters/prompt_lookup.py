"""Prompt lookup: copy the tokens that followed the latest earlier match of the suffix n-gram."""

from __future__ import annotations

import numpy as np

from ..config import positive_int
from ..errors import SpecDeployError
from ..tree import Tree
from .base import DecodeState, Drafter, Proposal


KEYS = ("k", "max_ngram", "min_ngram")


def validate(params: dict) -> dict:
    unknown = sorted(set(params) - set(KEYS))
    if unknown:
        raise SpecDeployError(f"config: unknown prompt-lookup keys {unknown} (expected {', '.join(KEYS)})")
    k = positive_int(params.get("k", 4), "prompt-lookup.k")
    max_n = positive_int(params.get("max_ngram", 3), "prompt-lookup.max_ngram")
    min_n = positive_int(params.get("min_ngram", 1), "prompt-lookup.min_ngram")
    if min_n > max_n:
        raise SpecDeployError(f"config: prompt-lookup.min_ngram ({min_n}) exceeds max_ngram ({max_n})")
    return {"k": k, "max_ngram": max_n, "min_ngram": min_n}


def verify_tokens(params: dict) -> int:
    return validate(params)["k"] + 1


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

    def __init__(self, k: int, max_ngram: int, min_ngram: int):
        self.k, self.max_ngram, self.min_ngram = k, max_ngram, min_ngram

    def propose(self, state: DecodeState) -> Proposal:
        tokens = np.asarray(state.tokens, dtype=np.int64)
        cont = find_continuation(tokens, self.k, self.max_ngram, self.min_ngram)
        return Proposal(Tree.chain(len(cont)), np.concatenate([tokens[-1:], cont]))
