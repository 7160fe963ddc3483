"""Lookahead decoding and prompt lookup on exports: greedy equality, lossless sampling, the packed call,
the pool learning from the window, configs against the export. The window layout, the trie, the n-gram
pool, find_continuation and config validation alone are in tests/unit/."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from conftest import hf_greedy, run_cli
from scipy.stats import chisquare

from specdeploy.runtime.drafters.base import DecodeState
from specdeploy.runtime.drafters.lookahead import LookaheadConfig, LookaheadDrafter
from specdeploy.runtime.errors import SpecDeployError
from specdeploy.runtime.sampling import SamplingParams

# Prompts ending mid-line: the micro target continues them with varied code before it loops.
PROMPTS = [
    "def test_inherited_slots(self):\n    # returns descriptor\n    class Thing(object):\n    ",
    "    def __init__(self, name, value=None):\n        self.",
    "import os\nimport sys\n\n\nclass Config",
    "        self.assertEqual(a, 1)\n        self.assertEqual(b, 2)\n        self.assertEqual(c, 3)\n        self.",
]
NEW = 40
# Small windows and n-gram sizes too: they run on the default export's graphs (padded).
LOOKAHEAD_CONFIGS = [None, {"window": 3, "ngram": 2, "guesses": 2}, {"window": 2, "ngram": 3, "guesses": 5}]
PROMPT_LOOKUP_CONFIGS = [None, {"k": 2, "max_ngram": 1}, {"k": 3, "max_ngram": 4, "min_ngram": 2}]


def _target_only_export(model_dir, tmp_path_factory, name):
    """The target alone, default config: it must hold every graph lookahead and prompt lookup need.
    (A private directory: parallel test sessions re-export the shared ones.)"""
    from specdeploy.export.exporter import export_all

    return export_all(model_dir, tmp_path_factory.mktemp(name) / "export", progress=lambda m: None)


@pytest.fixture(scope="module")
def micro_target_export(micro_family, tmp_path_factory):
    return _target_only_export(micro_family / "target", tmp_path_factory, "micro")


@pytest.fixture(scope="module")
def micro(micro_target_export):
    from specdeploy.runtime.loaded_export import LoadedExport

    return LoadedExport(micro_target_export, threads=1)


@pytest.fixture(scope="module")
def qwen3_export(random_models, tmp_path_factory):
    return _target_only_export(random_models["qwen3"][0], tmp_path_factory, "qwen3")


@functools.lru_cache(maxsize=None)
def _hf_reference(model_dir, ids: tuple[int, ...]) -> list[int]:
    return hf_greedy(model_dir, list(ids), NEW)  # HF generate is slow on CPU: once per prompt


def _greedy_mismatches(export, model_dir, prompts, runs):
    from specdeploy.runtime.generate import generate

    bad, accepted = [], 0
    for prompt in prompts:
        ids = export.tokenizer.encode(prompt)
        want = _hf_reference(model_dir, tuple(ids))
        for method, overrides in runs:
            r = generate(export, ids, method=method, max_new_tokens=NEW, ignore_eos=True, method_overrides=overrides)
            accepted += r.stats["accepted_drafts"]
            if r.token_ids != want:
                bad.append((prompt, method, overrides, r.token_ids, want))
    return bad, accepted


@pytest.mark.parametrize("method,configs", [("lookahead", LOOKAHEAD_CONFIGS), ("prompt-lookup", PROMPT_LOOKUP_CONFIGS)])
def test_micro_greedy_equals_hf(micro, micro_family, method, configs):
    bad, accepted = _greedy_mismatches(micro, micro_family / "target", PROMPTS, [(method, c) for c in configs])
    assert not bad, bad[0]
    assert accepted > 3 * len(PROMPTS)  # drafts were really proposed and accepted


def test_qwen3_greedy_equals_hf(qwen3_export, random_models):
    from specdeploy.runtime.loaded_export import LoadedExport

    export = LoadedExport(qwen3_export, threads=1)
    assert {"lookahead", "prompt-lookup"} <= set(export.methods)
    runs = [("lookahead", None), ("lookahead", {"window": 4, "ngram": 3, "guesses": 3}), ("prompt-lookup", None)]
    bad, accepted = _greedy_mismatches(export, random_models["qwen3"][0], PROMPTS[:2], runs)
    assert not bad, bad[0]
    assert accepted > 0


# ---------------------------------------------------------------- sampling is lossless


def exact_continuations(export, ids, params, length):
    """{continuation: probability} of the target's first `length` sampled tokens, from its own logits."""
    dec = export.decoder("target")
    dec.reset()
    dec.prefill(ids[:-1], export.prefill_chunk)
    base = dec.cache.length
    dist = {}

    def walk(prefix, prob):
        if len(prefix) == length:
            dist[tuple(prefix)] = prob
            return
        seq = [ids[-1], *prefix]
        dec.cache.truncate(base)
        out = dec.forward(np.array(seq), base + np.arange(len(seq)), np.tril(np.ones((len(seq), len(seq)), bool)))
        p = params.probs(out.logits[-1])
        for x in np.flatnonzero(p):
            walk([*prefix, int(x)], prob * p[x])

    walk([], 1.0)
    return dist


def chi_square_pvalue(samples, dist):
    keys = sorted(dist)
    counts = np.array([samples.count(k) for k in keys], float)
    assert counts.sum() == len(samples), "a continuation outside the target's support"
    expected = np.array([dist[k] for k in keys]) * len(samples)
    rare = expected < 5  # pooled, so the chi-square approximation holds
    obs, exp = np.append(counts[~rare], counts[rare].sum()), np.append(expected[~rare], expected[rare].sum())
    keep = exp > 0
    return chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue


SAMPLING_RUNS = 800


# Under the root `.`, the prompt's n-grams start with different tokens (a trie with
# siblings), some likely under the target and some not.
SAMPLING_PROMPT = ("        self.assertEqual(a, 1)\n        self.assertTrue(b)\n"
                   "        self.assertIn(c, d)\n        self.")


@pytest.mark.parametrize("method,overrides", [("lookahead", {"window": 4, "ngram": 3, "guesses": 4}),
                                              ("prompt-lookup", {"k": 2})])
def test_sampling_matches_target_distribution(micro, method, overrides):
    """Three sampled tokens over many seeds follow the target's exact joint distribution.

    Candidates are two tokens long, so the third token is sometimes the bonus after a
    fully accepted candidate, sometimes a residual draw after rejections. Checked by
    hand with broken verifiers: sampling the residual from p (no zeroing), not
    renormalizing after a rejected sibling (lookahead's trie), or drawing the leaf's
    bonus from its parent's distribution each fail here (p < 1e-6 and/or tokens outside
    the support).
    """
    from specdeploy.runtime.generate import generate

    params = SamplingParams(temperature=1.0, top_k=4)
    ids = micro.tokenizer.encode(SAMPLING_PROMPT)
    dist = exact_continuations(micro, ids, params, 3)
    samples, accepted = [], 0
    for seed in range(SAMPLING_RUNS):
        p = SamplingParams(temperature=1.0, top_k=4, seed=seed)
        r = generate(micro, ids, method=method, params=p, max_new_tokens=3, ignore_eos=True, method_overrides=overrides)
        samples.append(tuple(r.token_ids))
        accepted += r.stats["accepted_drafts"]
    assert 0.3 < accepted / SAMPLING_RUNS < 1.8  # drafts are accepted, and rejected, often
    assert chi_square_pvalue(samples, dist) > 1e-3


# ---------------------------------------------------------------- the packed call


@pytest.mark.parametrize("window,ngram,guesses", [(3, 4, 2), (3, 2, 3), (4, 3, 2), (2, 5, 1)])  # T <= 16
def test_packed_rows_equal_sequential_decoding(micro, window, ngram, guesses):
    """Each row of the one packed call (tree nodes, then the Jacobi window) has the logits of
    decoding its visible tokens one by one; tree rows see no window token and vice versa."""
    target = micro.decoder("target")
    prompt = micro.tokenizer.encode(PROMPTS[1])
    drafter = LookaheadDrafter(window, ngram, guesses)
    state = DecodeState(list(prompt), SamplingParams(), np.random.default_rng(0))
    drafter.start(state)
    root = prompt[-1]
    for cand in [(9, 10, 11, 3), (5, 12, 13, 3), (5, 6, 8, 3), (5, 6, 7, 3)]:  # the latest share a prefix: a real trie
        drafter.pool.add(root, cand[: ngram - 1])
    proposal = drafter.propose(state)
    assert proposal.tree.size >= 3  # candidates are in the call
    assert proposal.size <= LookaheadConfig(window, ngram, guesses).verify_tokens

    target.reset()
    target.prefill(prompt[:-1], micro.prefill_chunk)
    start = target.cache.length
    tokens, positions, mask = proposal.packed(start)
    out = target.forward(tokens, positions, mask)
    tree_size = proposal.tree.size
    for row in range(len(tokens)):
        cols = np.flatnonzero(mask[row])
        cols = cols[np.argsort(positions[cols])]
        assert cols[-1] == row
        assert positions[cols].tolist() == list(range(start, positions[row] + 1)), "not a causal run"
        assert (cols < tree_size).all() if row < tree_size else set(cols[cols < tree_size]) == {0}
        target.cache.truncate(start)
        for c in cols:
            step = target.forward(tokens[c : c + 1], positions[c : c + 1], np.ones((1, 1), bool))
            target.commit(step, [0])
        np.testing.assert_allclose(out.logits[row], step.logits[0], rtol=1e-4, atol=1e-4, err_msg=f"row {row}")
    target.reset()


# ---------------------------------------------------------------- the n-gram pool, learning


def test_lookahead_seeds_pool_from_prompt_and_learns_from_window(micro):
    from specdeploy.runtime.generate import Generation

    ids = micro.tokenizer.encode(PROMPTS[3])
    gen = Generation(micro, ids, method="lookahead", max_new_tokens=30, ignore_eos=True,
                     method_overrides={"window": 4, "ngram": 3, "guesses": 2})
    drafter = gen.drafter
    drafter.start(gen.state)
    assert all(len(drafter.pool.get(k)) <= 2 for k in set(ids))
    # the prompt's trigrams, keyed by their first token, the latest kept
    assert drafter.pool.get(ids[0]) == [tuple(ids[1:3])]
    assert tuple(ids[-3:-1]) in drafter.pool.get(ids[-4])
    before = {k: drafter.pool.get(k) for k in range(micro.manifest.models["target"].vocab_size)}
    r = gen.result()
    after = {k: drafter.pool.get(k) for k in before}
    assert r.stats["accepted_drafts"] > 0 and before != after


# ---------------------------------------------------------------- prompt lookup


def test_prompt_lookup_k_bounds_each_step(micro):
    from specdeploy.runtime.generate import generate

    ids = micro.tokenizer.encode(PROMPTS[3])
    lengths = {}
    for k in (1, 4):
        r = generate(micro, ids, method="prompt-lookup", max_new_tokens=NEW, ignore_eos=True, method_overrides={"k": k})
        lengths[k] = r.stats["acceptance_length"]
    assert lengths[1] <= 2.0 < lengths[4]


# ---------------------------------------------------------------- configs against the export, the CLI


def test_lookahead_too_big_for_max_context_fails_before_export(micro_family, tmp_path):
    from specdeploy.export.exporter import export_all

    cfg = tmp_path / "big.yaml"
    cfg.write_text("max_context: 64\nprefill_chunk: 16\nmethods:\n  lookahead: {window: 20, ngram: 4, guesses: 5}\n")
    out = tmp_path / "out"
    with pytest.raises(SpecDeployError) as err:
        export_all(micro_family / "target", out, config=cfg, progress=lambda m: None)
    assert "methods.lookahead needs a verify graph of 75 tokens" in str(err.value)
    assert "max_context 64" in str(err.value)
    assert not out.exists()


def test_override_bigger_than_export_is_refused(micro):
    from specdeploy.runtime.generate import Generation

    with pytest.raises(SpecDeployError) as err:
        Generation(micro, [1, 2, 3], method="lookahead", method_overrides={"window": 40})
    assert "needs a target graph of" in str(err.value) and "re-export" in str(err.value)


@pytest.mark.parametrize("method", ["lookahead", "prompt-lookup"])
def test_cli_generate_json(micro_target_export, method):
    proc = run_cli("generate", micro_target_export, "--method", method, "--prompt", PROMPTS[3],
                   "--max-new-tokens", "12", "--ignore-eos", "--json", env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["token_ids"]) == 12 and result["stats"]["method"] == method
    assert result["stats"]["acceptance_length"] > 1


def test_cli_bad_param_is_one_line_error(micro_target_export):
    proc = run_cli("generate", micro_target_export, "--method", "lookahead", "--prompt", "x", "--param", "ngram=1")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: config: lookahead.ngram must be an integer >= 2, got 1"
    proc = run_cli("generate", micro_target_export, "--method", "prompt-lookup", "--prompt", "x", "--param", "k")
    assert proc.returncode == 2 and proc.stderr.startswith("error: --param expects KEY=VALUE")
