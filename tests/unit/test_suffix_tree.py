"""The suffix tree and its cross-request cache (runtime/drafters/suffix_tree.py) on synthetic
token streams: exact counts, longest match, proposals best-first within the node budget, oldest-first
eviction, memory flat over 10,000 requests; and one cache per export (runtime/drafters/suffix.py)."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from specdeploy.runtime.drafters.suffix import SuffixConfig, SuffixDrafter, build
from specdeploy.runtime.drafters.suffix_tree import SuffixCache, SuffixTree


def occurrences(seqs, s) -> int:
    m = len(s)
    return sum(S[i:i + m] == s for S in seqs for i in range(len(S) - m + 1))


def explicit_nodes(node) -> int:
    return 1 + sum(explicit_nodes(c) for c in (node.kids or {}).values())


def assert_counts_exact(tree: SuffixTree, alphabet: int) -> None:
    """Every string up to the depth (present or not) counts its occurrences; the node tally holds."""
    seqs = list(tree.seqs.values())
    strings = {tuple(S[i:i + m]) for S in seqs for i in range(len(S)) for m in range(1, tree.depth + 1)
               if i + m <= len(S)}
    strings |= {tuple(random.randrange(alphabet) for _ in range(random.randint(1, tree.depth))) for _ in range(10)}
    for s in strings:
        assert tree.count(s) == occurrences(seqs, list(s)), s
    assert explicit_nodes(tree.root) == tree.nodes


def test_counts_stay_exact_through_interleaved_appends_and_removals():
    """Small alphabets repeat a lot: tails get split, other sequences' tails under a walk."""
    rng = random.Random(0)
    random.seed(1)
    for _ in range(120):
        depth, alphabet = rng.randint(1, 6), rng.randint(1, 4)
        tree, growing, next_id = SuffixTree(depth), [], 0
        for _ in range(rng.randint(1, 25)):
            r = rng.random()
            if r < 0.15 and tree.seqs:
                victim = rng.choice(list(tree.seqs))
                tree.remove(victim)
                growing = [s for s in growing if s != victim]
            elif r < 0.3 or not growing:
                growing.append(next_id)
                tree.extend(next_id, [rng.randrange(alphabet) for _ in range(rng.randint(0, 5))])
                next_id += 1
            else:
                seq = rng.choice(growing)
                tree.extend(seq, [rng.randrange(alphabet) for _ in range(rng.randint(1, 4))])
                if rng.random() < 0.1:
                    tree.close(seq)
                    growing.remove(seq)
            assert_counts_exact(tree, alphabet)
        for seq in list(tree.seqs):
            tree.remove(seq)
        assert tree.nodes == 1 and tree.root.kids is None


def test_append_is_incremental_and_unrepeated_text_stays_small():
    """Each sequence keeps at most depth suffix locations (the work of one append), and text
    that does not repeat costs a few nodes per token, not depth of them."""
    rng = random.Random(2)
    tree = SuffixTree(22)
    tokens = [rng.randrange(50_000) for _ in range(5_000)]
    for t in tokens:
        tree.extend(0, [t])
        assert len(tree._active[0]) < tree.depth
    assert tree.nodes < 2 * len(tokens)
    assert tree.count(tokens[100:120]) == 1 and tree.count(tokens[:1]) == tokens.count(tokens[0])
    # the same text again: now every substring up to the depth is shared, each one node
    tree.extend(1, tokens)
    assert tree.count(tokens[100:122]) == 2 and tree.nodes <= len(tokens) * tree.depth


def test_longest_match_skips_the_context_itself():
    tree = SuffixTree(8)
    text = [1, 2, 3, 4, 9, 2, 3, 4, 7, 3, 4]
    tree.extend(0, text)
    m, _ = tree.longest_match(text, 8)
    assert m == 2  # "3 4" occurs twice before the end ("2 3 4" too, but "7 3 4" never did)
    assert tree.longest_match(text, 1)[0] == 1
    assert tree.longest_match([5, 6], 8) == (0, None)
    assert tree.longest_match([1, 2, 3], 8)[0] == 3  # another context: the stored text continues it


def test_draft_is_best_first_by_frequency_within_budget():
    tree = SuffixTree(10)
    # after "5": "6 7" three times, "8" twice, "9" once
    tree.extend(0, [5, 6, 7, 0, 5, 6, 7, 1, 5, 8, 2, 5, 6, 7, 3, 5, 8, 4, 5, 9, 0])
    draft = tree.draft([99, 5], max_len=4, max_nodes=4, min_prob=0.0)
    assert draft.match == 1 and len(draft.tokens) == 4
    assert draft.tokens[:2] == (6, 7) and draft.parents[:2] == (-1, 0)
    assert draft.probs[0] == pytest.approx(3 / 6) and draft.probs[1] == pytest.approx(3 / 6)
    assert draft.tokens[2] == 8 and draft.parents[2] == -1 and draft.probs[2] == pytest.approx(2 / 6)
    assert all(p < i for i, p in enumerate(draft.parents))
    assert list(draft.probs) == sorted(draft.probs, reverse=True)
    # min_prob drops the rare branch; a budget of one keeps the likeliest token
    assert 9 not in tree.draft([99, 5], 4, 14, min_prob=0.2).tokens
    assert tree.draft([99, 5], 4, 1, 0.0).tokens == (6,)
    assert tree.draft([99, 5], 4, 14, 0.0).score == pytest.approx(sum(tree.draft([99, 5], 4, 14, 0.0).probs))


def test_cache_evicts_oldest_first_and_stops_at_its_size():
    cache = SuffixCache(depth=4, max_tokens=10)
    a = cache.begin()
    cache.extend(a, [1, 2, 3, 4, 5, 6])
    b = cache.begin()
    cache.extend(a, [7])  # a stopped growing when b began
    cache.extend(b, [1, 2, 3])
    assert cache.tokens == 9 and cache.tree.count([1, 2, 3]) == 2
    cache.extend(b, [8, 8])  # over 10: a goes
    assert cache.tokens == 5 and len(cache) == 1 and cache.tree.count([1, 2, 3]) == 1
    cache.extend(b, list(range(20, 40)))  # longer than the cache: truncated
    assert cache.tokens == 10 and cache.tree.count([20, 21, 22, 23]) == 1 and cache.tree.count([25]) == 0


def synthetic_request(rng: random.Random) -> list[int]:
    """Agent-like traffic: one of a few task templates with a varied part."""
    template = rng.randrange(8)
    body = [template * 100 + i for i in range(rng.randint(6, 16))]
    noise = [rng.randrange(5_000) for _ in range(rng.randint(0, 6))]
    return body[: len(body) // 2] + noise + body[len(body) // 2:]


def test_cache_memory_stays_flat_over_10000_requests():
    rng = random.Random(3)
    cache = SuffixCache(depth=8, max_tokens=2_000)
    tracemalloc.start()
    try:
        sizes = {}
        for i in range(1, 10_001):
            seq = cache.begin()
            for t in synthetic_request(rng):  # one token per decode step
                cache.extend(seq, [t])
            assert cache.tokens <= 2_000
            if i in (1_000, 10_000):
                sizes[i] = tracemalloc.get_traced_memory()[0]
                assert cache.tree.nodes <= cache.max_tokens * cache.tree.depth
                assert len(cache.tree._active) == 1  # only the growing sequence keeps suffix locations
    finally:
        tracemalloc.stop()
    assert sizes[10_000] < 1.25 * sizes[1_000], sizes
    assert len(cache) < 250  # ~2,000 / 14 tokens per request


def test_the_cache_belongs_to_one_export():
    class FakeExport:  # LoadedExport.part: one object per key per instance
        times_steps = True

        def __init__(self):
            self.parts = {}

        def part(self, key, opener):
            return self.parts.setdefault(key, opener())

    one, other = FakeExport(), FakeExport()
    config = SuffixConfig()
    assert build(one, config).cache is build(one, config).cache
    assert build(one, config).cache is not build(other, config).cache
    assert build(one, SuffixConfig(cache_tokens=0)).cache is None
    assert isinstance(build(one, config), SuffixDrafter)
