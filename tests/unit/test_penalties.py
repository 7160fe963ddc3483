"""Repetition, frequency and presence penalties (runtime/penalties.py) on hand-built logits: each API's
meaning, one clear error for a bad value, and verification (runtime/verify.py) penalizing a tree row
by the drafts accepted on its path, not by its siblings'."""

from __future__ import annotations

import numpy as np
import pytest

from specdeploy.runtime.errors import SpecDeployError
from specdeploy.runtime.penalties import Penalties, PenaltyContext
from specdeploy.runtime.sampling import PositionNoise, SamplingParams
from specdeploy.runtime.tree import Tree
from specdeploy.runtime.verify import verify


@pytest.mark.parametrize("kwargs, needle", [
    (dict(repetition=0), "repetition_penalty must be a number from 0.01 to 100"),
    (dict(repetition=-1.0), "repetition_penalty"),
    (dict(repetition=1e-300), "repetition_penalty"),  # float32 logits would turn inf: garbage, no error
    (dict(repetition=101), "repetition_penalty"),
    (dict(repetition=float("inf")), "repetition_penalty"),
    (dict(repetition=True), "repetition_penalty"),
    (dict(frequency=2.5), "frequency_penalty must be a number from -2 to 2"),
    (dict(frequency=float("nan")), "frequency_penalty"),
    (dict(presence=-3), "presence_penalty must be a number from -2 to 2"),
    (dict(presence="1"), "presence_penalty"),
    (dict(logit_bias={5: 101}), "logit_bias values must be numbers from -100 to 100"),
    (dict(logit_bias={5: float("nan")}), "logit_bias values"),
    (dict(logit_bias={-1: 3}), "logit_bias keys must be token ids"),
    (dict(logit_bias={"5": 3}), "logit_bias keys must be token ids"),
    (dict(logit_bias={i: 1 for i in range(301)}), "more than 300 entries"),
    (dict(logit_bias="5:3"), "logit_bias must map token ids to numbers"),
    (dict(logit_bias=[(1, 2, 3)]), "logit_bias must map token ids to numbers"),
])
def test_bad_values_are_one_clear_error(kwargs, needle):
    with pytest.raises(SpecDeployError, match=needle):
        Penalties(**kwargs)


def test_defaults_are_no_penalty():
    assert not Penalties().active and Penalties(np.float32(1.2)).active and Penalties(presence=-0.5).active
    assert Penalties(np.float64(1.5)).repetition == 1.5 and type(Penalties(2).repetition) is float


def test_logit_bias_adds_to_its_tokens_after_the_penalties():
    pen = Penalties(2.0, logit_bias={np.int64(3): -100, 1: 0.5})
    assert pen.logit_bias == ((1, 0.5), (3, -100.0)) and pen.active and Penalties(logit_bias={}).active is False
    ctx = PenaltyContext(pen, prompt_ids=[1])
    out = ctx.apply(np.array([1.0, 4.0, 0.0, 9.0], np.float32), path=[])
    np.testing.assert_array_equal(out, [1.0, 2.5, 0.0, -91.0])  # token 1: 4 / 2 + 0.5
    with pytest.raises(SpecDeployError, match=r"logit_bias token ids out of range \[0, 4\): \[7\]"):
        Penalties(logit_bias={7: 1.0}).check_vocab(4)


def test_repetition_divides_positive_and_multiplies_negative_logits_of_every_seen_token():
    logits = np.array([2.0, -2.0, 4.0, 1.0, -1.0, 0.0], np.float32)
    ctx = PenaltyContext(Penalties(2.0), prompt_ids=[0, 1])
    ctx.commit([2])
    out = ctx.apply(logits, path=[4])
    np.testing.assert_array_equal(out, [1.0, -4.0, 2.0, 1.0, -2.0, 0.0])
    np.testing.assert_array_equal(logits, [2.0, -2.0, 4.0, 1.0, -1.0, 0.0])  # the row itself is left alone
    np.testing.assert_array_equal(ctx.apply(logits, path=[]), [1.0, -4.0, 2.0, 1.0, -1.0, 0.0])


def test_frequency_and_presence_count_the_output_only():
    logits = np.zeros(5, np.float32)
    ctx = PenaltyContext(Penalties(frequency=0.5, presence=0.25), prompt_ids=[0, 0, 4])
    ctx.commit([1, 1, 2])
    out = ctx.apply(logits, path=[2, 3])
    # prompt tokens 0 and 4 untouched; 1 twice, 2 twice (once committed, once on the path), 3 once
    np.testing.assert_allclose(out, [0.0, -1.25, -1.25, -0.75, 0.0])


def test_a_tree_row_is_penalized_by_its_own_path():
    """Root 0 -> 1 (tok 3) -> 2 (tok 3), and root -> 3 (tok 5). Every row prefers token 3, token 4 next.
    With a strong repetition penalty the root still picks 3 (not yet seen), but node 1's row has 3
    on its path, so it picks 4: node 2 is rejected. Node 3 (a sibling that lost) does not count."""
    tree = Tree(parents=(-1, 0, 1, 0))
    tokens = np.array([9, 3, 3, 5])
    logits = np.tile(np.array([0, 0, 0, 3.0, 2.0, 0, 0, 0, 0, 0], np.float32), (4, 1))
    params = SamplingParams(0.0)
    plain = verify(tree, tokens, logits, params, np.random.default_rng(0))
    assert plain.path == [0, 1, 2] and plain.next_token == 3
    ctx = PenaltyContext(Penalties(4.0), prompt_ids=[9])
    v = verify(tree, tokens, logits, params, np.random.default_rng(0), penalize=ctx.apply)
    assert v.path == [0, 1] and v.next_token == 4
    # a committed 3 penalizes the root's row too: no child is the root's choice
    ctx.commit([3])
    v = verify(tree, tokens, logits, params, np.random.default_rng(0), penalize=ctx.apply)
    assert v.path == [0] and v.next_token == 4


def test_seeded_and_rejection_sampling_read_the_penalized_rows():
    tree = Tree.chain(1)
    tokens = np.array([9, 3])
    logits = np.tile(np.array([0, 0, 0, 30.0, 0, 0], np.float32), (2, 1))  # token 3 nearly certain
    ctx = PenaltyContext(Penalties(frequency=2.0, presence=2.0), prompt_ids=[])
    ctx.commit([3] * 20)  # 30 - 2 x 20 - 2: 3 is now far below the rest, never drawn
    params = SamplingParams(1.0)
    for seed in range(20):
        seeded = verify(tree, tokens, logits, params, None, noise=PositionNoise(seed), root=4, penalize=ctx.apply)
        rejected = verify(tree, tokens, logits, params, np.random.default_rng(seed), penalize=ctx.apply)
        for v in (seeded, rejected):
            assert v.path == [0] and v.next_token != 3


def test_a_shorter_row_skips_the_ids_past_it():
    """A draft model's logits may have fewer columns than the target's vocabulary: what lies past them
    is skipped, the rest penalized as in the target's row."""
    ctx = PenaltyContext(Penalties(2.0, frequency=1.0, logit_bias={7: 5.0, 1: 1.0}), prompt_ids=[0, 9])
    ctx.commit([1, 8])
    out = ctx.apply(np.full(4, 2.0, np.float32), path=[6])
    np.testing.assert_array_equal(out, [1.0, 1.0 - 1.0 + 1.0, 2.0, 2.0])


def test_a_row_after_drafts_equals_the_row_after_the_same_tokens_committed():
    """What makes penalties lossless: a verify row penalized by its path is bit for bit the row plain
    decoding penalizes once those tokens are committed (the draft-free walk `ar` takes)."""
    rng = np.random.default_rng(1)
    for trial in range(200):
        pen = Penalties(float(rng.uniform(0.5, 2.0)), float(rng.uniform(-2, 2)), float(rng.uniform(-2, 2)),
                        {int(t): float(rng.uniform(-5, 5)) for t in rng.integers(0, 50, 3)})
        prompt = rng.integers(0, 50, 10).tolist()
        done = rng.integers(0, 50, int(rng.integers(0, 20))).tolist()
        path = rng.integers(0, 50, int(rng.integers(0, 6))).tolist()
        logits = (rng.standard_normal(50) * 4).astype(np.float32)
        walked = PenaltyContext(pen, prompt)
        walked.commit(done)
        committed = PenaltyContext(pen, prompt)
        committed.commit(done)
        committed.commit(path)
        np.testing.assert_array_equal(walked.apply(logits, path), committed.apply(logits, []), err_msg=str(trial))
