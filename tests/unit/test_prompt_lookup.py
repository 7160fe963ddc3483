"""Prompt lookup's search (runtime/drafters/prompt_lookup.py): the longest suffix n-gram seen
before, its latest full match, runs, min_ngram."""

from __future__ import annotations

import numpy as np

from specdeploy.runtime.drafters.prompt_lookup import find_continuation


def test_find_continuation_longest_suffix_latest_full_match():
    t = np.array([1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3])
    assert find_continuation(t, 2, 3, 1).tolist() == [4, 9]  # suffix (1, 2, 3) first seen at 0
    assert find_continuation(t, 5, 2, 1).tolist() == [5, 7, 1, 2, 3]  # (2, 3): the latest earlier match
    assert find_continuation(t, 3, 1, 1).tolist() == [5, 7, 1]  # (3,) latest earlier match
    assert find_continuation(np.array([5, 1, 1, 1, 1]), 3, 2, 1).tolist() == [1, 1]  # in a run: the longest copy
    assert find_continuation(np.array([1, 1, 1, 1, 1, 1, 1]), 3, 2, 1).tolist() == [1, 1, 1]
    assert find_continuation(np.array([1, 2, 8]), 3, 3, 1).tolist() == []
    assert find_continuation(np.array([4, 2, 5, 2]), 4, 3, 2).tolist() == []  # min_ngram 2: (5, 2) never seen
