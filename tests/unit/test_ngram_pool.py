"""The n-gram pool lookahead drafts from (runtime/drafters/ngram_pool.py): LRU slots per first
token, a fixed capacity, n-grams taken from token streams."""

from __future__ import annotations

import pytest

from specdeploy.runtime.drafters.ngram_pool import NGramPool


def test_pool_lru_keys_and_capacity():
    pool = NGramPool(length=2, capacity=3)
    for cont in [(1, 2), (3, 4), (5, 6)]:
        pool.add(9, cont)
    assert pool.get(9) == [(5, 6), (3, 4), (1, 2)]  # most recent first
    pool.add(9, (1, 2))  # refreshed: now the most recent, (3, 4) the least
    pool.add(9, (7, 8))  # full: evicts the least recently used
    assert pool.get(9) == [(7, 8), (1, 2), (5, 6)]
    pool.add(4, (1, 2))  # another key has its own slots
    assert pool.get(4) == [(1, 2)] and len(pool.get(9)) == 3 and len(pool) == 4
    assert pool.get(123) == [] and 123 not in pool and 9 in pool
    with pytest.raises(ValueError):
        pool.add(9, (1, 2, 3))


def test_pool_takes_ngrams_keyed_by_first_token():
    pool = NGramPool(length=2, capacity=2)
    pool.add_ngrams([1, 2, 3, 1, 2, 4, 1, 5, 6, 1, 2, 3])
    assert pool.get(1) == [(2, 3), (5, 6)]  # (2, 4) evicted, (2, 3) refreshed last
    assert pool.get(2) == [(4, 1), (3, 1)]
    assert pool.get(3) == [(1, 2)] and 6 in pool
    pool.add_ngrams([1, 2, 3, 8, 9, 10], start=3)
    assert pool.get(8) == [(9, 10)] and pool.get(2) == [(4, 1), (3, 1)]
