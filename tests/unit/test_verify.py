"""Greedy verification of a draft tree (runtime/verify.py) on hand-built logits: the accepted path
follows the children whose token is the target's argmax, and the bonus token is the argmax at its end.
Seeded sampling is the same walk with the target's seeded draw in place of the argmax. (Sampling's
losslessness: tests/test_sampling_lossless.py; seed-exactness per method: tests/test_seed_exact.py.)"""

from __future__ import annotations

import numpy as np

from specdeploy.runtime.sampling import PositionNoise, SamplingParams
from specdeploy.runtime.tree import Tree
from specdeploy.runtime.verify import verify, verify_greedy

VOCAB = 8


def logits_preferring(*best: int) -> np.ndarray:
    """One row per node: row i's argmax is best[i]."""
    out = np.zeros((len(best), VOCAB), np.float32)
    out[np.arange(len(best)), best] = 1.0
    return out


def test_greedy_follows_the_argmax_child_and_takes_the_bonus():
    # root 0 -> 1 (tok 3), 2 (tok 5); 1 -> 3 (tok 4), 4 (tok 6); 2 -> 5 (tok 7)
    tree = Tree(parents=(-1, 0, 0, 1, 1, 2))
    tokens = np.array([9, 3, 5, 4, 6, 7])
    v = verify_greedy(tree, tokens, logits_preferring(5, 0, 7, 0, 0, 2))
    assert v.path == [0, 2, 5] and v.next_token == 2 and v.accepted_drafts == 2  # second sibling, to a leaf
    v = verify_greedy(tree, tokens, logits_preferring(3, 6, 0, 0, 1, 0))
    assert v.path == [0, 1, 4] and v.next_token == 1
    v = verify_greedy(tree, tokens, logits_preferring(1, 0, 0, 0, 0, 0))  # no child is the argmax
    assert v.path == [0] and v.next_token == 1 and v.accepted_drafts == 0


def test_a_rejected_node_ends_the_path_at_its_parent():
    tree = Tree.chain(3)
    tokens = np.array([9, 2, 3, 4])
    v = verify_greedy(tree, tokens, logits_preferring(2, 3, 5, 0))  # the third draft (4) is not the argmax (5)
    assert v.path == [0, 1, 2] and v.next_token == 5


def test_temperature_zero_is_greedy_whatever_the_rng():
    tree = Tree.chain(2)
    tokens = np.array([0, 6, 1])
    logits = logits_preferring(6, 1, 3)
    for seed in range(3):
        v = verify(tree, tokens, logits, SamplingParams(), np.random.default_rng(seed))
        assert v.path == [0, 1, 2] and v.next_token == 3


def test_seeded_follows_the_child_that_is_the_targets_own_sample():
    """Node n's choice is the target's seeded draw for index root + depth(n) + 1; siblings at one
    depth share that index's noise, so the walk is the plain seeded decode of the target."""
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(6, VOCAB)) * 2
    params = SamplingParams(temperature=1.0)
    tree = Tree(parents=(-1, 0, 0, 1, 1, 2))  # depths 0, 1, 1, 2, 2, 2
    root = 40
    for seed in range(30):
        noise = PositionNoise(seed)
        draw = lambda node: noise.sample(params.probs(logits[node]), root + 1 + int(tree.depth[node]))  # noqa: E731
        first, other = draw(0), (draw(0) + 1) % VOCAB
        # Under node 1: a wrong sibling, then the target's draw; under node 2: the draw.
        deeper = [(draw(1) + 1) % VOCAB, draw(1), draw(2)]
        for tokens, via, leaf in ((np.array([9, first, other, *deeper]), 1, 4),
                                  (np.array([9, other, first, *deeper]), 2, 5)):
            v = verify(tree, tokens, logits, params, None, noise=PositionNoise(seed), root=root)
            assert v.path == [0, via, leaf] and v.next_token == draw(leaf)
        v = verify(tree, np.array([9, other, (first + 2) % VOCAB, *deeper]), logits, params, None,
                   noise=PositionNoise(seed), root=root)
        assert v.path == [0] and v.next_token == first  # nothing matched: the bonus is the root's own draw
