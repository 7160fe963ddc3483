"""Draft length from acceptance and a step's time by verify size (runtime/drafters/acceptance.py,
step_costs.py): long chains while drafts are accepted, none when they do not pay for the rows, every
draft when rows are free."""

from __future__ import annotations

import numpy as np
import pytest

from specdeploy.runtime.drafters.acceptance import DEPTHS, ConfidenceAcceptance, RankAcceptance
from specdeploy.runtime.drafters.base import DecodeState
from specdeploy.runtime.drafters.prompt_lookup import PromptLookupDrafter
from specdeploy.runtime.drafters.step_costs import StepCosts, StepTimer, best_prefix
from specdeploy.runtime.sampling import SamplingParams
from specdeploy.runtime.tree import Tree
from specdeploy.runtime.verify import Verdict


def observe(rate: RankAcceptance, kind: int, drafts: int, taken: int) -> None:
    """A chain of `drafts` (tokens 100...) of `kind` whose first `taken` the target took (then 99)."""
    tokens = np.arange(99, 100 + drafts)
    rate.observe(Tree.chain(drafts), tokens, [int(t) for t in tokens[1 : taken + 1]] + [99], kind)


def length(rate: RankAcceptance, costs: StepCosts, kind: int = 0, available: int = 14) -> int:
    return best_prefix(rate.chain(available, kind), costs)


def test_length_follows_acceptance_and_the_prior_shape():
    rate, costs = RankAcceptance(1, DEPTHS), StepCosts(call_cost=0.2, row_cost=0.05)
    # the prior: a first draft taken half the time, each later one 0.8 of the time after it: 8 drafts, 2.4
    # tokens in 1.55 steps' time
    assert length(rate, costs) == 8
    for _ in range(20):  # every first draft rejected: not even one pays for the first row
        observe(rate, 0, 14, 0)
    assert length(rate, costs) == 0
    for _ in range(30):  # every draft taken: the rates -> 1
        observe(rate, 0, 14, 14)
    assert length(rate, costs) == 14
    assert length(rate, costs, available=5) == 5


def test_first_drafts_are_measured_per_kind_and_later_ones_given_those_before():
    rate, costs = RankAcceptance(4, DEPTHS), StepCosts(0.2, 0.05)
    for _ in range(20):  # 1-gram matches' copies are rejected at once, 3-gram matches' run on
        observe(rate, 1, 14, 0)
        observe(rate, 3, 14, 14)
    assert length(rate, costs, 1) == 0 and length(rate, costs, 3) == 14
    # a copy taken in one step of five, and then whole (a run): every draft is worth about the first's 0.2,
    # and 14 of them 2.8 tokens for 0.85 of a step's time
    runs = RankAcceptance(1, DEPTHS)
    for i in range(40):
        observe(runs, 0, 14, 14 if i % 5 == 4 else 0)
    assert all(0.12 < w < 0.3 for w in runs.chain(14)) and length(runs, costs) == 14
    # taken in one step of ten, and then only one more: not worth the first row
    short = RankAcceptance(1, DEPTHS)
    for i in range(40):
        observe(short, 0, 14, 2 if i % 10 == 4 else 0)
    assert length(short, costs) == 0


def test_a_tree_walk_counts_every_sibling_offered_and_the_one_taken():
    rate = RankAcceptance(1, DEPTHS)
    before = rate.at(1)
    # root -> 10 (rank 0), 11 (rank 1); the target takes 11, then 12 below it
    rate.observe(Tree((-1, 0, 0, 2)), np.array([5, 10, 11, 12]), [11, 12, 7])
    assert rate.at(0) < 0.5 and rate.at(1) > before  # rank 0 offered and missed, rank 1 taken
    assert rate.at(0, depth=2) > 0.8  # below the taken node, its only child taken


def test_measured_step_times_decide_the_length():
    # SmolLM2 float32 on 2 cores, ms: a first row costs 0.28 of a step, later rows ~0.05
    costs = StepCosts(call_cost=0.2, row_cost=0.05)
    for t, ms in ((1, 17.4), (2, 22.3), (3, 23.6), (4, 24.3), (6, 28.0), (9, 31.4), (15, 36.8)) * 3:  # settled
        costs.observe(t, ms / 1000)
    assert best_prefix([0.25, 0.06], costs) == 0  # 1.25 tokens in 1.28 steps: plain decoding is faster
    assert best_prefix([0.5, 0.25, 0.125], costs) == 3
    # int4: rows cost 2-3x more of a step; the same acceptance verifies a shorter chain
    int4 = StepCosts(0.2, 0.05)
    for t, ms in ((1, 8.3), (2, 9.6), (3, 11.2), (4, 12.0), (6, 14.4), (9, 16.8), (15, 23.7)) * 3:
        int4.observe(t, ms / 1000)
    chain = [0.8 ** j for j in range(1, 15)]
    assert (best_prefix(chain, int4), best_prefix(chain, costs)) == (4, 8)
    # a size never run is priced from the nearest measured one by the prior shape
    sparse = StepCosts(0.2, 0.05)
    sparse.observe(1, 0.010)
    assert abs(sparse.seconds(3) - 0.0125) < 1e-12
    # a size timed once, cold (its first call), costs at most what the settled sizes say by the prior shape,
    # so a chain of that length is drafted again and re-timed; settled (3 samples), it is its own average
    for _ in range(3):
        sparse.observe(2, 0.012)
    sparse.observe(9, 0.040)
    assert abs(sparse.seconds(9) - 0.012 * sparse.shape(9) / sparse.shape(2)) < 1e-12
    for _ in range(2):
        sparse.observe(9, 0.040)
    assert sparse.seconds(9) == 0.040


def test_prompt_lookup_measures_its_whole_copy_in_a_plain_step():
    """A copy not worth verifying (a plain step) still learns whether its first token would have been taken,
    so the chain comes back when the answer starts copying."""
    text = list(range(20, 32))
    state = DecodeState(text * 2 + text[:3], SamplingParams(), np.random.default_rng(0))
    costs = StepCosts(0.2, 0.05)
    drafter = PromptLookupDrafter(14, 3, 1, StepTimer(costs, timed=False))
    drafter.start(state)
    for _ in range(20):  # a request whose 3-gram matches' copies were rejected
        observe(drafter.rate, 3, 14, 0)
    proposal = drafter.propose(state)
    assert proposal.size == 1 and len(drafter.copied) == 14  # the copy was found, not verified
    for _ in range(6):  # the target follows the copy, one token per plain step
        nxt = int(drafter.copied[0])
        state.tokens.append(nxt)
        drafter.update(state, proposal, Verdict([0], nxt), None)
        proposal = drafter.propose(state)
    assert proposal.size > 1


def test_free_rows_verify_the_whole_copy_and_a_step_without_one_measures_nothing():
    text = list(range(20, 32))
    state = DecodeState(text * 2 + text[:3], SamplingParams(), np.random.default_rng(0))
    free = PromptLookupDrafter(9, 3, 1, None)  # no timer: rows are free (a GPU)
    free.start(state)
    for _ in range(20):
        observe(free.rate, 3, 9, 0)
    assert free.propose(state).size == 10
    lone = DecodeState([1, 2, 3], SamplingParams(), np.random.default_rng(0))  # nothing to copy
    before = free.rate.chain(9, 3)
    proposal = free.propose(lone)
    lone.tokens.append(4)
    free.update(lone, proposal, Verdict([0], 4), None)
    assert proposal.size == 1 and free.rate.chain(9, 3) == before


def test_a_drafts_confidence_is_priced_by_how_often_the_target_took_such_drafts():
    """ConfidenceAcceptance: before any step a draft's chance is its own probability (its bin's
    midpoint); measured, it is how often drafts of that confidence were the target's token, counted
    down each chain to its first miss."""
    table = ConfidenceAcceptance()
    assert table.chance(0.45) == pytest.approx(0.45) and table.chance(0.999) == pytest.approx(0.995)
    for _ in range(200):  # a near-identical draft: unsure picks (0.45) are taken all the same
        table.observe([0.45, 0.45, 0.97], [1, 2, 3], [1, 2, 3])
    assert table.chance(0.45) > 0.95 and table.chance(0.97) > 0.95
    for _ in range(200):  # the first draft missed: the ones after it were never offered
        table.observe([0.75, 0.45], [5, 6], [9, 6])
    assert table.chance(0.75) < 0.05
    assert 0.95 < table.chance(0.45) < 1  # the second drafts after a miss did not count
    assert table.chance(0.15) == pytest.approx(0.15)  # a bin never offered keeps its prior
    for _ in range(5000):  # counts are capped: a bin follows a drift within its last ~2,000 offers
        table.observe([0.45], [1], [2])
    assert table.chance(0.45) < 0.05


def test_a_near_identical_draft_drafts_long_chains_under_the_measured_stop():
    """The stop rule prices each draft by the measured table, not by the draft's own probability: a
    draft that is always taken at probability 0.5 drafts its k tokens, where the product of its
    probabilities (0.5, 0.25, ...) stopped it after two at stop_below 0.3."""
    from specdeploy.runtime.drafters.draft_model import DraftModelDrafter

    vocab = 8

    class Cache:
        length, max_context = 3, 64

        def truncate(self, n):
            Cache.length = n

    class Out:
        def __init__(self, token):
            self.logits = np.log(np.full((1, vocab), 0.5 / (vocab - 1)))  # the pick at 0.5, the rest shared
            self.logits[0, token] = np.log(0.5)

    class Decoder:
        cache = Cache()

        def prefill_limit(self, chunk):
            return chunk

        def prefill(self, tokens, chunk):
            return Out(1)

        def forward(self, ids, pos, mask):
            return Out(int(ids[-1]) % (vocab - 1) + 1)

        def commit(self, out, rows):
            Cache.length += 1

        def reset(self):
            Cache.length = 0

    def drafts(table) -> int:
        drafter = DraftModelDrafter(Decoder(), 6, 64, stop_below=0.3,
                                    acceptance=None if table is None else (lambda: table))
        Cache.length = 3
        state = DecodeState([0, 0, 0, 0], SamplingParams(0.0), np.random.default_rng(0))
        return len(drafter.propose(state).tokens) - 1

    assert drafts(None) == 2  # 0.5, then 0.25 < 0.3
    table = ConfidenceAcceptance()
    for _ in range(100):
        table.observe([0.5] * 6, [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6])
    assert drafts(table) == 6
