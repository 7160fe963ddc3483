"""Static draft trees (runtime/tree.py): every shipped tree's buffers (parents, ranks, depths,
ancestor mask, leaf paths, padding) agree with its paths, and malformed trees are one clear error."""

from __future__ import annotations

import numpy as np
import pytest

from specdeploy.runtime.errors import SpecDeployError
from specdeploy.runtime.tree import Tree
from specdeploy.runtime.tree_files import resolve_tree, tree_names


def test_trees_are_shipped():
    assert {"mc_sim_7b_63", "eagle1_mc_sim_7b_63", "medusa_cpu_8"} <= set(tree_names())


@pytest.mark.parametrize("name", tree_names())
def test_shipped_tree_buffers_are_consistent(name):
    paths = resolve_tree(name)[1]
    tree = Tree.from_paths(paths)
    assert tree.size == len(paths) + 1
    # Each node's rank path, rebuilt from parents and ranks, is exactly one input path.
    node_path = [()] + [tuple(tree.ranks[j] for j in tree.path_to(i)[1:]) for i in range(1, tree.size)]
    assert sorted(node_path[1:]) == sorted(map(tuple, paths))
    for i, p in enumerate(node_path):
        assert tree.depth[i] == len(p)  # position offset = depth
        ancestors = {j for j, q in enumerate(node_path) if p[: len(q)] == q}  # root, ancestors, itself
        assert set(np.flatnonzero(tree.mask[i])) == ancestors
    leaves = tree.leaf_paths  # Medusa's retrieve indices
    assert {n for path in leaves for n in path} == set(range(tree.size))
    for path in leaves:
        assert path[0] == 0 and all(tree.parents[b] == a for a, b in zip(path, path[1:]))
        assert not tree.children[path[-1]]
    assert len(leaves) == sum(1 for i in range(tree.size) if not tree.children[i])
    padded = tree.padded_mask(tree.size + 3)
    assert (padded[: tree.size, : tree.size] == tree.mask).all() and padded[tree.size:, tree.size:].trace() == 3


def test_tree_builder_rejects_malformed_trees():
    for bad, what in [([[0, 1]], "prefix"), ([[0], [0]], "twice"), ([[-1]], "rank"), ([], "non-empty"),
                      ([["a"]], "integer")]:
        with pytest.raises(SpecDeployError, match=what):
            Tree.from_paths(bad)
    with pytest.raises(SpecDeployError, match="rank"):
        Tree.from_paths([[0], [5]], max_rank=4)
    with pytest.raises(SpecDeployError, match="exceed the verify graph's 9 tokens"):
        Tree.from_paths([[r] for r in range(9)], max_size=9)
    tree = Tree.from_paths([[0], [1], [0, 0]])
    with pytest.raises(SpecDeployError, match="does not fit"):
        tree.padded_mask(3)


def test_chain_is_a_causal_mask():
    tree = Tree.chain(3)
    assert tree.parents == (-1, 0, 1, 2) and tree.depth.tolist() == [0, 1, 2, 3]
    assert (tree.mask == np.tril(np.ones((4, 4), bool))).all() and tree.leaf_paths == [[0, 1, 2, 3]]
