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


def test_after_a_plain_step_the_probe_is_the_candidates_alone():
    """A plain step leaves the window stale (its outputs are harvested only N-2 steps later), so the
    next drafting step, the adaptive policy's probe, verifies the pool's candidates without the
    window's rows; a probe that verified candidates brings the window back."""
    from specdeploy.runtime.drafters.base import DecodeState, Proposal
    from specdeploy.runtime.drafters.lookahead import LookaheadDrafter
    from specdeploy.runtime.sampling import SamplingParams
    from specdeploy.runtime.verify import Verdict

    la = LookaheadDrafter(window=3, ngram=4, guesses=2)
    s = DecodeState([5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], SamplingParams(), np.random.default_rng(0))
    la.start(s)
    first = la.propose(s)
    assert first.aux_tokens is not None and len(first.aux_tokens) == 8  # the window's cells but the root
    for nxt in (8, 5, 6):  # steps that verified the root alone (plain, or a probe with no candidate)
        s.tokens.append(nxt)
        la.update(s, Proposal.root_only(s.tokens[-2]), Verdict([0], nxt), None)
    probe = la.propose(s)  # root 6: the pool holds 6 -> (7, 8, 5)
    assert probe.aux_tokens is None and probe.size == probe.tree.size > 1
    assert probe.tokens[1:4].tolist() == [7, 8, 5]
    s.tokens.extend([7, 8])  # the probe verified its candidates: one accepted, the bonus 8
    la.update(s, probe, Verdict([0, 1], 8), None)
    back = la.propose(s)
    assert back.aux_tokens is not None and len(back.aux_tokens) == 8  # the window is back
