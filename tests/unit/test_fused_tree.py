"""Fused drafting's tree work (runtime/drafters/fused.py) on hand-built trees: the merge keeps
the node budget, a candidate both parts propose is one node, a node goes in while it is worth a
verify row (by its part's measured per-draft acceptance, and what the other part's sibling leaves),
best first. On exports: tests/test_fused_drafting.py."""

from __future__ import annotations

import time

import numpy as np
import pytest

from specdeploy.runtime.drafters.base import BatchPrice, DecodeState, Drafter, Proposal
from specdeploy.runtime.drafters.fused import (
    PROBE_AFTER,
    EagleSuffixConfig,
    FusedDrafter,
    LookaheadSuffixConfig,
)
from specdeploy.runtime.drafters.lookahead import LookaheadDrafter
from specdeploy.runtime.drafters.step_costs import StepCosts, StepTimer
from specdeploy.runtime.drafters.tree_budget import MergedTree, PartProposal, RankAcceptance, merge, walked
from specdeploy.runtime.errors import SpecDeployError
from specdeploy.runtime.methods import method_spec
from specdeploy.runtime.sampling import PositionNoise, SamplingParams
from specdeploy.runtime.tree import Tree
from specdeploy.runtime.verify import Verdict


class Fixed(Drafter):
    """Proposes the same tree every step (the tokens after the root are fixed)."""

    def __init__(self, parents: tuple[int, ...], tokens: list[int]):
        self.tree, self.tokens = Tree(parents), tokens

    def propose(self, state):
        return Proposal(self.tree, np.array([state.tokens[-1], *self.tokens], dtype=np.int64))


def paths(proposal: Proposal) -> set[tuple[int, ...]]:
    """Every root-to-node token path of a proposal (the root's token left out)."""
    t = proposal.tree
    return {tuple(int(proposal.tokens[n]) for n in t.path_to(i)[1:]) for i in range(1, t.size)}


def state() -> DecodeState:
    return DecodeState([1, 2, 3], SamplingParams(), np.random.default_rng(0))


def fused(a: Drafter, b: Drafter, **config) -> FusedDrafter:
    config.setdefault("row_cost", 0.0)  # rows are free: the budget alone limits the tree
    d = FusedDrafter(EagleSuffixConfig(**config), [a, b])
    d.start(state())
    return d


def test_shared_candidates_are_one_node_and_cost_the_budget_once():
    # a: 10 -> 11 -> 12 (chain); b: 10 -> 11 -> 13 and 10 -> 14
    a = Fixed((-1, 0, 1, 2), [10, 11, 12])
    b = Fixed((-1, 0, 1, 2, 1), [10, 11, 13, 14])
    p = fused(a, b, nodes=6).propose(state())
    assert paths(p) == {(10,), (10, 11), (10, 11, 12), (10, 11, 13), (10, 14)}
    assert p.tree.size == 6  # 5 candidates: the shared 10 -> 11 counted once
    assert len({tuple(x) for x in (p.tree.path_to(i) for i in range(p.tree.size))}) == p.tree.size
    children = [(int(p.tokens[c]), parent) for parent, kids in enumerate(p.tree.children) for c in kids]
    assert len(children) == len(set(children))  # no two siblings hold the same token


@pytest.mark.parametrize("nodes", [2, 3, 5, 8])
def test_the_merged_tree_keeps_the_node_budget_and_is_a_tree(nodes):
    a = Fixed((-1, 0, 1, 2, 3, 4, 5), [20, 21, 22, 23, 24, 25])  # a long copy
    b = Fixed((-1, 0, 0, 1, 1, 2, 3), [30, 31, 32, 33, 34, 35])  # a bushy head tree
    d = fused(a, b, nodes=nodes)
    p = d.propose(state())
    assert p.tree.size == nodes + 1  # both parts had more than enough: the budget is used, not exceeded
    assert p.tokens[0] == 3 and len(p.tokens) == p.tree.size
    assert paths(p) <= {q for q in paths(a.propose(state())) | paths(b.propose(state()))}


def test_a_part_with_nothing_to_propose_leaves_the_whole_budget_to_the_other():
    a = Fixed((-1,), [])
    b = Fixed((-1, 0, 1, 2, 3, 4), [5, 6, 7, 8, 9])
    p = fused(a, b, nodes=4).propose(state())
    assert paths(p) == {(5,), (5, 6), (5, 6, 7), (5, 6, 7, 8)}


def geometric(a: float) -> RankAcceptance:
    """A part measured to take its rank-r child with chance a^(1 + r) (the prior's shape at a = 0.5)."""
    rates = RankAcceptance()
    rates.hits = [[a ** (1 + r) * o for r, o in enumerate(rates.offered[0])]]
    return rates


def _merge(trees, rates, budget, row_cost=0.0):
    """merge() over Fixed proposals (each part's rank-r child worth a^(1 + r)): the merged tree's paths."""
    parts = [PartProposal(Fixed(parents, tokens).propose(state())) for parents, tokens in trees]
    return paths(merge(parts, [geometric(a) for a in rates], budget, row_cost, root=3).proposal())


def test_merge_takes_the_best_nodes_first_and_parents_before_children():
    # children listed likeliest first: 10, 11, 12 (ranks 0, 1, 2) under the root; 13 under 10, 14 under 13
    bushy = ((-1, 0, 0, 0, 1, 4), [10, 11, 12, 13, 14])
    # worth at a = 0.5: 10 .5, 11 .25, 12 .125, 13 .25, 14 .125
    assert _merge([bushy], [0.5], 2) == {(10,), (11,)}  # tie 11 / 13: the earlier offered
    assert _merge([bushy], [0.5], 3) == {(10,), (11,), (10, 13)}
    assert _merge([bushy], [0.5], 9, row_cost=0.2) == {(10,), (11,), (10, 13)}  # .125 is not worth a row
    # a confident part goes deep first: 11's .81 is capped at what 10 (.9) leaves of the root, .1
    assert _merge([bushy], [0.9], 2) == {(10,), (10, 13)}


def test_beside_a_confident_copy_another_parts_guess_is_worth_only_the_copys_miss_rate():
    copy = ((-1, 0, 1, 2), [20, 21, 22])
    head = ((-1, 0, 1), [30, 31])
    # copy at 0.9: 20 .9, 21 .81, 22 .73; the head's 30: min(.6, 1 - .9) = .1, 31: .06
    assert _merge([head, copy], [0.6, 0.9], 14, row_cost=0.05) == {(20,), (20, 21), (20, 21, 22), (30,), (30, 31)}
    assert _merge([head, copy], [0.6, 0.9], 14, row_cost=0.08) == {(20,), (20, 21), (20, 21, 22), (30,)}
    # an unsure copy leaves the head its own worth: 30 .6 before 21 (.3 x .5)
    assert _merge([head, copy], [0.6, 0.3], 2) == {(30,), (30, 31)}
    # a node both parts propose is one node, worth the larger: its children follow it
    assert _merge([((-1, 0, 1), [20, 40]), copy], [0.2, 0.9], 3, row_cost=0.5) == {(20,), (20, 21), (20, 21, 22)}


def test_walked_counts_the_committed_tokens_a_tree_proposed():
    t = Tree((-1, 0, 1, 0, 2))
    tokens = np.array([0, 5, 6, 7, 8])
    assert walked(t, tokens, [5, 6, 9]) == (2, True)  # 6 -> 8 was proposed, the target took 9
    assert walked(t, tokens, [5, 6, 8, 1]) == (3, False)  # the proposal ended: nothing rejected
    assert walked(t, tokens, [7, 1]) == (1, False)
    assert walked(t, tokens, [4]) == (0, True)


def test_the_tree_follows_measured_acceptance_and_row_cost():
    a = Fixed((-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9), [40 + i for i in range(10)])
    b = Fixed((-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9), [60 + i for i in range(10)])
    d = fused(a, b, nodes=10, lazy=False, row_cost=0.05)
    p = d.propose(state())
    # the prior (0.5 per draft, both): 4 drafts each are worth a row (.5^4 >= .05 > .5^5)
    assert sum(40 <= t < 50 for t in p.tokens) == sum(60 <= t < 70 for t in p.tokens) == 4
    s = state()
    for _ in range(6):  # the target keeps taking 4 of b's copy
        p = d.propose(s)
        path = [0] + [i for i in range(1, p.tree.size) if 60 <= p.tokens[i] < 70][:4]
        s.tokens.extend([int(p.tokens[i]) for i in path[1:]] + [99])
        d.update(s, p, Verdict(path, 99), None)
    p = d.propose(s)
    ours, theirs = sum(60 <= t < 70 for t in p.tokens), sum(40 <= t < 50 for t in p.tokens)
    assert ours > 4 and theirs <= 1 and ours + theirs <= 10  # b's copy fills; a's misses leave a its top guess


def test_lazy_the_model_part_sits_out_while_the_host_part_is_measured_better():
    class Counting(Fixed):
        asked = 0

        def propose(self, state):
            self.asked += 1
            return super().propose(state)

    model = Counting((-1, 0, 1), [70, 71])
    host = Fixed((-1, 0, 1, 2), [80, 81, 82])
    d, s = fused(model, host, nodes=6, row_cost=0.05), state()
    asked = []
    for _ in range(16):  # the target takes the host's copy
        p = d.propose(s)
        path = [0] + [i for i in range(1, p.tree.size) if 80 <= p.tokens[i]]
        s.tokens.extend([int(p.tokens[i]) for i in path[1:]] + [99])
        d.update(s, p, Verdict(path, 99), None)
        asked.append(model.asked)
    # asked while what it adds where the copy misses (its accepted drafts per step, measured 0 and down
    # by 0.7 a step, x the copy's miss rate) may be worth its time, then left out whatever the times
    # (not worth one row) but for a probe's two steps once it sat out PROBE_AFTER[0]
    out = next(i for i in range(len(asked) - 1) if asked[i] == asked[i + 1])
    assert 1 <= asked[out] <= 9 and asked[out + PROBE_AFTER[0]] == asked[out] and asked[-1] == asked[out] + 2
    assert paths(d.propose(s)) == {(80,), (80, 81), (80, 81, 82)}
    empty = fused(model, Fixed((-1,), []), nodes=6)  # a host with nothing to propose: the model part drafts
    empty.acceptance = [0.1, 5.0]
    assert paths(empty.propose(s)) == {(70,), (70, 71)}


def test_lazy_weighs_the_model_parts_drafting_time_against_what_it_buys():
    model, host = Fixed((-1, 0, 1), [70, 71]), Fixed((-1, 0), [80])
    d = fused(model, host, nodes=6)
    assert d.model_worth_it()  # nothing measured yet: draft with both, and measure
    for t in range(1, 16):  # a step costs 1 s at any verify size: only the drafting time counts
        d.costs.observe(t, 1.0)
    d.acceptance = [2.0, 1.0]  # the model part adds 2 x the copy's miss rate (prior 0.5) to 1
    d.model_s = 0.2  # 3 tokens per 1.2 s beat 2 per 1.0 s
    assert d.model_worth_it() and (70,) in paths(d.propose(state()))
    d.model_s = 0.6  # 3 per 1.6 s do not
    assert not d.model_worth_it() and paths(d.propose(state())) == {(80,)}
    assert fused(model, host, nodes=6, lazy=False).propose(state()).tree.size == 4  # never left out


def test_in_a_batch_of_several_rows_the_model_part_is_priced_in_the_batchs_seconds():
    """Every row waits while one drafts: in a batch its drafts are worth the batch's plain seconds per token,
    whatever they would buy its own step (runtime/batching/policy.py sets the price; None for a row alone)."""
    d = fused(Fixed((-1, 0, 1), [70, 71]), Fixed((-1, 0), [80]), nodes=6)
    for t in range(1, 16):
        d.costs.observe(t, 1.0)
    d.acceptance, d.model_s = [2.0, 1.0], 0.2
    assert d.model_worth_it() and (70,) in paths(d.propose(state()))  # at its own step's rate it pays
    added = d.expected_added(True)
    assert 0.5 < added < 2
    d.batch_price = BatchPrice(rows=2, token_s=0.2 / added, row_s=0.01, run_s=0.05)  # worth 0.2 s: not 0.2 s + a row
    assert not d.pays_in_batch(True, d.batch_price) and paths(d.propose(state())) == {(80,)}
    d.batch_price = BatchPrice(rows=2, token_s=0.3 / added, row_s=0.01, run_s=0.05)  # a dearer token: 0.3 s > 0.21 s
    assert d.pays_in_batch(True, d.batch_price) and (70,) in paths(d.propose(state()))
    # without a copy the model part's step is a run of its own too
    alone = BatchPrice(rows=2, token_s=0.25 / d.expected_added(False), row_s=0.01, run_s=0.05)
    assert not d.pays_in_batch(False, alone)


def test_a_step_the_model_part_sits_out_is_the_host_parts_own_step_sized_as_it_sizes_it_alone():
    """Not the merge's threshold, which prices the model part's drafts as paid for: on an int4 target
    such steps verified wider calls than prompt lookup alone for the same tokens."""
    from specdeploy.runtime.drafters.prompt_lookup import PromptLookupDrafter

    text = list(range(20, 32))
    s = DecodeState(text * 2 + text[:3], SamplingParams(), np.random.default_rng(0))
    host = PromptLookupDrafter(14, 3, 1)  # as the fused method builds it: its whole copy, unsized
    d = fused(Fixed((-1, 0, 1), [70, 71]), host, nodes=14, row_cost=0.05)
    for t in list(range(1, 16)) * 3:  # an int4-like step: rows cost 0.1 of a plain step each
        d.costs.observe(t, 1 + 0.1 * (t - 1))
    d.model_s, d.added = 5.0, [0.0, 0.0]  # the model part's drafts buy nothing, slowly
    p = d.propose(s)
    alone = PromptLookupDrafter(14, 3, 1, StepTimer(d.costs, timed=False))  # prompt lookup alone, same step times
    alone.start(s)
    q = alone.propose(s)
    assert 1 < p.tree.size < 15 and p.tree.parents == q.tree.parents and np.array_equal(p.tokens, q.tokens)
    assert all(70 not in path for path in paths(p))
    s.tokens.extend([int(t) for t in p.tokens[1:]] + [99])  # the target takes the whole copy
    d.update(s, p, Verdict(list(range(p.tree.size)), 99), None)
    assert d.host_rows == pytest.approx(0.3 * (p.tree.size - 1))  # its placed rows: the step's, past the root
    assert d.rates[1].at(0) > 0.5  # the copy's acceptance, measured on its whole proposal


def test_lookaheads_window_rides_in_the_merged_step_and_takes_its_rows_from_the_budget():
    la = LookaheadDrafter(window=3, ngram=4, guesses=2)  # 8 window rows beside the root cell
    host = Fixed((-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9), [80 + i for i in range(10)])  # a 10-token copy
    d = FusedDrafter(LookaheadSuffixConfig(nodes=14, lazy=False), [la, host], window=8)
    s = DecodeState([5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], SamplingParams(), np.random.default_rng(0))
    d.start(s)
    alone = la.propose(s)
    p = d.propose(s)
    assert p.tree.size - 1 == 14 - 8 and p.size == 15  # 6 candidates + the window: the T=15 call
    assert (8,) in paths(p) and (80,) in paths(p)  # both parts' candidates (lookahead's: 7 -> 8 copied)
    assert np.array_equal(p.aux_tokens, alone.aux_tokens) and np.array_equal(p.aux_positions, alone.aux_positions)
    tokens, positions, mask = p.packed(100)
    s_ = p.tree.size
    assert not mask[s_:, 1:s_].any() and mask[s_:, 0].all()  # window rows see the root, no candidate
    assert np.array_equal(mask[s_:, s_:], alone.aux_mask[:, alone.tree.size:])
    assert not mask[:s_, s_:].any()  # and no candidate sees the window
    # a step lookahead sits out runs no window: the budget goes to the host part
    lazy = FusedDrafter(LookaheadSuffixConfig(nodes=14), [la, host], window=8)
    lazy.start(s)
    lazy.acceptance, lazy.model_s = [0.1, 3.0], 0.0
    lazy.added = [0.1, 0.1]  # the window's rows buy 0.1
    q = lazy.propose(s)
    # lookahead drafts on the host (only its rows cost): the merged tree is cut where the expected tokens per
    # second is best, as a host part cuts its own, here at the prior shape of a step's time: the copy's
    # drafts at .5, .25, .125 (a fourth, .0625, adds less than its row costs), not the merge's .05 threshold (4)
    assert q.aux_tokens is None and q.tree.size - 1 == 3
    # the window's rows count as the model part's cost, at the measured time of the step they widen:
    # here 1 s and 0.05 s a row past the root
    for t in range(1, 16):
        lazy.costs.observe(t, 1 + 0.05 * (t - 1))
    lazy.acceptance, lazy.added, lazy.host_rows = [2.0, 1.0], [1.0, 1.0], 4.0
    assert lazy.model_worth_it()  # 1 added to the copy's 1: 3 per 1.6 s (T=13) beat 2 per 1.2 s (T=5)
    lazy.added = [0.6, 0.6]
    assert not lazy.model_worth_it()  # 2.6 per 1.6 do not
    assert lazy.model_worth_it(hosted=False)  # alone, 1.6 per 1.4 s (T=9) beat a plain step's 1 per 1
    slow = LookaheadSuffixConfig()  # where a call wider than the root costs 0.35 of a step more
    lazy.costs = StepCosts(slow.call_cost, slow.row_cost)
    for t in range(1, 16):
        lazy.costs.observe(t, 1 + 0.35 * (t > 1) + 0.05 * (t - 1))
    assert not lazy.model_worth_it(hosted=False)  # 1.6 per 1.75 do not
    assert lazy.model_worth_it()  # beside a copy the wider call is paid: 2.6 per 1.95 beat 2 per 1.55


def test_a_steps_time_is_measured_per_verify_size_and_scaled_by_the_prior_shape_between():
    costs = StepCosts(call_cost=0.2, row_cost=0.05)
    assert not costs.measured
    for t, ms in ((1, 15.8), (2, 19.2), (3, 20.2), (9, 25.4), (15, 31.5)) * 3:  # SmolLM2, 2 cores; settled
        costs.observe(t, ms)
    assert costs.seconds(2) == 19.2 and costs.seconds(2.5) == pytest.approx(19.7)  # measured, and between
    # T=5 from its nearest measured size, T=3, by the prior's shape: 20.2 x 1.35 / 1.25
    assert costs.seconds(5) == pytest.approx(20.2 * 1.35 / 1.25)
    # two rows beside a one-row copy cost more than two beside an eight-row one (not priced per row)
    assert costs.seconds(3) / costs.seconds(1) > costs.seconds(11) / costs.seconds(9)
    costs.observe(1, 1000.0)  # a stalled step counts as STALL x the average, not 63 x
    assert costs.seconds(1) < 15.8 * 2


def test_the_model_part_drafts_where_its_rows_widen_a_wide_step_little_and_not_where_they_widen_a_plain_one():
    model, host = Fixed((-1, 0, 1), [70, 71]), Fixed((-1, 0), [80])
    d = fused(model, host, nodes=14, row_cost=0.05)
    for t, ms in ((1, 15.8), (2, 19.2), (3, 20.2), (5, 23.6), (9, 25.4), (15, 31.5)):
        d.costs.observe(t, ms)
    d.model_s, d.model_rows, d.added, d.acceptance = 1.0, [2.0, 2.0], [0.3, 0.3], [1.0, 0.3]
    assert not d.model_worth_it(hosted=False)  # alone: 1.3 per 21.2 ms (T=3) lose to 1 per 15.8
    d.host_rows = 7.0
    assert d.model_worth_it()  # beside a 7-row copy: 1.6 per 26.4 ms (T=10) beat 1.3 per 24.5 (T=8)


def test_beside_a_copy_that_is_mostly_wrong_the_model_part_drafts_in_its_place():
    model, host = Fixed((-1, 0, 1), [70, 71]), Fixed((-1, 0), [80])
    d = fused(model, host, nodes=6, row_cost=0.05)

    def timed():  # a plain step 1 s, a wider one 0.2 s more and 0.05 s a row past two
        d.costs = StepCosts(0.2, 0.05)
        for t in range(1, 8):
            d.costs.observe(t, 1 + 0.2 * (t > 1) + 0.05 * max(t - 2, 0))

    timed()
    d.model_s, d.model_rows, d.host_rows = 0.2, [2.0, 2.0], 1.0
    d.acceptance, d.added = [2.0, 0.2], [1.8, 0.5]  # the copy is taken 0.2 a step; the model adds 1.8 alone
    # with the copy: 1.2 + 0.5 per 1.5 s; the copy alone 1.2 per 1.2 s; the model alone 2.8 per 1.45 s
    assert d.model_alone_beats_both()
    s = state()
    p = d.propose(s)
    assert paths(p) == {(70,), (70, 71)}  # the copy's row left out
    s.tokens.extend([70, 71, 99])
    before = d.acceptance[1]
    d.update(s, p, Verdict([0, 1, 2], 99), None)
    assert d.acceptance[1] < before  # the copy is still measured on its whole proposal: it missed
    assert d.added[False] > 1.8 and d.added[True] == 0.5  # a step the model part drafted alone
    # a copy that is taken keeps its place: both beat the model alone
    timed()  # (the update timed its step: microseconds here)
    d.acceptance, d.added = [2.0, 3.0], [1.8, 1.0]
    assert not d.model_alone_beats_both() and (80,) in paths(d.propose(state()))
    # where the model part then has nothing to propose, the copy stays
    d.parts[0] = Fixed((-1,), [])
    d.acceptance, d.added = [2.0, 0.2], [1.8, 0.5]
    assert d.model_alone_beats_both() and paths(d.propose(state())) == {(80,)}


@pytest.mark.parametrize("bad", [{"nodes": 1}, {"lazy": 1}, {"nodes": True}, {"prior": 0}, {"prior": "x"},
                                 {"decay": 1.0}, {"decay": -0.1}, {"row_cost": 1.0}, {"row_cost": -0.1},
                                 {"call_cost": -0.1}])
def test_bad_configs_get_one_clear_error(bad):
    with pytest.raises(SpecDeployError, match=r"config: eagle\+suffix\."):
        method_spec("eagle+suffix").parse(bad)


def test_unknown_keys_are_rejected_and_the_verify_size_is_the_budget():
    with pytest.raises(SpecDeployError, match="unknown eagle\\+suffix keys"):
        method_spec("eagle+suffix").parse({"k": 3})
    assert method_spec("medusa+prompt-lookup").parse({"nodes": 8}).verify_tokens == 9
    assert MergedTree(0, 3).proposal().tree.size == 1


def test_suffix_verifies_only_the_drafts_worth_their_rows_by_the_same_rule():
    from specdeploy.runtime.drafters.suffix import SuffixConfig, SuffixDrafter

    text = list(range(20, 32))
    s = DecodeState(text * 3 + text[:2], SamplingParams(), np.random.default_rng(0))
    whole = SuffixDrafter(SuffixConfig(cache_tokens=0))  # no timer: rows are free
    whole.start(s)
    assert whole.propose(s).tree.size - 1 == 14  # the repeated text, max_nodes of it
    # priced by the prior shape (a first row 0.2 of a step, 0.05 each after it)
    trimmed = SuffixDrafter(SuffixConfig(cache_tokens=0), None, StepTimer(StepCosts(0.2, 0.05), timed=False))
    trimmed.start(s)
    p = trimmed.propose(s)
    # the prior: a first draft taken half the time, each later one 0.8 of the time after it (acceptance comes
    # in runs): 8 drafts, 2.4 tokens in 1.55 steps' time
    assert p.tree.size - 1 == 8 and list(p.tokens[1:]) == text[2:10]
    for _ in range(3):  # the target follows the text: the measured acceptance grows, so does the tree
        nxt = text[(s.tokens.index(int(p.tokens[-1])) + 1) % len(text)]
        s.tokens.extend([int(t) for t in p.tokens[1:]] + [nxt])
        trimmed.update(s, p, Verdict(list(range(p.tree.size)), nxt), None)
        p = trimmed.propose(s)
    assert p.tree.size - 1 == 14
    with pytest.raises(SpecDeployError, match=r"config: suffix\.row_cost"):
        SuffixConfig(row_cost=1.0)


def test_rank_acceptance_measures_each_sibling_rank_where_the_walk_passed():
    rates = RankAcceptance()
    assert [round(rates.at(r), 4) for r in range(3)] == [0.5, 0.25, 0.125]  # the prior: a chain's 0.5, geometric
    tree, tokens = Tree((-1, 0, 0, 0, 1)), np.array([0, 10, 11, 12, 13])  # 10, 11, 12 under the root; 13 under 10
    for _ in range(10):  # the target takes the second guess, then leaves the tree
        rates.observe(tree, tokens, [11, 5])
    assert rates.at(1) > 0.9 and rates.at(0) < 0.1 and rates.at(2) < 0.1
    chain = RankAcceptance()
    chain.observe(Tree.chain(3), np.array([0, 1, 2, 3]), [1, 2, 9])  # 2 of 3 drafts: a chain's count
    assert chain.at(0) == pytest.approx((0.9 * 1.0 + 2) / (0.9 * 2.0 + 3))


def test_rank_acceptance_per_kind_at_the_root_and_per_depth_below():
    rates = RankAcceptance(kinds=2, depths=3)
    assert rates.at(0, 1, 0) == rates.at(0, 1, 1) == 0.5 and rates.at(0, 2) == rates.at(0, 7) == 0.8  # priors
    chain = Tree.chain(4)
    for _ in range(10):  # kind 1's copies run on whole, kind 0's first draft is rejected
        rates.observe(chain, np.array([0, 1, 2, 3, 4]), [1, 2, 3, 4, 5], kind=1)
        rates.observe(chain, np.array([0, 1, 2, 3, 4]), [9], kind=0)
    assert rates.at(0, 1, 1) > 0.9 > 0.1 > rates.at(0, 1, 0)
    assert rates.at(0, 2) > 0.9 and rates.at(0, 4) == rates.at(0, 3) > 0.9  # depths 3 and deeper share counts
    # a merge of a kind-1 copy prices its deep nodes by the runs measured, not the first draft's rate compounded
    part = PartProposal(Proposal(chain, np.array([0, 1, 2, 3, 4])), kind=1)
    merged = merge([part], [rates], 14, 0.0, root=0)
    assert merged.worth[4] > 0.75


def test_lazy_a_model_part_that_only_agrees_with_the_copy_adds_nothing_and_sits_out():
    class Counting(Fixed):
        asked = 0

        def propose(self, state):
            self.asked += 1
            return super().propose(state)

    model = Counting((-1, 0, 1), [80, 81])  # the host's copy's first two tokens: always taken, never extra
    host = Fixed((-1, 0, 1, 2), [80, 81, 82])
    d, s = fused(model, host, nodes=6, row_cost=0.05), state()
    for _ in range(12):
        p = d.propose(s)
        s.tokens.extend([int(t) for t in p.tokens[1:4]] + [99])
        d.update(s, p, Verdict([0, 1, 2, 3], 99), None)
    # its drafts were all taken, yet the copy had them: it added nothing where it drafted, and the copy,
    # taken whole since, misses less than then: not worth one row, whatever the times
    assert d.acceptance[0] > 1 > d.added[True] and d.expected_added(True) < 0.05
    asked = model.asked
    d.model_s = 0.0
    d.propose(s)
    assert model.asked == asked <= 3
    alone = fused(Counting((-1, 0, 1), [70, 71]), Fixed((-1,), []), nodes=6, row_cost=0.05)
    alone.added = [0.01, 1.0]  # alone, its drafts were measured to add nothing: no host proposal forces it
    assert alone.propose(state()).tree.size == 1


class Taken(Fixed):
    """A chain, drafted in 2 ms, counting the steps it was asked to draft."""

    asked = 0

    def propose(self, state):
        self.asked += 1
        time.sleep(0.002)
        return super().propose(state)


class Slow(Fixed):
    """A model part whose drafting takes 5 ms."""

    def propose(self, state):
        time.sleep(0.005)
        return super().propose(state)


def _step(d: FusedDrafter, s: DecodeState, taken: set[int], verify_s: float = 0.010) -> bool:
    """One step where the target takes the merged tree's leading tokens in `taken`, its verify call `verify_s` and
    1 ms a row more (0: no wait); whether the model part drafted."""
    p = d.propose(s)
    if verify_s:
        time.sleep(verify_s + 0.001 * (p.tree.size - 1))
    path = [0]
    while True:
        nxt = next((c for c in p.tree.children[path[-1]] if int(p.tokens[c]) in taken), None)
        if nxt is None:
            break
        path.append(nxt)
    drafted = d.last[0].proposal.tree.size > 1  # (update clears `last`)
    s.tokens.extend([int(p.tokens[i]) for i in path[1:]] + [99])
    d.update(s, p, Verdict(path, 99), None)
    return drafted


def test_a_model_part_priced_out_by_one_slow_drafting_step_is_probed_and_comes_back():
    """One stalled drafting step (cold caches after an idle spell) priced the model part out for the rest of a
    request: a step it sits out measures nothing. After PROBE_AFTER[0] such steps it drafts two (the second
    timed), and a time under 1/STALL of the stalled one restarts the average: it drafts again from then on."""
    d, s = fused(Taken((-1, 0, 1), [70, 71]), Fixed((-1,), []), nodes=6, row_cost=0.05), state()
    assert all(_step(d, s, {70, 71}) for _ in range(4))  # drafting pays: both drafts taken every step
    d.model_s = 10.0  # as if its last drafting step had stalled for 10 s
    drafted = [_step(d, s, {70, 71}) for _ in range(PROBE_AFTER[0] + 6)]
    wait = PROBE_AFTER[0]
    assert not any(drafted[:wait]) and drafted[wait] and drafted[wait + 1]  # sat out, then the probe's two steps
    assert d.model_s < 0.01
    assert all(drafted[wait + 2:])


def test_untimed_steps_leave_the_step_times_and_drafting_time_unmeasured():
    """Adaptation off: the prior shape alone decides, so the drafts do not depend on how long a step took, and
    the model part drafts wherever its rows pay by it."""
    d = FusedDrafter(EagleSuffixConfig(nodes=6, row_cost=0.05), [Taken((-1, 0, 1), [70, 71]), Fixed((-1,), [])],
                     timed=False)
    s = state()
    d.start(s)
    assert all(_step(d, s, {70, 71}) for _ in range(6))
    assert d.model_s is None and not d.costs.measured and d.tokens_per_second(False) is None


def test_the_merge_prices_a_row_at_the_exports_measured_cost_of_one():
    """Until the step times are measured, row_cost; then the slope of a step's time from 2 rows to the full
    budget, in plain steps (an int4 row costs 2-3x a float32 one); 0 (rows are free) stays 0."""
    d = fused(Fixed((-1, 0), [70]), Fixed((-1,), []), nodes=14, row_cost=0.05)
    assert d.row_threshold() == 0.05
    for t, ms in ((1, 8.3), (2, 9.6), (3, 11.2), (4, 12.0), (6, 14.4), (9, 16.8), (15, 23.7)) * 3:  # SmolLM2 int4
        d.costs.observe(t, ms / 1000)
    assert d.row_threshold() == pytest.approx((23.7 - 9.6) / 8.3 / 13)  # 0.13 a row
    free = fused(Fixed((-1, 0), [70]), Fixed((-1,), []), nodes=14, row_cost=0.0)
    free.costs.observe(1, 0.01)
    assert free.row_threshold() == 0.0


def test_a_model_part_that_never_pays_is_probed_ever_more_rarely():
    d, s = fused(Slow((-1, 0, 1), [70, 71]), Fixed((-1,), []), nodes=6, row_cost=0.05), state()
    # the target never takes its drafts: after its first step (drafted to measure) they add nothing, and cost
    # 5 ms against a step's microseconds (a model part as fast as the step was left out or not by timing noise)
    drafted = [_step(d, s, set(), verify_s=0) for _ in range(300)]
    starts = [i for i, (a, b) in enumerate(zip([False, *drafted], drafted)) if b and not a]
    assert starts[0] == 0 and drafted[1] is False
    assert all(drafted[a : a + 3] == [True, True, False] for a in starts[1:])  # each a probe's two steps
    out = [b - a - 2 for a, b in zip(starts[1:], starts[2:])]  # steps out between probes
    assert starts[1] - 1 == PROBE_AFTER[0] and out == [2 ** i * PROBE_AFTER[0] for i in range(1, len(out) + 1)]
    assert len(out) >= 3 and max(out) == PROBE_AFTER[1]


def test_a_proposal_the_batch_cut_counts_only_the_rows_it_verified():
    """A batch's policy may verify only the merged tree's first nodes (policy.truncated): the model part's rows
    are its nodes among those, never the host's nodes the cut left out (they drove its rows below zero)."""
    from specdeploy.runtime.batching.policy import truncated
    from specdeploy.runtime.drafters.acceptance import DECAY

    d, s = fused(Fixed((-1, 0, 1), [70, 71]), Fixed((-1, 0, 1, 2), [80, 81, 82]), nodes=6, lazy=False), state()
    for _ in range(4):
        p = truncated(d.propose(s), 2)
        ours = sum(int(t) in (70, 71) for t in p.tokens[1:])
        before = d.model_rows[1]
        s.tokens.append(99)
        d.update(s, p, Verdict([0], 99), None)
        assert d.model_rows[1] == pytest.approx(DECAY * before + (1 - DECAY) * ours) and d.model_rows[1] >= 0


def test_in_a_batch_each_row_probes_as_rarely_as_the_rows_sharing_the_call():
    """Every row of a batch waits on one row's probe: with 4 rows a row's first probe comes after 4 x
    PROBE_AFTER[0] steps out, so the batch probes about as often as one row alone would."""
    d, s = fused(Slow((-1, 0, 1), [70, 71]), Fixed((-1,), []), nodes=6, row_cost=0.05), state()
    d.batch_price = BatchPrice(rows=4, token_s=1e-4, row_s=1e-5, run_s=1e-5)  # a token is worth far less than 5 ms
    drafted = [_step(d, s, set(), verify_s=0) for _ in range(4 * PROBE_AFTER[0] + 4)]
    assert drafted[0] and not any(drafted[1 : 4 * PROBE_AFTER[0] + 1])  # measured once, then out
    assert drafted[4 * PROBE_AFTER[0] + 1 : 4 * PROBE_AFTER[0] + 3] == [True, True]  # the probe's two steps


def test_a_request_after_one_where_the_model_part_did_not_pay_does_not_draft_to_measure_it_again():
    # short requests where the heads never pay: each drafted its first step (unmeasured) and probed after
    # 8 steps out; now a request goes on from where the last left its drafting time and its probes' wait
    d = fused(Slow((-1, 0, 1), [70, 71]), Fixed((-1,), []), nodes=6, row_cost=0.05)
    drafted = []
    for _ in range(12):  # 12 requests of 20 steps
        s = state()
        d.start(s)
        assert len(drafted) == 0 or d.model_s is not None  # its drafting time: the last request's
        drafted.append([_step(d, s, set(), verify_s=0) for _ in range(20)])
    assert drafted[0][0]  # the first request drafts its first step: nothing was measured yet
    # then only probes, two steps each, 16, 32, 64 and 128 steps out apart over 220 steps: at most 4 of them
    # (each request starting over drafted its first step and probed 8 steps out: 22 steps or more)
    later = sum(map(sum, drafted[1:]))
    assert 2 <= later <= 8 and d.learned.schemes["greedy"].probe[1] >= 4 * PROBE_AFTER[0]


def test_a_request_starts_from_what_the_last_one_measured_one_step_back_toward_the_prior():
    model, host = Fixed((-1, 0, 1), [70, 71]), Fixed((-1, 0, 1, 2), [80, 81, 82])
    d, s = fused(model, host, nodes=6, row_cost=0.05), state()
    for _ in range(8):  # the target takes the copy: the heads add nothing
        p = d.propose(s)
        path = [0] + [i for i in range(1, p.tree.size) if 80 <= p.tokens[i]]
        s.tokens.extend([int(p.tokens[i]) for i in path[1:]] + [99])
        d.update(s, p, Verdict(path, 99), None)
    measured, missed = d.added[True], d.missed[True]
    copy_rate, acceptance, model_s = d.rates[1].at(0), list(d.acceptance), d.model_s
    assert measured < 1.0 and copy_rate > 0.9  # the copy's first draft: taken every step, against 0.5 a priori
    d.start(state())  # the next request on the same export (build shares its Learned per method config)
    assert d.added == pytest.approx([1.0, 0.9 * measured + 0.1 * 1.0]) and d.missed[True] == missed
    # the host's acceptance where `missed` was measured, not the prior's: else the copy's prior miss rate
    # (0.5) over the measured one would scale what the model part is expected to add up 5x
    assert d.rates[1].at(0) == copy_rate and d.acceptance == acceptance
    assert d.expected_added(True) == pytest.approx(d.added[True] * (1 - copy_rate) / missed)
    assert d.expected_added(True) < 0.1
    assert d.model_s == model_s is not None  # its drafting time as measured: no first step drafted to measure it
    assert fused(model, host).added == [1.0, 1.0]  # a drafter of its own starts from the prior
    # a sampled request starts from its own scheme's measurements (none yet: the prior), not from greedy
    # ones, and shares the export's step times; the next greedy request still finds the greedy ones
    costs = d.costs
    d.start(DecodeState([1, 2, 3], SamplingParams(temperature=0.7), np.random.default_rng(0), PositionNoise(3)))
    assert d.added == [1.0, 1.0] and d.acceptance == [1.0, 1.0] and d.costs is costs
    d.start(state())
    assert d.added[True] == pytest.approx(0.9 * measured + 0.1)  # (the empty requests between measured nothing)
