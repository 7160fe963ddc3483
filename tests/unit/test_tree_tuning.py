"""Tree search for `tune-tree` (runtime/tree_tuning.py) on synthetic acceptance rates and timings:
the greedy construction is optimal per size, and the chosen tree trades acceptance for call time."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from specdeploy.runtime.errors import SpecDeployError
from specdeploy.runtime.tree_tuning import (
    TimeModel,
    chain_rates,
    choose_tree,
    empirical_expected_tokens,
    greedy_order,
)


def test_greedy_tree_construction_is_optimal_per_size():
    rates = np.array([[0.5, 0.3, 0.1], [0.7, 0.2, 0.05]])
    order = greedy_order(rates, 20)
    universe = [(a,) for a in range(3)] + [(a, b) for a in range(3) for b in range(3)]
    value = lambda p: float(np.prod([rates[d, r] for d, r in enumerate(p)]))  # noqa: E731
    for n in range(1, len(universe) + 1):
        prefix = {p for p, _ in order[:n]}
        assert all(len(p) == 1 or p[:-1] in prefix for p in prefix)  # every prefix is a valid tree
        best = max(sum(value(p) for p in s) for s in itertools.combinations(universe, n)
                   if all(len(p) == 1 or p[:-1] in s for p in s))
        assert sum(value(p) for p in prefix) == pytest.approx(best)


def test_choose_tree_trades_acceptance_for_time():
    rates = np.array([[0.6, 0.2, 0.1, 0.05]] * 4)
    flat = choose_tree(rates, TimeModel([(1, 1e-3), (64, 1e-3)]), max_nodes=40)
    steep = choose_tree(rates, TimeModel([(1, 1e-3), (2, 1.3e-3), (64, 30e-3)]), max_nodes=40)
    assert len(flat.paths) == 40 and 1 <= len(steep.paths) < 8
    assert flat.expected_tokens > steep.expected_tokens
    # Noisy timings never make a bigger call cheaper.
    noisy = TimeModel([(1, 1e-3), (16, 3e-3), (27, 2e-3)])
    assert noisy.verify(27) >= noisy.verify(16) and noisy.verify(40) >= noisy.verify(27)
    # Greedy acceptance of recorded steps: the longest tree path along the actual ranks, plus the bonus.
    matched = [(0, 0, 2), (1, 0), (2,), ()]
    assert empirical_expected_tokens([[0], [0, 0], [1]], matched) == pytest.approx((3 + 2 + 1 + 1) / 4)


def test_a_target_held_to_exact_rows_gets_a_chain():
    """Its verification follows only the leading chain (runtime/verify.py, exact_rows): a side node costs a
    verify row and adds no token, so the tuner builds the chain of first-ranked guesses alone."""
    rates = np.array([[0.6, 0.3, 0.1]] * 5)
    model = TimeModel([(1, 1e-3), (64, 2e-3)])
    assert any(any(p) for p in choose_tree(rates, model, max_nodes=30).paths)  # a tree where side nodes pay
    chain = choose_tree(chain_rates(rates), model, max_nodes=30)
    assert chain.paths == [[0] * d for d in range(1, 6)]
    assert chain.expected_tokens == pytest.approx(1 + sum(0.6 ** d for d in range(1, 6)))
    assert chain_rates(rates)[:, 0].tolist() == rates[:, 0].tolist()  # the rates themselves untouched


def test_tree_out_that_is_no_tree_file_is_refused_unread(tmp_path):
    """tune-tree's --out: a device or pipe is never opened (reading /dev/stdout could block), a big file
    (a model given by mistake) is not read whole, and neither is overwritten."""
    from specdeploy.runtime.tree_tuning import MAX_TREE_BYTES, TREE_SOURCE, check_tree_out

    with pytest.raises(SpecDeployError, match="--out /dev/null is not a regular file"):
        check_tree_out("/dev/null")
    big = tmp_path / "model.onnx"
    with open(big, "wb") as f:
        f.truncate(MAX_TREE_BYTES + 1)
    with pytest.raises(SpecDeployError, match="is not a tree written by `specdeploy tune-tree`"):
        check_tree_out(big)
    ours = tmp_path / "tree.json"
    ours.write_text(json.dumps({"source": TREE_SOURCE, "paths": [[0]]}))
    check_tree_out(ours)  # one it wrote may be replaced
