"""Seed-exact sampling: with the same seed every method emits `ar`'s tokens, whatever its drafts,
draft length or tree, because the token at sequence index i is a function of its distribution and
noise(seed, i) alone (runtime/sampling.py: PositionNoise, runtime/verify.py: verify_seeded).

That the seeded draw is exactly the target's distribution: tests/unit/test_sampling.py (the draw)
and tests/test_sampling_lossless.py (the first two tokens of generations over many seeds).
"""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from specdeploy.runtime.sampling import SamplingParams

SEEDS = range(50)
NEW = 12
PARAMS = [dict(temperature=0.7, top_k=20), dict(temperature=1.0, top_p=0.9)]
PROMPT = "def foo(x):\n    return"
# Every method on the micro export, and other draft lengths and trees than the export's.
CASES = [("draft", None), ("draft", {"k": 1}), ("draft", {"k": 3}),
         ("prompt-lookup", None), ("prompt-lookup", {"k": 2}),
         ("lookahead", None), ("lookahead", {"window": 2, "ngram": 3, "guesses": 3}),
         ("suffix", None),
         ("eagle", None), ("eagle", {"mode": "eagle1", "tree": "medusa_cpu_8"}),
         ("eagle", {"top_k": 3, "depth": 3, "total_tokens": 14}),
         ("medusa", None), ("medusa", {"tree": "medusa_cpu_4"}), ("medusa", {"tree": ((0,), (0, 0), (0, 0, 0))}),
         ("lookahead+suffix", None), ("lookahead+prompt-lookup", {"nodes": 10, "lazy": False})]


@pytest.fixture(scope="module")
def micro_all(micro_with_heads, tmp_path_factory):
    """The micro target exported with every method: draft model, Medusa heads and EAGLE head."""
    from specdeploy.export.exporter import export_all
    from specdeploy.runtime.loaded_export import LoadedExport

    quiet = lambda m: None  # noqa: E731
    out = export_all(micro_with_heads / "target", tmp_path_factory.mktemp("seed_exact") / "micro",
                     draft=micro_with_heads / "draft", medusa=micro_with_heads / "medusa",
                     eagle=micro_with_heads / "eagle", progress=quiet)
    return LoadedExport(out)


def _ids(export, method, params, ids, overrides=None):
    from specdeploy.runtime.generate import generate

    r = generate(export, ids, method=method, params=params, max_new_tokens=NEW, ignore_eos=True,
                 method_overrides=overrides)
    return r.token_ids, r.stats


def test_min_p_sampling_emits_ars_tokens_for_every_method(micro_all):
    kw = dict(temperature=1.2, top_p=0.95, min_p=0.08)
    ids = micro_all.tokenizer.encode(PROMPT)
    for seed in SEEDS[:10]:
        want, _ = _ids(micro_all, "ar", SamplingParams(**kw, seed=seed), ids)
        for method, overrides in CASES:
            got, _ = _ids(micro_all, method, SamplingParams(**kw, seed=seed, sampling="seeded"), ids, overrides)
            assert got == want, (method, overrides, seed)


@pytest.mark.parametrize("kw", PARAMS, ids=["T0.7-topk20", "T1.0-topp0.9"])
def test_every_method_emits_ars_tokens_for_every_seed(micro_all, kw):
    ids = micro_all.tokenizer.encode(PROMPT)
    accepted = {}
    for seed in SEEDS:
        want, _ = _ids(micro_all, "ar", SamplingParams(**kw, seed=seed), ids)
        for method, overrides in CASES:
            # The draft model defaults to rejection sampling (more accepted drafts): ask for seeded.
            got, stats = _ids(micro_all, method, SamplingParams(**kw, seed=seed, sampling="seeded"), ids, overrides)
            assert got == want, (method, overrides, seed)
            assert stats["sampling"] == "seeded"
            key = (method, repr(overrides))
            accepted[key] = accepted.get(key, 0) + stats["accepted_drafts"]
    drafting = [k for k, n in accepted.items() if n > 0]
    assert {m for m, _ in drafting} >= {"draft", "eagle", "medusa"}, accepted  # the drafts were really used


def test_rejection_sampling_is_exact_in_distribution_only(micro_all):
    """Why the seeded scheme exists: the same seed under rejection sampling gives other tokens than ar."""
    ids = micro_all.tokenizer.encode(PROMPT)
    differs = 0
    for seed in range(10):
        want, _ = _ids(micro_all, "ar", SamplingParams(1.0, seed=seed, sampling="rejection"), ids)
        got, _ = _ids(micro_all, "draft", SamplingParams(1.0, seed=seed, sampling="rejection"), ids)
        differs += got != want
    assert differs > 0


def test_defaults_and_a_drawn_seed_replays(micro_all):
    ids = micro_all.tokenizer.encode(PROMPT)
    _, stats = _ids(micro_all, "eagle", SamplingParams(1.0, seed=3), ids)
    assert stats["sampling"] == "seeded" and stats["seed"] == 3
    _, stats = _ids(micro_all, "draft", SamplingParams(1.0, seed=3), ids)
    assert stats["sampling"] == "seeded"  # a seed asks for a replayable answer, whatever the method
    _, stats = _ids(micro_all, "draft", SamplingParams(1.0), ids)
    assert stats["sampling"] == "rejection"  # the draft model's default without one, chosen by acceptance (README)
    _, stats = _ids(micro_all, "ar", SamplingParams(), ids)
    assert stats["sampling"] == "greedy" and stats["seed"] is None
    # No seed: one is drawn per request and reported; passing it back replays the request on any method.
    first, stats = _ids(micro_all, "medusa", SamplingParams(1.0), ids)
    other, stats2 = _ids(micro_all, "medusa", SamplingParams(1.0), ids)
    assert stats["seed"] != stats2["seed"]
    assert _ids(micro_all, "ar", SamplingParams(1.0, seed=stats["seed"]), ids)[0] == first
    assert _ids(micro_all, "lookahead", SamplingParams(1.0, seed=stats2["seed"]), ids)[0] == other


def test_cli_generate_is_seed_exact(micro_all):
    out = {}
    for method in ["ar", "eagle", "draft"]:
        r = run_cli("generate", micro_all.manifest.root, "--method", method, "--prompt", PROMPT,
                    "--max-new-tokens", NEW, "--ignore-eos", "--temperature", 0.9, "--top-k", 30, "--seed", 11,
                    "--sampling", "seeded", "--json")
        assert r.returncode == 0, r.stderr
        out[method] = json.loads(r.stdout)["token_ids"]
    assert out["eagle"] == out["ar"] == out["draft"]


def _logprobs(export, method, params, ids, overrides=None, top=3):
    from specdeploy.runtime.generate import generate

    r = generate(export, ids, method=method, params=params, max_new_tokens=NEW, ignore_eos=True,
                 method_overrides=overrides, logprobs=top)
    assert [lp.token_id for lp in r.logprobs] == r.token_ids
    return r.token_ids, r.logprobs


@pytest.mark.parametrize("params", [SamplingParams(0.0), SamplingParams(0.8, top_k=20, seed=5, sampling="seeded")],
                         ids=["greedy", "seeded"])
def test_every_method_reports_the_targets_own_logprobs(micro_all, params):
    """A token's logprob is read off the verify row that chose it, so every method reports ar's numbers
    (within float32 ulps: a one-row call sums in another order than a call of several rows)."""
    import numpy as np

    ids = micro_all.tokenizer.encode(PROMPT)
    want_ids, want = _logprobs(micro_all, "ar", params, ids)
    if params.greedy:  # greedy picks the likeliest token: the first alternative
        assert all(lp.top[0][0] == lp.token_id and lp.top[0][1] == lp.logprob for lp in want)
    assert all(lp.logprob <= 0 and [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
               for lp in want)
    for method, overrides in CASES:
        got_ids, got = _logprobs(micro_all, method, params, ids, overrides)
        assert got_ids == want_ids, (method, overrides)
        assert np.allclose([lp.logprob for lp in got], [lp.logprob for lp in want], atol=1e-4, rtol=0), method
        for g, w in zip(got, want):
            assert [i for i, _ in g.top] == [i for i, _ in w.top], (method, overrides)
            assert np.allclose([v for _, v in g.top], [v for _, v in w.top], atol=1e-4, rtol=0)


@pytest.mark.parametrize("kw", PARAMS, ids=["T0.7-topk20", "T1.0-topp0.9"])
def test_penalized_sampling_emits_ars_tokens_for_every_method(micro_all, kw):
    """Penalties (runtime/penalties.py) shape each verify row's distribution by the tokens before it, the
    accepted drafts on its path included, so seeded sampling with them still emits ar's tokens."""
    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.penalties import Penalties

    ids = micro_all.tokenizer.encode(PROMPT)
    greedy = generate(micro_all, ids, method="ar", max_new_tokens=NEW, ignore_eos=True).token_ids
    banned = Penalties(logit_bias={t: -100 for t in greedy[:3]} | {greedy[4]: 5})  # OpenAI's logit_bias
    moved = 0
    for seed in range(8):
        for penalties in (Penalties(1.4), Penalties(1.1, frequency=0.8, presence=0.5), banned):
            params = SamplingParams(**kw, seed=seed, sampling="seeded")
            run = lambda method, overrides=None, pen=penalties: generate(  # noqa: E731
                micro_all, ids, method=method, params=params, max_new_tokens=NEW, ignore_eos=True,
                method_overrides=overrides, penalties=pen).token_ids
            want = run("ar")
            moved += want != run("ar", pen=None)
            for method, overrides in CASES:
                assert run(method, overrides) == want, (method, overrides, seed, penalties)
    assert moved >= 6  # the penalties changed what was sampled


@pytest.mark.parametrize("method", ["ar", "prompt-lookup", "draft", "eagle"])
def test_streamed_logprobs_come_with_their_text(micro_all, method):
    """Each event's logprobs are those of the tokens whose text it completes: never before that text
    (held behind a possible stop string, or a character still incomplete), none lost, the last event
    bringing the rest, however the generation ends (length, a stop string, EOS)."""
    from specdeploy.runtime.generate import Generation
    from specdeploy.runtime.penalties import Penalties

    ids = micro_all.tokenizer.encode(PROMPT)
    eos = min(micro_all.eos_token_ids)
    token_text = lambda t: micro_all.tokenizer.decode_ids([t])  # noqa: E731 (special tokens: no text)
    endings = set()
    # a bias of 8 on EOS: the micro target ends after two tokens (" self.")
    for stop, bias in [([], 0.0), (["\x00never-seen"], 0.0), (["\x00never-seen"], 8.0), ([], 8.0), (["(", ":"], 0.0)]:
        gen = Generation(micro_all, ids, method=method, max_new_tokens=NEW * 2, stop=stop, logprobs=1,
                         penalties=Penalties(logit_bias={eos: bias}) if bias else None)
        events = list(gen)
        shown = listed = 0
        for i, event in enumerate(events):
            shown += len(event.text)
            listed += sum(len(token_text(lp.token_id)) for lp in event.logprobs)
            if i < len(events) - 1:
                assert listed <= shown, (method, stop, bias, i)
        assert [lp.token_id for e in events for lp in e.logprobs] == gen.new_ids
        assert [lp.token_id for lp in gen.logprobs] == gen.new_ids
        endings.add(gen.finish_reason if gen.new_ids[-1] != eos else "eos")
    assert {"length", "eos"} <= endings, endings
