"""Seeded and rejection verification accept a merged (fused) draft tree equally often.

A fused tree offers siblings from two drafters (a copy's token beside a head's guess). Seeded
verification accepts the child equal to the target's own sample at that position, rejection
sampling each sibling in turn with p(x) of the renormalized residual: both take child x with
probability p(x), so the expected accepted drafts are the same, sum over nodes of the product
of p along the node's path. Checked here by Monte Carlo against that exact sum on a hand-built
tree; tests/perf_seeded.py measures both schemes on the real export."""

from __future__ import annotations

import numpy as np

from specdeploy.runtime.sampling import PositionNoise, SamplingParams
from specdeploy.runtime.tree import Tree
from specdeploy.runtime.verify import verify_sampling, verify_seeded

# root 0 -> 1 (a copy: 2 -> 3 -> 4) and 5 (a head's guess: -> 6); tokens over a vocabulary of 6
TREE = Tree((-1, 0, 1, 2, 0, 4))
TOKENS = np.array([0, 2, 3, 4, 1, 5])
PARAMS = SamplingParams(temperature=0.7, sampling="seeded")


def logits() -> np.ndarray:
    return np.random.default_rng(7).normal(0, 1.5, size=(TREE.size, 6))


def expected_accepted(lg: np.ndarray) -> float:
    reach = np.zeros(TREE.size)
    reach[0] = 1.0
    for node in range(1, TREE.size):
        parent = TREE.parents[node]
        reach[node] = reach[parent] * PARAMS.probs(lg[parent])[TOKENS[node]]
    return float(reach[1:].sum())


def test_seeded_and_rejection_accept_a_merged_tree_equally_often():
    lg, runs = logits(), 4000
    seeded = [verify_seeded(TREE, TOKENS, lg, PARAMS, PositionNoise(seed), root=10).accepted_drafts
              for seed in range(runs)]
    rng = np.random.default_rng(0)
    rejection = [verify_sampling(TREE, TOKENS, lg, PARAMS, rng).accepted_drafts for _ in range(runs)]
    exact = expected_accepted(lg)
    assert 0.3 < exact < 1.5  # both branches matter
    for got in (seeded, rejection):
        assert abs(np.mean(got) - exact) < 4 * np.std(got) / np.sqrt(runs), (np.mean(got), exact)
