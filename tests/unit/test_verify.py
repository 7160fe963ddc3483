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


def test_exact_rows_emit_an_off_chain_match_but_do_not_follow_it():
    """A quantized target's rows outside the tree's leading chain are not sequential decoding's
    (verify.py): the accepted off-chain child becomes the next token, and its subtree is ignored."""
    tree = Tree(parents=(-1, 0, 1, 0, 3))  # leading chain 0-1-2; 3 (a sibling of 1) -> 4
    assert tree.chain_rows == 3
    tokens = np.array([9, 3, 4, 5, 6])
    logits = logits_preferring(5, 4, 1, 6, 2)
    assert verify_greedy(tree, tokens, logits).path == [0, 3, 4]  # every row trusted
    v = verify_greedy(tree, tokens, logits, exact_rows=tree.chain_rows)
    assert v.path == [0] and v.next_token == 5  # node 3's token, from the root's exact row
    v = verify_greedy(tree, tokens, logits_preferring(3, 4, 1, 0, 0), exact_rows=tree.chain_rows)
    assert v.path == [0, 1, 2] and v.next_token == 1  # along the chain nothing changes
    # sampling: whatever the scheme, an emitted token comes from a trusted row
    params = SamplingParams(temperature=1.0)
    for seed in range(20):
        for kwargs in ({"noise": PositionNoise(seed), "root": 30}, {}):
            v = verify(tree, tokens, np.log(np.full((5, VOCAB), 1.0 / VOCAB)) + logits * 3, params,
                       np.random.default_rng(seed), exact_rows=tree.chain_rows, **kwargs)
            assert all(node < tree.chain_rows for node in v.path)


def test_preorder_puts_each_first_child_after_its_parent():
    from specdeploy.runtime.decoder import StepOutput
    from specdeploy.runtime.drafters.base import Proposal
    from specdeploy.runtime.generate import in_proposal_order
    from specdeploy.runtime.verify import Verdict

    tree = Tree(parents=(-1, 0, 0, 1, 2, 3))  # breadth-first: root, 1, 2, then their children
    assert tree.chain_rows == 2 and tree.preorder == (0, 1, 3, 5, 2, 4)
    flat = tree.reordered(tree.preorder)
    assert flat.parents == (-1, 0, 1, 2, 0, 4) and flat.chain_rows == 4
    assert (flat.depth == tree.depth[list(tree.preorder)]).all()
    aux_mask = np.zeros((1, 7), bool)
    aux_mask[0, [0, 6]] = True
    prop = Proposal(tree, np.arange(10, 16), aux_tokens=np.array([99]), aux_positions=np.array([1]), aux_mask=aux_mask)
    call = prop.reordered(tree.preorder)
    assert call.tokens.tolist() == [10, 11, 13, 15, 12, 14] and (call.aux_mask == aux_mask).all()
    rows = np.arange(7, dtype=np.float32)[:, None]  # call row r holds r
    verdict, out = in_proposal_order(Verdict([0, 1, 2], 7), StepOutput(rows, rows, []), tree.preorder, 7)
    assert verdict.path == [0, 1, 3]  # the same nodes in the proposal's ids
    assert out.hidden[:, 0].tolist() == [0, 1, 4, 2, 5, 3, 6]  # node j's row, aux row last
