"""Draft length from acceptance (runtime/drafters/draft_length.py): long chains while drafts are
accepted, short ones when they are not, k when rows are free."""

from __future__ import annotations

from specdeploy.runtime.drafters.draft_length import DraftLength


def test_length_follows_acceptance():
    length = DraftLength(most=14, cost=0.05)
    assert length() == 4  # the prior: a = 0.5, 0.5^4 >= 0.05 > 0.5^5
    for _ in range(20):  # every draft rejected
        length.observe(length(), 0)
    assert length() == 1
    for _ in range(30):  # every draft accepted: no rejection seen, a -> 1
        length.observe(length(), length())
    assert length() == 14
    length.reset()
    assert length() == 4


def test_free_rows_and_empty_steps():
    free = DraftLength(most=9, cost=0.0)
    free.observe(9, 0)
    assert free() == 9
    length = DraftLength(most=14, cost=0.05)
    before = length.rate
    length.observe(0, 0)  # nothing drafted: no evidence
    assert length.rate == before
