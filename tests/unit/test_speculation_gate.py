"""The batch's speculation gate: epochs measured both ways, the faster mode kept."""

from __future__ import annotations

import math
from types import SimpleNamespace

from specdeploy.runtime.batching.gate import (
    EPOCH_CALLS,
    EXPLORE_COST,
    EXPLORE_EVERY,
    FIRST_PAIRS,
    MAX_EXPLORE_EVERY,
    SpeculationGate,
    explore_every,
)


class Batch:
    """Drives a gate like the scheduler and its rows: `rows` requests, each row in every call; in a
    speculating epoch each row's step is a run committing `spec_tokens`, and a call takes `spec_s`
    (else 1 token, `plain_s`); with `spec_share` < 1 a speculating call holds only that share of the
    rows, in turns (the others busy drafting)."""

    def __init__(self, rows: int, spec_tokens: int, spec_s: float, plain_s: float, spec_share: float = 1.0):
        self.now = 0.0
        self.gate = SpeculationGate(clock=lambda: self.now)
        self.rows, self.spec_tokens, self.spec_s, self.plain_s = rows, spec_tokens, spec_s, plain_s
        self.spec_share, self.calls = spec_share, 0

    def epochs(self, n: int) -> list[bool]:
        modes = []
        for _ in range(n):
            modes.append(self.gate.speculate)
            for _ in range(EPOCH_CALLS):
                spec = self.gate.speculate
                works = [SimpleNamespace(slot=s, prefill=False) for s in range(self.rows)]
                seconds = self.spec_s if spec else self.plain_s
                self.now += seconds
                self.calls += 1
                if spec:
                    n = max(1, round(self.spec_share * self.rows))
                    works = [works[(self.calls * n + i) % self.rows] for i in range(n)]
                    self.gate.on_call([], works, seconds, self.rows)
                    for w in works:
                        self.gate.committed(w.slot, self.spec_tokens)
                else:
                    self.gate.on_call(works, [], seconds, self.rows)
        return modes


def test_the_gate_keeps_plain_decoding_where_speculation_is_slower_and_still_explores():
    batch = Batch(rows=8, spec_tokens=2, spec_s=0.25, plain_s=0.10)  # 8 vs 10 tokens per row-second
    warm = FIRST_PAIRS * 2 + 4
    every = explore_every(math.log(0.8))  # a speculating epoch makes 20% fewer tokens: 1 in 20
    assert every == 20
    modes = batch.epochs(warm + 3 * every)
    assert modes[:4] == [True, False, True, False]  # alternating until measured
    late = modes[warm:]
    assert late.count(True) == 3  # one epoch in `every`
    assert abs(batch.gate.state()[4]["ratio"] - 0.8) < 0.01


def test_the_gate_keeps_speculating_where_it_is_faster():
    batch = Batch(rows=8, spec_tokens=3, spec_s=0.15, plain_s=0.10)  # 20 vs 10
    modes = batch.epochs(FIRST_PAIRS * 2 + 4 + 2 * MAX_EXPLORE_EVERY)
    late = modes[-2 * MAX_EXPLORE_EVERY:]
    assert late.count(False) == 2  # a plain epoch makes half the tokens: explored as rarely as allowed
    assert batch.gate.state()[4]["ratio"] > 1.5


def test_rows_that_miss_calls_while_drafting_do_not_flatter_speculation():
    """8 requests: speculating, each call holds 4 of them (the rest drafting) and commits 2 tokens a
    row in 0.1 s (80 tokens/s); plain, all 8 rows commit a token each in 0.08 s (100 tokens/s). Per
    row in a call speculation would read 1.6x plain; the batch makes 0.8x the tokens."""
    batch = Batch(rows=8, spec_tokens=2, spec_s=0.10, plain_s=0.08, spec_share=0.5)
    warm = FIRST_PAIRS * 2 + 4
    every = explore_every(math.log(0.8))
    modes = batch.epochs(warm + 2 * every)
    assert abs(batch.gate.state()[4]["ratio"] - 0.8) < 0.01
    assert modes[warm:].count(True) == 2


def test_the_losing_mode_is_explored_as_often_as_its_cost_allows():
    assert explore_every(0.0) == explore_every(math.log(0.97)) == EXPLORE_EVERY  # close: as often as ever
    # in between, each exploring epoch costs about EXPLORE_COST of the bucket's epochs' tokens
    for ratio in (0.9, 1 / 0.9, 0.85):
        every = explore_every(math.log(ratio))
        assert EXPLORE_EVERY < every < MAX_EXPLORE_EVERY
        assert abs((1 - min(ratio, 1 / ratio)) / every - EXPLORE_COST) < EXPLORE_COST * 0.15
    assert explore_every(math.log(0.3)) == explore_every(math.log(3.0)) == MAX_EXPLORE_EVERY  # still seen


def test_a_row_alone_is_left_to_the_row_policy():
    batch = Batch(rows=1, spec_tokens=1, spec_s=1.0, plain_s=0.01)  # speculation hopeless
    modes = batch.epochs(12)
    assert all(modes[1:])  # never gated: a lone row's own rule decides
    assert batch.gate.state() == {}


def test_prefill_chunks_count_no_row_step():
    gate = SpeculationGate(clock=lambda: 0.0)
    gate.on_call([SimpleNamespace(slot=0, prefill=False)], [SimpleNamespace(slot=1, prefill=True)], 0.1, 2)
    gate.committed(1, 5)  # a prefill chunk's row never reports; a stray report is ignored
    epoch = gate._epochs[0]
    assert (epoch.requests, epoch.tokens) == (2, 1)


def test_an_idle_server_between_requests_is_not_an_epochs_time():
    """Minutes without a call (no requests) inside an epoch would make it look slow: the gap counts
    as the call's own time."""
    batch = Batch(rows=4, spec_tokens=1, spec_s=0.1, plain_s=0.1)  # both ways alike
    batch.epochs(1)
    batch.now += 600.0  # idle
    batch.epochs(12)
    assert 0.9 < batch.gate.state()[3]["ratio"] < 1.1
