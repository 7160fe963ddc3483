"""The batch's speculation policy (runtime/batching/policy.py): draft sizes from measured costs."""

from __future__ import annotations

import numpy as np

from specdeploy.runtime.batching.policy import CostModel, SpeculationPolicy, expected_tokens, truncated
from specdeploy.runtime.drafters.base import Proposal
from specdeploy.runtime.tree import Tree


def cpu_like_costs() -> CostModel:
    """Shaped like SmolLM2 on 2 cores: a call's fixed cost (the weights read once) dominates,
    each token adds a little."""
    costs = CostModel()
    for tokens in (1, 2, 4, 8, 16, 32, 64):
        costs.observe(tokens, 0.020 + 0.002 * tokens, replace=True)
    return costs


def test_speculation_shrinks_to_plain_decoding_as_rows_join():
    policy = SpeculationPolicy(cpu_like_costs())
    sizes = [policy.draft_size(rows, 0.6, most=14) for rows in (1, 2, 4, 8, 16, 32)]
    assert sizes[0] > 1 and sizes[-1] == 0
    assert all(a >= b for a, b in zip(sizes, sizes[1:]))


def test_draft_size_grows_with_acceptance_and_a_disabled_policy_drafts_all():
    policy = SpeculationPolicy(cpu_like_costs())
    sizes = [policy.draft_size(1, r, most=14) for r in (0.01, 0.5, 0.9)]
    assert sizes[0] == 0 and sizes[0] < sizes[1] <= sizes[2]
    assert SpeculationPolicy(cpu_like_costs(), enabled=False).draft_size(16, 0.05, 14) == 14


def test_a_noisy_timing_never_makes_drafts_look_free():
    """A token's cost is the slope of a line through every call size's time, so one call timed
    faster than a smaller one (load on a shared machine) does not make drafting free."""
    costs = cpu_like_costs()
    costs.observe(13, 0.030, replace=True)  # below the 8-token call's time
    assert np.isclose(costs.token_s(), np.polyfit(list(costs.calls), list(costs.calls.values()), 1)[0])
    assert costs.token_s() > 0.001
    assert SpeculationPolicy(costs).draft_size(12, 0.05, most=8) == 0


def test_a_runs_own_cost_makes_a_row_draft_only_for_more_tokens():
    """A speculative row is a run of its own in the call: its measured extra cost (a call's time
    beyond as many decode rows' tokens) is paid once per step, so low acceptance stops paying."""
    costs = cpu_like_costs()
    costs.observe(6, costs.call_s(6) + 0.010, runs=1, replace=True)
    assert np.isclose(costs.run_s, 0.010)
    cheap, dear = SpeculationPolicy(cpu_like_costs()), SpeculationPolicy(costs)
    assert dear.draft_size(4, 0.3, most=8) < cheap.draft_size(4, 0.3, most=8)
    assert dear.draft_size(1, 0.9, most=8) > 0


def test_a_methods_drafting_time_counts_against_its_drafts():
    """A drafter that takes as long as a call to propose (a draft model, EAGLE's head on the
    same cores) pays only alone and with high acceptance; at a few rows the row decodes plainly."""
    policy = SpeculationPolicy(cpu_like_costs())
    assert policy.draft_s("eagle") == 0.0
    policy.observe_draft("eagle", 0.030)
    policy.observe_draft("eagle", 0.020)
    assert 0.020 < policy.draft_s("eagle") < 0.030
    draft = policy.draft_s("eagle")
    assert policy.draft_size(1, 0.8, most=8, draft_s=draft) > 0
    assert policy.draft_size(1, 0.3, most=8, draft_s=draft) == 0 < policy.draft_size(1, 0.3, most=8)
    assert policy.draft_size(4, 0.8, most=8, draft_s=draft) == 0 < policy.draft_size(4, 0.8, most=8)


def test_costs_interpolate_between_measured_sizes():
    costs = cpu_like_costs()
    assert np.isclose(costs.call_s(3), (costs.call_s(2) + costs.call_s(4)) / 2)
    assert costs.call_s(128) > costs.call_s(64)
    costs.observe(8, 1.0)  # online timings move the estimate (an average, not the last)
    assert 0.05 < costs.call_s(8) < 1.0


def test_a_loaded_machine_slows_every_call_size_alike():
    """Calls of one size timed at twice their measured time (another process took a core) make
    every size, a token and a run twice as dear, so the balance between them stays as measured;
    a prefill chunk beyond the sizes measured moves nothing."""
    def measured() -> CostModel:
        costs = cpu_like_costs()
        costs.observe(6, costs.call_s(6) + 0.004, runs=1, replace=True)
        return costs

    costs = measured()
    before = costs.call_s(1), costs.call_s(64), costs.token_s(), costs.run_s
    for _ in range(60):
        costs.observe(4, 2 * 0.028)
        costs.observe(4 + 5, 2 * (0.020 + 0.002 * 9 + 0.004), runs=1)
    assert np.allclose((costs.call_s(1), costs.call_s(64), costs.token_s(), costs.run_s), np.multiply(before, 2))
    costs.observe(200, 100.0)
    assert np.isclose(costs.call_s(1), 2 * before[0])
    policy = SpeculationPolicy(costs)
    assert [policy.draft_size(n, 0.6, 14) for n in (1, 4)] == [SpeculationPolicy(measured()).draft_size(n, 0.6, 14)
                                                                for n in (1, 4)]


def test_expected_tokens_and_truncation_keep_a_tree():
    assert expected_tokens(0.0, 5) == 1 and np.isclose(expected_tokens(1.0, 5), 6)
    tree = Tree((-1, 0, 0, 1, 2, 3))
    p = Proposal(tree, np.arange(6, dtype=np.int64))
    cut = truncated(p, 3)
    assert cut.tree.parents == (-1, 0, 0, 1) and list(cut.tokens) == [0, 1, 2, 3]
    assert truncated(p, 9) is p


def test_a_row_kept_plain_probes_with_one_draft_after_enough_plain_steps():
    """A low rate keeps a row plain, but its plain steps buy a probe of one draft (a rate that
    never sees another sample would keep the row, and its method's prior, plain for good);
    a dearer drafter waits longer for it."""
    policy = SpeculationPolicy(cpu_like_costs())
    assert policy.draft_size(4, 0.01, most=14, plain_steps=0) == 0
    waits = []
    for draft_s in (0.0, 0.010):
        steps = next(n for n in range(1, 1000) if policy.draft_size(4, 0.01, 14, draft_s, plain_steps=n))
        assert policy.draft_size(4, 0.01, 14, draft_s, plain_steps=steps) == 1
        waits.append(steps)
    assert 1 < waits[0] < waits[1]
    assert policy.draft_size(1, 0.9, most=14, plain_steps=500) > 1  # a good rate drafts what pays


def test_recent_steps_weigh_most_in_a_rows_acceptance():
    from specdeploy.runtime.batching.policy import ROW_DECAY, Acceptance

    rows = Acceptance(ROW_DECAY), Acceptance()
    for acceptance in rows:
        for _ in range(30):
            acceptance.add(0, 6)
        for _ in range(8):
            acceptance.add(6, 6)
    assert rows[0].survival()[0] > 0.5 > rows[1].survival()[0]


def test_drafts_copied_right_or_wrong_whole_are_weighed_whole():
    """A row whose copies are accepted whole one step in three and rejected at the first draft
    otherwise: each draft adds a third of a token, so it drafts all it may where a token costs
    less than that and none where it costs more. A per-draft rate fitted to the same steps
    (8 accepted per 2 rejections: 0.8) drafts a few at 8 rows, each worth less than it costs."""
    from specdeploy.runtime.batching.policy import Acceptance

    row = Acceptance()
    for _ in range(20):
        for accepted in (8, 0, 0):
            row.add(accepted, 8)
    survival = row.survival()
    assert np.allclose(survival[:8], 1 / 3, atol=0.06)
    policy = SpeculationPolicy(cpu_like_costs())  # a token: 2 ms; a plain step per row: 22 ms alone, 4.5 at 8 rows
    assert policy.draft_size(1, survival, most=8) == 8
    assert policy.draft_size(8, survival, most=8) == 0
    assert 0 < policy.draft_size(8, 0.8, most=8) < 8
    assert np.isclose(expected_tokens(survival, 8), 1 + np.sum(survival[:8]))


def test_a_row_that_never_missed_drafts_deep():
    """A few steps that accepted every draft make deep drafts likely (the one-half chance a depth
    without samples reads as weighs little once samples come), and a fresh row reads one half."""
    from specdeploy.runtime.batching.policy import ROW_DECAY, Acceptance

    fresh, row = Acceptance(ROW_DECAY), Acceptance(ROW_DECAY)
    assert np.allclose(fresh.survival()[:3], [0.5, 0.25, 0.125])
    for _ in range(4):
        row.add(14, 14)
    assert row.survival()[13] > 0.5
    assert SpeculationPolicy(cpu_like_costs()).draft_size(4, row.survival(), most=14) == 14


def test_a_row_alone_weighs_its_drafts_by_its_own_calls_times():
    """A row alone runs the batched graph's lone-row branch (no run's own cost, no decode part):
    its drafts are weighed by those calls' measured times, not by the batch's curve plus a run."""
    costs = cpu_like_costs()
    costs.observe(6, costs.call_s(6) + 0.010, runs=1, replace=True)  # a run costs 10 ms beside decode rows
    batch_only = SpeculationPolicy(costs)
    k_batch = batch_only.draft_size(1, 0.3, most=8)
    for tokens in (1, 2, 4, 8, 16):
        costs.observe(tokens, 0.018 + 0.002 * tokens, replace=True, lone=True)
    assert np.isclose(costs.lone_s(5), 0.028)
    alone = SpeculationPolicy(costs)
    assert alone.draft_size(1, 0.3, most=8) > k_batch  # no run cost alone
    assert alone.draft_size(4, 0.3, most=8) == batch_only.draft_size(4, 0.3, most=8)  # rows: the batch's curve
    costs.observe(5, 2 * 0.028, lone=True)  # a loaded machine: lone calls refine the load too
    assert costs.load > 1.0


class ScriptedCalls:
    """Call times as a function of the shape and of the machine's load, which drifts by call
    (the calibration's timing source; the real graph's times are what `tests/test_batching.py`
    calibrates on)."""

    lone_calls = True

    def __init__(self, seconds, drift: float = 0.0):
        self.seconds, self.drift, self.calls = seconds, drift, 0

    def time_call(self, rows: int, tokens: int = 0) -> float:
        self.calls += 1
        return self.seconds(rows, tokens) * (1 + self.drift * self.calls)


def test_calibration_times_shapes_in_turns_and_reads_no_dip_as_a_cheaper_call():
    """A load that drifts over the calibration makes later shapes look dearer: timed in turns
    (fastest of each), a run's cost stays near the truth. A rows' curve whose larger call timed
    faster (noise) is read flat there, not as a falling slope that prices long runs as free."""
    def truth(rows: int, tokens: int) -> float:
        return 0.050 + 0.004 * (rows + tokens) + (0.003 if rows and tokens else 0.0)

    costs = CostModel()
    costs.calibrate(ScriptedCalls(truth, drift=0.002), [1, 2, 4, 8, 16], [2, 4, 8, 15])
    assert abs(costs.run_s - 0.003) < 0.002
    assert abs(costs.token_s() - 0.004) < 0.001

    def dip(rows: int, tokens: int) -> float:  # 4 rows timed under 2 rows' time
        return 0.0578 if (rows, tokens) == (4, 0) else truth(rows, tokens)

    costs = CostModel()
    costs.calibrate(ScriptedCalls(dip), [1, 2, 4], [2, 4, 8, 15])
    assert costs.call_s(4) >= costs.call_s(2)
    assert costs.run_s < 0.02  # the runs past 4 tokens priced off a flat curve, not a falling one


def test_a_draft_model_is_priced_per_draft_and_its_probes_pay_its_catch_up():
    """A draft model (cost_per_draft) pays one call per draft, not its whole chain's time per step:
    priced so, a row alone drafts where a chain's price kept it plain (one row of SmolLM2's batched
    service: 1.00 tokens per call before, 2.7 after, at 1.22x plain). A probe after plain steps first
    feeds the draft model every token they committed: priced in, probes stop at a few rows."""
    policy = SpeculationPolicy(cpu_like_costs())
    one_draft, chain = 0.007, 0.007 * 6  # a draft call; the time of the chain its stop rule drafted
    assert policy.draft_size(1, 0.6, most=8, draft_s=chain) == 0  # a chain's time per step: never drafts
    assert policy.draft_size(1, 0.6, most=8, draft_s=one_draft, per_draft=True) > 0
    assert policy.draft_size(8, 0.6, most=8, draft_s=one_draft, per_draft=True) == 0  # under load: plain
    policy.observe_catchup("draft", 0.050, 50)  # 1 ms a token fed
    assert policy.catchup_s("draft", 40) == 0.040
    probe = next(n for n in range(1, 10_000) if policy.draft_size(4, 0.01, 8, one_draft, n, per_draft=True))
    assert all(policy.draft_size(4, 0.01, 8, one_draft, n, per_draft=True, catchup_s=policy.catchup_s("draft", n))
               == 0 for n in range(probe, 10 * probe))
