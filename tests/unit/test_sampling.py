"""Sampling parameters and the distributions they define (runtime/sampling.py): validation is one
clear error, temperature then top-k then top-p, the inverse-CDF draw stays in the support, and the seeded
draw (noise per (seed, index), an exponential race) is exactly the distribution and couples two of them."""

from __future__ import annotations

import numpy as np
import pytest

from specdeploy.runtime.errors import SpecDeployError
from specdeploy.runtime.sampling import (
    NUCLEUS_FLOORS,
    PositionNoise,
    SamplingParams,
    kth_largest,
    nucleus,
    race,
    sample,
)


@pytest.mark.parametrize("kwargs,needle", [
    ({"temperature": -0.5}, "temperature must be a finite number >= 0"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_k": -1}, "top_k must be an integer >= 0"),
    ({"top_k": 2.0}, "top_k"),
    ({"top_p": -0.1}, "top_p must be in [0, 1]"),
    ({"top_p": 1.5}, "top_p"),
    ({"seed": -3}, "seed must be a non-negative integer"),
    ({"min_p": -0.1}, "min_p must be in [0, 1]"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": float("nan")}, "min_p"),
    ({"min_p": "0.1"}, "min_p"),
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


def test_min_p_keeps_tokens_against_the_likeliest_after_the_other_filters():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    np.testing.assert_allclose(SamplingParams(1.0, min_p=0.5).probs(logits), [4 / 9, 3 / 9, 2 / 9, 0])  # p >= 0.2
    np.testing.assert_array_equal(SamplingParams(1.0, min_p=0.8).probs(logits), [1, 0, 0, 0])  # 0.3 < 0.32
    np.testing.assert_allclose(SamplingParams(1.0, min_p=0.7).probs(logits), [4 / 7, 3 / 7, 0, 0])  # 0.3 >= 0.28
    # after top-k (renormalized: 3/7 against 0.7 x 4/7 = 0.4 stays) and after the temperature
    np.testing.assert_allclose(SamplingParams(1.0, top_k=3, min_p=0.7).probs(logits), [4 / 7, 3 / 7, 0, 0])
    hot = SamplingParams(5.0, min_p=0.9).probs(logits)  # flattened: 0.3 ** 0.2 / 0.4 ** 0.2 = 0.94 stays
    assert hot[1] > 0 and hot[2] == 0 and hot.sum() == pytest.approx(1)
    np.testing.assert_array_equal(SamplingParams(1.0, min_p=1.0).probs(logits), [1, 0, 0, 0])
    np.testing.assert_allclose(SamplingParams(1.0, min_p=0.0).probs(logits), [0.4, 0.3, 0.2, 0.1])


@pytest.mark.filterwarnings("error")  # no overflow, no "invalid value encountered"
@pytest.mark.parametrize("temperature", [1e-310, 5e-324, 1e-300, 1e-30])
def test_a_vanishing_temperature_tends_to_greedy_never_nan(temperature):
    logits = np.array([3.0, 7.5, -2.0, 7.25, 0.0], dtype=np.float32)
    for top_k in (0, 2):
        p = SamplingParams(temperature, top_k=top_k).probs(logits)
        np.testing.assert_array_equal(p, [0, 1, 0, 0, 0])
    tie = SamplingParams(temperature).probs(np.array([1.0, 4.0, 4.0]))
    np.testing.assert_array_equal(tie, [0, 0.5, 0.5])


def test_top_p_zero_keeps_the_most_probable_token():
    logits = np.log(np.array([0.2, 0.5, 0.3]))
    np.testing.assert_array_equal(SamplingParams(1.0, top_p=0).probs(logits), [0, 1, 0])
    np.testing.assert_array_equal(SamplingParams(0.7, top_k=2, top_p=0.0).probs(logits), [0, 1, 0])


def _nucleus_by_full_sort(p, top_p):
    order = np.argsort(-p, kind="stable")
    return order[: int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1]


@pytest.mark.parametrize("scale", [0.3, 1.0, 3.0, 8.0])  # near flat (the whole-vocabulary fallback) to peaky
@pytest.mark.parametrize("top_p", [0.0, 0.5, 0.9, 0.95, 0.999])
def test_the_nucleus_equals_sorting_the_whole_vocabulary(scale, top_p):
    rng = np.random.default_rng(int(scale * 10) + int(top_p * 1000))
    for vocab in (100, 49152):
        logits = rng.standard_normal(vocab) * scale
        logits[rng.integers(0, vocab, 40)] = logits.max()  # ties at the top
        logits = np.round(logits, 1)  # and ties everywhere, the candidates' boundary included
        p = np.exp(logits - logits.max())
        p /= p.sum()
        assert np.array_equal(nucleus(p, top_p), _nucleus_by_full_sort(p, top_p))
    # the sampling distribution itself, bit for bit
    z = rng.standard_normal(49152).astype(np.float32) * 4
    params = SamplingParams(temperature=0.7, top_p=0.95)
    want = np.exp((z.astype(np.float64) - z.max()) / 0.7)
    want /= want.sum()
    kept = _nucleus_by_full_sort(want, 0.95)
    assert len(kept) < 1 / NUCLEUS_FLOORS[-1]
    filtered = np.zeros_like(want)
    filtered[kept] = want[kept]
    assert np.array_equal(params.probs(z), filtered / filtered.sum())


@pytest.mark.parametrize("k", [1, 2, 20, 50, 700, 49151])
def test_kth_largest_equals_selecting_over_the_whole_vocabulary(k):
    rng = np.random.default_rng(k)
    for vocab, scale in ((100, 1.0), (49152, 0.1), (49152, 4.0)):
        if k > vocab:
            continue
        x = np.round(rng.standard_normal(vocab) * scale, 1).astype(np.float32)  # ties everywhere
        x[rng.integers(0, vocab, 30)] = x.max()
        assert kth_largest(x, k) == np.partition(x, vocab - k)[vocab - k]


def test_top_k_filters_as_over_the_whole_vocabulary_ties_included():
    rng = np.random.default_rng(3)
    z = np.round(rng.standard_normal(49152) * 3, 1).astype(np.float32)
    for top_k, top_p in ((20, 1.0), (50, 0.9), (1, 1.0)):
        w = (z.astype(np.float64) - z.max()) / 0.7
        kth = np.partition(w, -top_k)[-top_k]
        want = np.exp(np.where(w >= kth, w, -np.inf))
        want /= want.sum()
        if top_p < 1:
            kept = _nucleus_by_full_sort(want, top_p)
            filtered = np.zeros_like(want)
            filtered[kept] = want[kept]
            want = filtered / filtered.sum()
        got = SamplingParams(0.7, top_k=top_k, top_p=top_p).probs(z)
        assert np.array_equal(got > 0, want > 0) and ((got > 0).sum() >= top_k or top_p < 1)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)


def test_sample_stays_in_the_support_and_follows_p():
    rng = np.random.default_rng(0)
    p = np.array([0.0, 0.25, 0.0, 0.75, 0.0])
    draws = np.bincount([sample(p, rng) for _ in range(4000)], minlength=5)
    assert draws[[0, 2, 4]].sum() == 0 and abs(draws[3] / 4000 - 0.75) < 0.03


@pytest.mark.parametrize("kwargs,needle", [
    ({"seed": 2**64}, "seed must be below 2**64"),
    ({"sampling": "gumbel"}, "sampling must be one of seeded, rejection"),
])
def test_bad_seed_or_scheme_is_one_clear_error(kwargs, needle):
    with pytest.raises(SpecDeployError) as err:
        SamplingParams(**kwargs)
    assert needle in str(err.value)


def test_position_noise_depends_on_seed_and_index_alone():
    a = PositionNoise(7, keep=2)
    first = {i: a.exponentials(i, 50).copy() for i in (30, 4, 1000)}  # out of order, evicting
    b = PositionNoise(7)
    for i in (1000, 4, 30):
        np.testing.assert_array_equal(b.exponentials(i, 50), first[i])
        np.testing.assert_array_equal(PositionNoise(7).exponentials(i, 80)[:50], first[i])  # a longer draw: a prefix
    assert not np.array_equal(PositionNoise(8).exponentials(4, 50), first[4])
    assert not np.array_equal(first[4], first[30])
    assert (first[4] > 0).all() and np.isfinite(first[4]).all()
    assert PositionNoise(2**64 - 1).exponentials(0, 3).shape == (3,)


def test_seeded_draw_is_exactly_the_distribution():
    """One draw per (seed, index), as generation makes them: frequencies follow p (chi-square),
    and a token outside the support (top-k/top-p zeros) never wins."""
    from scipy.stats import chisquare

    p = np.array([0.0, 0.05, 0.3, 0.0, 0.15, 0.01, 0.49, 0.0])
    draws = [PositionNoise(seed).sample(p, index) for seed in range(400) for index in (0, 17, 4095, 10**9, 2**40)]
    counts = np.bincount(draws, minlength=len(p))
    assert counts[p == 0].sum() == 0
    assert chisquare(counts[p > 0], p[p > 0] * len(draws)).pvalue > 1e-3


def test_draws_at_neighbouring_positions_are_independent():
    """The joint of the draws at indices i and i+1 of one seed is the product of their
    distributions (shared noise would make equal distributions draw equal tokens)."""
    from scipy.stats import chisquare

    p = np.array([0.4, 0.3, 0.2, 0.1])
    pairs = [(PositionNoise(seed).sample(p, 9), PositionNoise(seed).sample(p, 10)) for seed in range(3000)]
    counts = np.bincount([4 * a + b for a, b in pairs], minlength=16)
    assert chisquare(counts, np.outer(p, p).ravel() * len(pairs)).pvalue > 1e-3


def test_racing_the_same_noise_couples_two_distributions():
    """A draft racing q with the target's noise agrees with the target's draw from p at least
    (1 - TV) / (1 + TV) of the time (the Gumbel-max coupling); independent draws agree far less."""
    rng = np.random.default_rng(3)
    p = rng.dirichlet(np.ones(50) * 0.3)
    q = 0.7 * p + 0.3 * rng.dirichlet(np.ones(50) * 0.3)
    tv = 0.5 * np.abs(p - q).sum()
    runs = 4000
    same = sum(race(p, e) == race(q, e) for e in (PositionNoise(s).exponentials(0, 50) for s in range(runs)))
    independent = sum(sample(p, rng) == sample(q, rng) for _ in range(runs))
    assert same / runs > (1 - tv) / (1 + tv) - 0.02
    assert same > 2 * independent


def test_released_noise_is_forgotten_and_drawn_again_the_same():
    noise = PositionNoise(5)
    kept = {i: noise.exponentials(i, 8).copy() for i in range(10, 20)}
    noise.release(15)
    assert sorted(noise._cache) == list(range(15, 20))
    np.testing.assert_array_equal(noise.exponentials(12, 8), kept[12])


def test_numpy_numbers_are_numbers():
    """np.float32(0.5) was refused as 'temperature must be a finite number >= 0' (and np.int64 as top_k or
    seed): numbers of any kind are taken, as Python floats and ints; bools and non-numbers still are not."""
    p = SamplingParams(np.float32(0.5), np.int64(5), np.float16(0.5), np.uint64(2**64 - 1))
    assert (p.temperature, p.top_k, p.top_p, p.seed) == (0.5, 5, 0.5, 2**64 - 1)
    assert [type(v) for v in (p.temperature, p.top_k, p.top_p, p.seed)] == [float, int, float, int]
    assert p == SamplingParams(0.5, 5, 0.5, 2**64 - 1)
    assert SamplingParams(np.float64(0.0)).greedy and SamplingParams(np.int32(1)).temperature == 1.0
    for kwargs, needle in [({"temperature": np.bool_(True)}, "temperature"), ({"temperature": 10**400}, "temperature"),
                           ({"temperature": "0.5"}, "temperature"), ({"top_k": np.float64(2.0)}, "top_k"),
                           ({"top_p": np.float32("nan")}, "top_p"), ({"seed": np.int64(-1)}, "seed must be a non"),
                           ({"seed": np.bool_(False)}, "seed")]:
        with pytest.raises(SpecDeployError, match=needle):
            SamplingParams(**kwargs)
