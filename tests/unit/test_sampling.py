"""Sampling parameters and the distributions they define (runtime/sampling.py): validation is one
clear error, temperature then top-k then top-p, and the inverse-CDF draw stays in the support."""

from __future__ import annotations

import numpy as np
import pytest

from specdeploy.runtime.errors import SpecDeployError
from specdeploy.runtime.sampling import SamplingParams, sample


@pytest.mark.parametrize("kwargs,needle", [
    ({"temperature": -0.5}, "temperature must be a finite number >= 0"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_k": -1}, "top_k must be an integer >= 0"),
    ({"top_k": 2.0}, "top_k"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"top_p": 1.5}, "top_p"),
    ({"seed": -3}, "seed must be a non-negative integer"),
])
def test_bad_params_are_one_clear_error(kwargs, needle):
    with pytest.raises(SpecDeployError) as err:
        SamplingParams(**kwargs)
    assert needle in str(err.value)


def test_temperature_top_k_and_top_p():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    assert SamplingParams().greedy and not SamplingParams(temperature=0.7).greedy
    np.testing.assert_allclose(SamplingParams(1.0).probs(logits), [0.4, 0.3, 0.2, 0.1])
    np.testing.assert_allclose(SamplingParams(1.0, top_k=2).probs(logits), [4 / 7, 3 / 7, 0, 0])
    np.testing.assert_allclose(SamplingParams(1.0, top_p=0.7).probs(logits), [4 / 7, 3 / 7, 0, 0])  # 0.4+0.3 reach it
    np.testing.assert_allclose(SamplingParams(1.0, top_p=0.75).probs(logits), [4 / 9, 3 / 9, 2 / 9, 0])
    hot, cold = SamplingParams(2.0).probs(logits), SamplingParams(0.5).probs(logits)
    assert hot[0] < 0.4 < cold[0] and hot.sum() == pytest.approx(1) and cold.sum() == pytest.approx(1)
    assert SamplingParams(1.0).probs(logits.astype(np.float32)).dtype == np.float64


def test_sample_stays_in_the_support_and_follows_p():
    rng = np.random.default_rng(0)
    p = np.array([0.0, 0.25, 0.0, 0.75, 0.0])
    draws = np.bincount([sample(p, rng) for _ in range(4000)], minlength=5)
    assert draws[[0, 2, 4]].sum() == 0 and abs(draws[3] / 4000 - 0.75) < 0.03
