"""Speculative sampling reproduces the target's own sampling distribution, in both schemes.

Exact reference: the target's joint distribution of the first two new tokens
(under temperature/top-k), computed from its logits. A wrong residual (sampling
from p instead of norm(max(0, p - q)) after a rejection) or a wrong bonus token
shifts these frequencies far beyond the chi-square threshold used here. (Seeded
sampling is also token-identical to ar's: tests/test_seed_exact.py; its draws at two
positions are independent: tests/unit/test_sampling.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from specdeploy.runtime.sampling import PositionNoise, SamplingParams, sample
from specdeploy.runtime.tree import Tree
from specdeploy.runtime.verify import verify_sampling, verify_seeded

RUNS = 1500


def exact_two_token_dist(export, ids, params):
    """{(x1, x2): probability} under the target, via our own ar decoder's logits."""
    dec = export.decoder("target")
    dec.reset()
    dec.prefill(ids[:-1], export.prefill_chunk)
    base = len(ids)
    out = dec.forward(np.array(ids[-1:]), np.array([base - 1]), np.ones((1, 1), bool))
    dec.commit(out, slice(0, 1))
    p1 = params.probs(out.logits[0])
    dist = {}
    for x1 in np.flatnonzero(p1):
        dec.cache.length = base
        out2 = dec.forward(np.array([x1]), np.array([base]), np.ones((1, 1), bool))
        p2 = params.probs(out2.logits[0])
        for x2 in np.flatnonzero(p2):
            dist[(int(x1), int(x2))] = p1[x1] * p2[x2]
    return dist


def chi_square_pvalue(samples, dist):
    keys = sorted(dist)
    counts = np.array([samples.count(k) for k in keys], float)
    assert counts.sum() == len(samples), "a sample fell outside the target's support"
    expected = np.array([dist[k] for k in keys]) * len(samples)
    # Pool rare cells so the chi-square approximation holds.
    rare = expected < 5
    obs = np.append(counts[~rare], counts[rare].sum())
    exp = np.append(expected[~rare], expected[rare].sum())
    keep = exp > 0
    return chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue


TOP6 = dict(temperature=1.3, top_k=6)
MIN_P = dict(temperature=1.6, top_k=12, min_p=0.15)  # min-p cuts some of top-k's tokens here (checked below)


@pytest.mark.parametrize("method,overrides,scheme,kw", [
    ("draft", {"k": 1}, "rejection", TOP6), ("draft", {"k": 4}, "rejection", TOP6), ("ar", None, "rejection", TOP6),
    ("draft", {"k": 4}, "seeded", TOP6), ("ar", None, "seeded", TOP6),
    # the draft model's sampled drafts in a fused tree: verified as the point masses they are once drawn
    ("draft+suffix", {"lazy": False}, "rejection", TOP6),
    ("draft", {"k": 4}, "rejection", MIN_P),
])
def test_speculative_sampling_matches_target_distribution(micro_export, method, overrides, scheme, kw):
    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.loaded_export import LoadedExport

    export = LoadedExport(micro_export)
    params = SamplingParams(**kw)
    ids = export.tokenizer.encode("def foo(x):\n    return")
    dist = exact_two_token_dist(export, ids, params)
    if "min_p" in kw:  # the filter really acts: fewer pairs than top-k alone allows
        assert len(dist) < len(exact_two_token_dist(export, ids, SamplingParams(kw["temperature"], kw["top_k"])))
    samples = []
    for seed in range(RUNS):
        p = SamplingParams(**kw, seed=seed, sampling=scheme)
        r = generate(export, ids, method=method, params=p, max_new_tokens=2, ignore_eos=True,
                     method_overrides=overrides)
        assert r.stats["sampling"] == scheme
        samples.append(tuple(r.token_ids))
    assert chi_square_pvalue(samples, dist) > 1e-3


@pytest.mark.parametrize("kw", [
    dict(temperature=0.7), dict(temperature=1.3, top_k=50), dict(temperature=1.0, top_p=0.8),
    dict(temperature=0.9, min_p=0.05), dict(temperature=1.5, top_k=200, top_p=0.95, min_p=0.02),
    dict(temperature=1.0, top_p=0.0), dict(temperature=2.0, min_p=0.3)])
def test_the_sampling_distribution_is_hf_transformers(kw):
    """temperature, top-k, top-p and min-p mean what they mean in HF transformers: its logits warpers, in
    generate()'s order, leave the same tokens with the same probabilities."""
    import torch
    from transformers import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = LogitsProcessorList([TemperatureLogitsWarper(kw["temperature"])])
    if kw.get("top_k"):
        warpers.append(TopKLogitsWarper(kw["top_k"]))
    if kw.get("top_p", 1.0) < 1.0:
        warpers.append(TopPLogitsWarper(kw["top_p"]))
    if kw.get("min_p"):
        warpers.append(MinPLogitsWarper(kw["min_p"]))
    rng = np.random.default_rng(7)
    for _ in range(20):
        logits = (rng.standard_normal(2000) * rng.uniform(1, 4)).astype(np.float32)
        ours = SamplingParams(**kw).probs(logits)
        theirs = torch.softmax(warpers(None, torch.from_numpy(logits)[None].double())[0], -1).numpy()
        np.testing.assert_array_equal(ours > 0, theirs > 0)
        np.testing.assert_allclose(ours, theirs, rtol=1e-9, atol=1e-15)


def _tree_sample_freqs(tree, tokens, logits, params, draft_probs, runs, seed, seeded=False):
    rng = np.random.default_rng(seed)
    firsts = np.zeros(logits.shape[1])
    for run in range(runs):
        if seeded:  # one request per run: its own seed
            v = verify_seeded(tree, tokens, logits, params, PositionNoise(seed * runs + run), root=11)
        else:
            v = verify_sampling(tree, tokens, logits, params, rng, draft_probs)
        emitted = [int(tokens[i]) for i in v.path[1:]] + [v.next_token]
        firsts[emitted[0]] += 1
    return firsts / runs


@pytest.mark.parametrize("seeded", [False, True], ids=["rejection", "seeded"])
def test_tree_sampling_is_lossless_for_deterministic_siblings(seeded):
    """Medusa/lookahead-style trees: several top-k siblings, no draft distribution. Seeded accepts
    some sibling exactly as often as rejection sampling: p(2) + p(4) + p(5)."""
    rng = np.random.default_rng(0)
    vocab = 6
    logits = rng.normal(size=(4, vocab)) * 1.5
    tree = Tree(parents=(-1, 0, 0, 0))
    tokens = np.array([0, 2, 4, 5])  # three deterministic candidates under the root
    params = SamplingParams(temperature=1.0)
    runs = 20000
    freqs = _tree_sample_freqs(tree, tokens, logits, params, None, runs, 1, seeded)
    p = params.probs(logits[0])
    assert np.abs(freqs - p).max() < 0.015


def test_chain_rejection_sampling_is_lossless_with_draft_distribution():
    rng = np.random.default_rng(1)
    vocab = 5
    logits = rng.normal(size=(2, vocab)) * 2
    q = np.array([0.05, 0.6, 0.05, 0.25, 0.05])
    params = SamplingParams(temperature=1.0)
    firsts = np.zeros(vocab)
    draw = np.random.default_rng(2)
    runs = 20000
    for _ in range(runs):
        x = sample(q, draw)
        tokens = np.array([0, x])
        v = verify_sampling(Tree.chain(1), tokens, logits, params, draw, np.stack([q, q]))
        firsts[x if len(v.path) > 1 else v.next_token] += 1
    assert np.abs(firsts / runs - params.probs(logits[0])).max() < 0.015
