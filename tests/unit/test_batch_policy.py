"""The batch's speculation policy (runtime/batching/policy.py): draft sizes from measured costs."""

from __future__ import annotations

import numpy as np

from specdeploy.runtime.batching.policy import CostModel, SpeculationPolicy, expected_tokens, truncated
from specdeploy.runtime.drafters.base import Proposal
from specdeploy.runtime.tree import Tree


def cpu_like_costs() -> CostModel:
    """Shaped like SmolLM2 on 2 cores: a row costs little in a T=1 call, a token a lot alone."""
    costs = CostModel()
    for rows in (1, 2, 4, 8, 16):
        costs.observe(rows, 1, 0.020 + 0.004 * rows)
    for t in (2, 4, 9, 15):
        costs.observe(1, t, 0.020 + 0.0025 * t)
    return costs


def test_speculation_shrinks_to_plain_decoding_as_rows_join():
    policy = SpeculationPolicy(cpu_like_costs())
    sizes = [policy.draft_size(rows, rate=0.8, most=14) for rows in (1, 2, 4, 8, 16)]
    assert sizes[0] > 1 and sizes[-1] == 0
    assert all(a >= b for a, b in zip(sizes, sizes[1:]))


def test_draft_size_grows_with_acceptance_and_a_disabled_policy_drafts_all():
    policy = SpeculationPolicy(cpu_like_costs())
    sizes = [policy.draft_size(1, rate=r, most=14) for r in (0.01, 0.5, 0.9)]
    assert sizes[0] == 0 and sizes[0] < sizes[1] <= sizes[2]
    assert SpeculationPolicy(cpu_like_costs(), enabled=False).draft_size(16, 0.05, 14) == 14


def test_costs_interpolate_between_measured_shapes():
    costs = cpu_like_costs()
    assert np.isclose(costs.decode_s(3), (costs.decode_s(2) + costs.decode_s(4)) / 2)
    assert costs.decode_s(32) > costs.decode_s(16) and costs.single_s(20) > costs.single_s(15)
    costs.observe(1, 9, 1.0)  # online timings move the estimate (an average, not the last)
    assert 0.05 < costs.single_s(9) < 1.0


def test_expected_tokens_and_truncation_keep_a_tree():
    assert expected_tokens(0.0, 5) == 1 and np.isclose(expected_tokens(1.0, 5), 6)
    tree = Tree((-1, 0, 0, 1, 2, 3))
    p = Proposal(tree, np.arange(6, dtype=np.int64))
    cut = truncated(p, 3)
    assert cut.tree.parents == (-1, 0, 0, 1) and list(cut.tokens) == [0, 1, 2, 3]
    assert truncated(p, 9) is p
