"""Adaptive speculation (runtime/adaptive.py): the policy on a synthetic clock, and the
loop with steps skipped: greedy output stays ar's for every method, sampling stays exact."""

from __future__ import annotations

import math

import numpy as np
import pytest

from specdeploy.runtime.adaptive import (
    MAX_BACKOFF,
    MAX_CONFIGS,
    MIN_BACKOFF,
    AdaptivePolicy,
    Average,
    Memory,
    Speculated,
)
from specdeploy.runtime.drafters.fused import CONFIGS as FUSED_CONFIGS
from specdeploy.runtime.methods import known_methods

SPECULATIVE = [m for m in known_methods() if m != "ar"]
# host drafters that price their rows, and the fused methods (lazy: they price their model part's drafts
# per step): no step-time policy
SIZES_OWN_ROWS = {"prompt-lookup", "suffix"} | {c.method for c in FUSED_CONFIGS}

# ---------------------------------------------------------------- the policy, synthetic clock


def simulate(policy, steps: int, spec_s, plain_s, tokens, noise: float = 0.0, seed: int = 0):
    """Drive the policy: spec_s/plain_s/tokens are constants or functions of (step index, rng).
    Returns (kinds: list[bool], tokens committed, seconds spent)."""
    rng = np.random.default_rng(seed)
    at = lambda v, i: v(i, rng) if callable(v) else v  # noqa: E731
    kinds, total_tokens, total_s = [], 0, 0.0
    for i in range(steps):
        spec = policy.speculate()
        n = at(tokens, i) if spec else 1
        s = (at(spec_s, i) if spec else at(plain_s, i)) * (1 + noise * rng.uniform(-1, 1))
        policy.observe(spec, s, n)
        kinds.append(spec)
        total_tokens, total_s = total_tokens + n, total_s + s
    return kinds, total_tokens, total_s


def geometric(p: float, k: int = 14):
    """Tokens of a speculative step: the bonus plus a run of accepted drafts (each with probability p), at most k."""
    def draw(i, rng):
        n = 1
        while n <= k and rng.random() < p:
            n += 1
        return n
    return draw


def probe_gaps(kinds: list[bool]) -> list[int]:
    """Lengths of the runs of plain steps between speculative ones."""
    gaps, run = [], 0
    for spec in kinds:
        if spec:
            if run:
                gaps.append(run)
            run = 0
        else:
            run += 1
    return gaps


def test_falls_back_when_speculation_loses_and_probes_with_growing_backoff():
    # A speculative step costs 1.6 plain steps and yields 1.2 tokens: plain is faster.
    kinds, _, _ = simulate(AdaptivePolicy(), 400, spec_s=1.6, plain_s=1.0, tokens=1.2)
    # Learn speculation (the first step's time is no sample), then time plain (the first plain step
    # on a fresh export runs a cold graph: no sample either), and fall back once three speculative
    # samples say so (fewer say nothing about their spread).
    assert kinds[:6] == [True, True, False, False, True, False]
    assert sum(kinds) < 15
    # The backoff counts probe costs (1.6 plain steps), doubles while probes lose, and is capped.
    want = [2] + [math.ceil(b * 1.6) for b in (MIN_BACKOFF, 4, 8, 16, 32)]
    gaps = probe_gaps(kinds)
    assert gaps[:6] == want and set(gaps[6:-1]) == {math.ceil(MAX_BACKOFF * 1.6)}


def test_keeps_speculating_while_it_wins_and_retimes_plain_rarely():
    kinds, _, _ = simulate(AdaptivePolicy(), 200, spec_s=1.6, plain_s=1.0, tokens=3.0)
    plain = [i for i, spec in enumerate(kinds) if not spec]
    assert plain[:2] == [2, 3] and all(b - a == MAX_BACKOFF + 1 for a, b in zip(plain[1:], plain[2:]))


def test_comes_back_when_acceptance_recovers_and_leaves_when_it_drops():
    # Low acceptance for 100 steps (chat), then a long copied span, then low again.
    tokens = lambda i, rng: 1.1 if i < 100 or i >= 250 else 6.0  # noqa: E731
    kinds, _, _ = simulate(AdaptivePolicy(), 400, spec_s=1.6, plain_s=1.0, tokens=tokens)
    assert sum(kinds[50:100]) <= 2
    back = next(i for i in range(100, 250) if kinds[i] and kinds[i + 1] and kinds[i + 2])
    assert back <= 100 + math.ceil(MAX_BACKOFF * 1.6) + 1  # the next probe wins: speculation resumes at once
    assert sum(kinds[back:250]) >= (250 - back) * 0.9
    leave = next(i for i in range(250, 400) if not kinds[i])
    assert leave <= 250 + 30  # the average decays below the break-even within a few tens of low steps
    assert sum(kinds[320:]) <= 3


def test_first_steps_and_stalls_are_not_timed_as_they_ran():
    """The first drafting step pays the drafter's catch-up on the prompt, the first plain step on a
    fresh export a cold graph, and any step may stall (another process): none of these slow
    outliers may switch speculation off, or on."""
    spec_s = lambda i, rng: 50.0 if i in (0, 30) else 1.2  # noqa: E731
    plain_s = lambda i, rng: 40.0 if i == 2 else 1.0  # noqa: E731
    kinds, _, _ = simulate(AdaptivePolicy(), 60, spec_s=spec_s, plain_s=plain_s, tokens=2.0)
    assert sum(kinds) >= 56
    plain_s = lambda i, rng: 40.0 if i in (2, 3) else 1.0  # noqa: E731
    policy = AdaptivePolicy()
    kinds, _, _ = simulate(policy, 200, spec_s=1.6, plain_s=plain_s, tokens=1.1)  # the timed plain step stalls
    assert sum(kinds[100:]) <= 3


def test_a_probe_pays_the_catch_up_on_the_plain_steps_before_it():
    """A draft model's first drafting step after plain steps also feeds it their tokens (one call
    over as many rows): a probe costs more the longer it waited. That is no drafting step's cost, so
    a winning method that went plain for a while resumes instead of staying plain for good."""
    waited = [0]

    def spec_s(i, rng):
        cost, waited[0] = 1.6 + 0.1 * waited[0], 0  # the catch-up: 0.1 a plain step before it
        return cost

    def plain_s(i, rng):
        waited[0] += 1
        return 1.0

    tokens = lambda i, rng: 1 if 20 <= i < 40 else 2.4  # noqa: E731  a low stretch, then 1.5x plain's rate
    kinds, _, _ = simulate(AdaptivePolicy(), 300, spec_s=spec_s, plain_s=plain_s, tokens=tokens)
    assert sum(kinds[40:]) >= 0.8 * 260, probe_gaps(kinds[40:])


def test_early_slow_drafting_steps_do_not_keep_a_winning_method_plain():
    """A fresh export's first calls of each size are slow (cold graphs): a high first estimate of a
    drafting step's time made the policy go plain, and with probes untimed nothing re-timed it.
    Probes lower it, so a method that wins at its real cost comes back."""
    spec_s = lambda i, rng: 5.0 if i < 3 else 1.6  # noqa: E731
    kinds, _, _ = simulate(AdaptivePolicy(), 300, spec_s=spec_s, plain_s=1.0, tokens=2.4)
    assert sum(kinds[100:]) >= 0.9 * 200, probe_gaps(kinds)


def test_plain_steps_before_any_drafting_step():
    """Step times known from earlier requests, and the drafter proposes nothing at first (no match)."""
    memory = Memory(Average(value=1.0, count=2), {"m": Speculated(Average(value=1.6, count=2))})
    policy = AdaptivePolicy.resume(memory, "m")
    for _ in range(3):
        assert policy.speculate()
        policy.observe(False, 1.0, 1)
    policy.observe(True, 1.6, 5)
    assert policy.speculate() and not policy.plain_mode


def test_a_step_that_drafted_nothing_is_a_plain_sample():
    policy = AdaptivePolicy()
    kinds, _, _ = simulate(policy, 10, spec_s=1.6, plain_s=1.0, tokens=3)
    assert kinds.count(False) == 2 and policy.plain_seconds.count == 1 and policy.speculate()
    policy.observe(False, 1.2, 1)  # speculation was allowed, the drafter proposed nothing (no match)
    assert policy.plain_seconds.count == 2 and policy.since_plain == 0 and policy.speculate()


@pytest.mark.parametrize("p", [0.0, 0.2, 0.4, 0.5, 0.6, 0.8])
def test_rate_is_near_the_faster_kind_of_step_under_noise(p):
    """1000 steps with noisy timings and per-step acceptance (8 seeds): never below plain decoding
    by more than a few %, and on average within a few % of always-plain or always-speculate,
    whichever is faster. (An unlucky run of probes can hold a winning method off for a while.)"""
    spec_s, plain_s, draw = 1.6, 1.0, geometric(p)
    mean = np.mean([draw(0, np.random.default_rng(i)) for i in range(20000)])
    best = max(1.0 / plain_s, mean / spec_s)
    rates = []
    for seed in range(8):
        _, n, s = simulate(AdaptivePolicy(), 1000, spec_s=spec_s, plain_s=plain_s, tokens=draw, noise=0.3, seed=seed)
        rates.append(n / s)
    assert min(rates) >= 0.95 / plain_s, rates
    assert np.mean(rates) >= 0.93 * best, (rates, best)


def test_memory_carries_over_to_the_next_request():
    memory = Memory()
    first = AdaptivePolicy.resume(memory, "m")
    simulate(first, 100, spec_s=1.6, plain_s=1.0, tokens=1.1)
    first.remember(memory, "m")
    m = memory.spec["m"]
    assert memory.plain.value == pytest.approx(1.0) and m.seconds.value == pytest.approx(1.6)
    assert m.plain_mode and first.backoff > MIN_BACKOFF
    # The next request starts plain, with probes of its own: at its first drafting step, then on its own
    # backoff from the shortest (no plain timing up front). A losing method pays a few probes per request.
    kinds, tokens, seconds = simulate(AdaptivePolicy.resume(memory, "m"), 100, spec_s=1.6, plain_s=1.0, tokens=1.1)
    assert kinds[:2] == [True, True] and kinds.index(True, 2) == 2 + math.ceil(MIN_BACKOFF * 1.6)
    assert sum(kinds) <= 8 and tokens / seconds >= 0.95
    # A request whose answer starts copying late, after requests that lost: speculation resumes within
    # a few steps of it (the last request's backoff does not hold it plain).
    kinds, _, _ = simulate(AdaptivePolicy.resume(memory, "m"), 60, spec_s=1.6, plain_s=1.0,
                           tokens=lambda i, rng: 1.0 if i < 10 else 5.0)
    assert all(kinds[12:40])  # (then a plain step is re-timed now and then)
    # A prompt the answer copies wins its start probe: speculation resumes at once.
    kinds, _, _ = simulate(AdaptivePolicy.resume(memory, "m"), 20, spec_s=1.6, plain_s=1.0, tokens=6.0)
    assert all(kinds)
    # A method config not seen yet starts from nothing.
    assert AdaptivePolicy.resume(memory, "other").speculate()
    # A request where speculation wins leaves it on for the next one.
    again = AdaptivePolicy.resume(memory, "m")
    simulate(again, 300, spec_s=1.6, plain_s=1.0, tokens=lambda i, rng: 1.1 if i < 60 else 5.0)
    again.remember(memory, "m")
    assert AdaptivePolicy.resume(memory, "m").speculate() and not memory.spec["m"].plain_mode
    # Per-request overrides make configs: the memory keeps the most recent ones only.
    for i in range(MAX_CONFIGS + 5):
        AdaptivePolicy.resume(memory, f"k{i}").remember(memory, f"k{i}")
    assert len(memory.spec) == MAX_CONFIGS and f"k{MAX_CONFIGS + 4}" in memory.spec and "m" not in memory.spec


# ---------------------------------------------------------------- the loop with steps skipped


class Scripted:
    """A policy that speculates on a fixed pattern of steps: skipping is exercised whatever the timings."""

    def __init__(self, pattern):
        self.pattern, self.i = pattern, 0

    def speculate(self) -> bool:
        self.i += 1
        return self.pattern[(self.i - 1) % len(self.pattern)]

    def observe(self, speculated, seconds, tokens) -> None:
        pass

    def remember(self, times, key) -> None:
        pass


class Coin(Scripted):
    """Speculates at random, from its own generator (never the sampler's)."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(10_000 + seed)

    def speculate(self) -> bool:
        return bool(self.rng.integers(2))


PATTERN = (True, False, False, True, True, False, True, False, False, False)
PROMPTS = [
    "def foo(x):\n    return",
    "import os\nimport sys\n\n\nclass Config",
    "    def __init__(self, name, value=None):\n        self.",
    "with open(path) as f:\n    data = f.read()\n",
]
NEW = 40


@pytest.fixture(scope="module")
def micro_all(micro_with_heads, tmp_path_factory):
    """The micro target exported with every method: draft model, Medusa heads and EAGLE head."""
    from specdeploy.export.exporter import export_all
    from specdeploy.runtime.loaded_export import LoadedExport

    quiet = lambda m: None  # noqa: E731
    out = export_all(micro_with_heads / "target", tmp_path_factory.mktemp("adaptive") / "micro",
                     draft=micro_with_heads / "draft", medusa=micro_with_heads / "medusa",
                     eagle=micro_with_heads / "eagle", progress=quiet)
    return LoadedExport(out)


def _run(export, ids, method, policy=None, adaptive=True, **kw):
    """Adaptation on unless asked (the suite's default is off: tests/conftest.py)."""
    from specdeploy.runtime.generate import Generation

    gen = Generation(export, ids, method=method, max_new_tokens=kw.pop("max_new_tokens", NEW), ignore_eos=True,
                     adaptive=adaptive, **kw)
    if policy is not None:
        gen.policy = policy
    result = gen.result()
    s = result.stats
    assert s["spec_steps"] + s["plain_steps"] == s["target_calls"]
    return result


def test_every_method_is_in_the_fixture(micro_all):
    assert set(micro_all.methods) == set(known_methods())


@pytest.mark.parametrize("method", SPECULATIVE)
def test_greedy_with_skipped_steps_equals_ar(micro_all, method):
    """Scripted skips (runs of 1-3 plain steps) and the real policy: token-identical to ar."""
    for prompt in PROMPTS:
        ids = micro_all.tokenizer.encode(prompt)
        want = _run(micro_all, ids, "ar").token_ids
        scripted = _run(micro_all, ids, method, Scripted(PATTERN))
        assert scripted.token_ids == want, (method, prompt)
        assert scripted.stats["plain_steps"] > 0 and scripted.stats["spec_steps"] > 0
        real = _run(micro_all, ids, method)
        assert real.token_ids == want, (method, prompt)
        assert real.stats["adaptive"] == (method not in SIZES_OWN_ROWS)
    off = _run(micro_all, ids, method, adaptive=False)
    assert off.token_ids == want and off.stats["plain_steps"] == 0 and not off.stats["adaptive"]


def test_speculation_resumes_after_plain_steps(micro_all):
    """After a run of plain steps the drafters draft again (caught up, not stuck)."""
    ids = micro_all.tokenizer.encode(PROMPTS[1])
    for method in SPECULATIVE:
        r = _run(micro_all, ids, method, Scripted((False,) * 5 + (True,) * 20), max_new_tokens=60)
        assert r.stats["accepted_drafts"] > 0, method


def test_ar_has_no_policy(micro_all):
    r = _run(micro_all, micro_all.tokenizer.encode(PROMPTS[0]), "ar")
    assert not r.stats["adaptive"] and r.stats["spec_steps"] == 0 and r.stats["plain_steps"] == r.stats["target_calls"]


def test_sampling_stays_exact_with_random_skips(micro_all):
    """Draft-model sampling (rejection sampling against q) with steps skipped at random, independently
    of the sampler: the first two tokens keep the target's exact joint distribution."""
    from test_sampling_lossless import chi_square_pvalue, exact_two_token_dist

    from specdeploy.runtime.sampling import SamplingParams

    ids = micro_all.tokenizer.encode("def foo(x):\n    return")
    dist = exact_two_token_dist(micro_all, ids, SamplingParams(temperature=1.3, top_k=6))
    samples, kinds = [], set()
    for seed in range(600):
        p = SamplingParams(temperature=1.3, top_k=6, seed=seed, sampling="rejection")  # a seed alone means seeded
        r = _run(micro_all, ids, "draft", Coin(seed), params=p, max_new_tokens=2, method_overrides={"k": 2})
        samples.append(tuple(r.token_ids))
        kinds.add((r.stats["spec_steps"], r.stats["plain_steps"]))
    assert {(0, 2), (1, 0), (1, 1)} <= kinds  # plain-only, speculative-only and mixed requests
    assert chi_square_pvalue(samples, dist) > 1e-3


# ---------------------------------------------------------------- a real model (truncated SmolLM2)

CHAT = ["What is the capital of France? Answer in one sentence.",
        "Write a Python function that returns the squares of a list of numbers."]


def test_truncated_smollm2_greedy_with_skips_equals_ar(smollm2_4l, tmp_path_factory):
    from specdeploy.export.exporter import export_all
    from specdeploy.runtime.chat_template import ChatTemplate, chat_messages, encode_rendered
    from specdeploy.runtime.loaded_export import LoadedExport

    export = LoadedExport(export_all(smollm2_4l, tmp_path_factory.mktemp("adaptive_real") / "smollm2-4l",
                                     progress=lambda m: None))
    template = ChatTemplate.from_tokenizer_dir(export.tokenizer.directory)
    for text in CHAT:
        ids = encode_rendered(export.tokenizer, template.render(chat_messages(text, None)))
        want = _run(export, ids, "ar", max_new_tokens=32).token_ids
        for method in [m for m in export.methods if m != "ar"]:  # those that draft from the target alone
            assert _run(export, ids, method, Scripted(PATTERN), max_new_tokens=32).token_ids == want, method
            assert _run(export, ids, method, max_new_tokens=32).token_ids == want, method


# ---------------------------------------------------------------- switches


def test_global_switch_and_cli_flag(micro_all, monkeypatch):
    import json

    from conftest import run_cli

    from specdeploy.runtime.generate import Generation

    ids = micro_all.tokenizer.encode(PROMPTS[0])
    monkeypatch.setenv("SPECDEPLOY_ADAPTIVE", "1")
    assert Generation(micro_all, ids, method="lookahead").policy is not None
    assert Generation(micro_all, ids, method="lookahead", adaptive=False).policy is None
    monkeypatch.setenv("SPECDEPLOY_ADAPTIVE", "0")
    assert Generation(micro_all, ids, method="lookahead").policy is None
    assert Generation(micro_all, ids, method="lookahead", adaptive=True).policy is not None

    def stats(*flags):
        out = run_cli("generate", micro_all.manifest.root, "--prompt", PROMPTS[0], "--method", "lookahead",
                      "--max-new-tokens", "12", "--json", *flags, env={"SPECDEPLOY_ADAPTIVE": "1"})
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])["stats"]

    on, off = stats(), stats("--no-adaptive")
    assert on["adaptive"] and not off["adaptive"] and off["plain_steps"] == 0
    assert on["spec_steps"] + on["plain_steps"] == on["target_calls"]
