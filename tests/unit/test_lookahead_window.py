"""Lookahead's packed call, on index arrays alone (runtime/drafters/lookahead.py): the Jacobi
window's visibility and position offsets, and the trie that merges the pool's candidates."""

from __future__ import annotations

import numpy as np

from specdeploy.runtime.drafters.lookahead import trie, window_layout


def test_window_layout_is_a_causal_run_per_cell():
    visible, offsets = window_layout(3, 4)
    # cell (2, 1) at flat index 7 sees (0, 0..1), (1, 1), (2, 1): positions 0, 1, 2, 3
    assert np.flatnonzero(visible[7]).tolist() == [0, 1, 4, 7]
    assert offsets[[0, 1, 4, 7]].tolist() == [0, 1, 2, 3]
    assert visible.sum(1).tolist() == [1, 2, 3, 2, 3, 4, 3, 4, 5]


def test_trie_merges_shared_prefixes():
    tree, tokens = trie(7, [(1, 2, 3), (1, 2, 4), (5, 6, 7), (1, 2, 3)])
    assert tokens.tolist() == [7, 1, 2, 3, 4, 5, 6, 7]
    assert tree.parents == (-1, 0, 1, 2, 2, 0, 5, 6)
