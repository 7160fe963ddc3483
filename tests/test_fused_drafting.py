"""Fused drafting on the micro export with its draft model, EAGLE and Medusa heads (lookahead's window needs none):
every fused method prints plain greedy decoding's tokens (and HF's) and `ar`'s tokens for a seed, verifies trees within
its node budget in which a candidate both parts propose is one node, and its drafts are used,
also where the model part sat steps out (lazy) and caught up.
The merge itself on hand-built trees: tests/unit/test_fused_tree.py."""

from __future__ import annotations

import pytest
from conftest import hf_greedy, run_cli

from specdeploy.runtime.drafters.fused import CONFIGS
from specdeploy.runtime.sampling import SamplingParams

FUSED = [c.method for c in CONFIGS]
PROMPTS = ["def f(x):\n    return x\n\n\ndef f(x):\n    return", "import os\nimport sys\n\n\nclass Config"]
NEW = 24


@pytest.fixture(scope="module")
def micro_heads(micro_with_heads, tmp_path_factory):
    """The micro target exported with its draft model, EAGLE head and Medusa heads (every fused method)."""
    from specdeploy.export.exporter import export_all
    from specdeploy.runtime.loaded_export import LoadedExport

    quiet = lambda m: None  # noqa: E731
    out = export_all(micro_with_heads / "target", tmp_path_factory.mktemp("fused") / "micro",
                     draft=micro_with_heads / "draft", medusa=micro_with_heads / "medusa",
                     eagle=micro_with_heads / "eagle", progress=quiet)
    return LoadedExport(out)


class Watched:
    """A fused drafter whose proposals are kept (Generation takes a drafter built for the method)."""

    def __init__(self, drafter):
        self.inner, self.proposals, self.parts = drafter, [], []
        self.deterministic, self.default_sampling = drafter.deterministic, drafter.default_sampling
        self.sizes_own_rows = drafter.sizes_own_rows

    def prefilled(self, out):
        self.inner.prefilled(out)

    def start(self, state):
        self.inner.start(state)

    def propose(self, state):
        p = self.inner.propose(state)
        self.proposals.append(p)
        self.parts.append([part.proposal for part in self.inner.last])
        return p

    def update(self, *args):
        self.inner.update(*args)


def _paths(proposal) -> set[tuple[int, ...]]:
    t = proposal.tree
    return {tuple(int(proposal.tokens[n]) for n in t.path_to(i)[1:]) for i in range(1, t.size)}


@pytest.mark.parametrize("method", FUSED)
def test_greedy_equals_ar_and_hf_within_the_budget(micro_heads, micro_family, method):
    from specdeploy.runtime.generate import Generation, generate
    from specdeploy.runtime.methods import build_drafter

    export, accepted, shared, skipped = micro_heads, 0, 0, 0
    budget = export.method_config(method).nodes
    for prompt in PROMPTS:
        ids = export.tokenizer.encode(prompt)
        ar = generate(export, ids, method="ar", max_new_tokens=NEW, ignore_eos=True)
        assert ar.token_ids == hf_greedy(micro_family / "target", ids, NEW)
        # lazy off: both parts draft every step; on (the default): the heads sit some steps out (by
        # acceptance and measured time, so which steps varies with the machine's load)
        for lazy in (False, True):
            config = export.method_config(method, {"lazy": lazy})
            watched = Watched(build_drafter(export, config))
            ours = Generation(export, ids, method=method, max_new_tokens=NEW, ignore_eos=True, drafter=watched,
                              method_overrides={"lazy": lazy}, adaptive=False).result()
            assert ours.token_ids == ar.token_ids, (method, prompt, lazy)
            accepted += ours.stats["accepted_drafts"]
            for p, parts in zip(watched.proposals, watched.parts):
                assert p.size <= budget + 1 == config.verify_tokens  # window rows (lookahead) included
                merged = _paths(p)
                assert len(merged) == p.tree.size - 1  # no two nodes hold the same token path
                assert merged <= _paths(parts[0]) | _paths(parts[1])
                if lazy:
                    skipped += parts[0].tree.size == 1 < parts[1].tree.size  # the heads sat this step out
                else:
                    shared += len(_paths(parts[0]) & _paths(parts[1]) & merged)
    assert accepted > NEW // 2, method  # the drafts were used
    assert shared > 0, method  # the parts did propose some candidates in common, merged into one node each
    assert skipped > 0, method  # and the heads were left out of some steps, then caught up (tokens still equal)


def test_a_lazy_fused_method_sizes_its_own_steps(micro_heads):
    """Lazy (the default), the fused drafter decides per step whether its model part drafts: the
    step-time policy is off for it (it added plain steps where the host part copies for free);
    with lazy off the policy is on, as for a model drafter alone."""
    from specdeploy.runtime.generate import generate

    ids = micro_heads.tokenizer.encode(PROMPTS[0])
    for lazy in (True, False):
        got = generate(micro_heads, ids, method="eagle+suffix", max_new_tokens=8, ignore_eos=True,
                       method_overrides={"lazy": lazy}, adaptive=True)  # (the tests' default is off)
        assert got.stats["adaptive"] is not lazy, lazy
        assert got.stats["plain_steps"] == 0 or not lazy


@pytest.mark.parametrize("method", FUSED)
def test_seeded_sampling_prints_ars_tokens(micro_heads, method):
    from specdeploy.runtime.generate import generate

    ids = micro_heads.tokenizer.encode(PROMPTS[0])
    for seed in range(8):
        for kw in (dict(temperature=0.7, top_k=20), dict(temperature=1.0, top_p=0.9)):
            want = generate(micro_heads, ids, method="ar", params=SamplingParams(**kw, seed=seed),
                            max_new_tokens=12, ignore_eos=True)
            got = generate(micro_heads, ids, method=method, params=SamplingParams(**kw, seed=seed),
                           max_new_tokens=12, ignore_eos=True, adaptive=False)
            assert got.token_ids == want.token_ids, (method, seed, kw)
            assert got.stats["sampling"] == "seeded"


def test_cli_runs_a_fused_method_and_rejects_a_bad_setting(micro_heads):
    root = str(micro_heads.manifest.root)
    ok = run_cli("generate", root, "--prompt", "def f(x):", "--method", "eagle+suffix", "--max-new-tokens", "8",
                 "--param", "nodes=6")
    assert ok.returncode == 0, ok.stderr
    bad = run_cli("generate", root, "--prompt", "def f(x):", "--method", "eagle+suffix", "--param", "nodes=64")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "needs a target graph of 65 tokens" in bad.stderr


def test_a_budget_the_lookahead_window_fills_is_one_clear_error(micro_heads, tmp_path):
    """The default window takes one row; an export whose lookahead window is wider (a GPU's) leaves a
    small fused budget no candidate."""
    import json
    import shutil

    copy = tmp_path / "wide"
    shutil.copytree(micro_heads.manifest.root, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["methods"]["lookahead"] = {"window": 3, "ngram": 4, "guesses": 2}  # T = 15, a graph it has
    (copy / "manifest.json").write_text(json.dumps(manifest))
    small = run_cli("generate", str(copy), "--prompt", "def f(x):", "--method", "lookahead+suffix",
                    "--param", "nodes=8")
    assert small.returncode != 0 and "Traceback" not in small.stderr
    assert "nodes (8) leaves no candidate beside the lookahead window's 8 rows; raise nodes" in small.stderr
    wide = run_cli("generate", str(copy), "--prompt", "def f(x):", "--method", "lookahead", "--max-new-tokens", "8")
    assert wide.returncode == 0, wide.stderr


def test_the_service_serves_the_fused_methods(micro_heads):
    from specdeploy.runtime.service import Service

    svc = Service.load(micro_heads.manifest.root, backend="ort-cpu", warmup=True)
    assert set(FUSED) <= set(svc.status()["methods"])  # every one opened its graphs at warm-up
    want = svc.generate(PROMPTS[0], method="ar", max_new_tokens=10, temperature=0.8, seed=3, ignore_eos=True)
    for method in FUSED:
        got = svc.generate(PROMPTS[0], method=method, max_new_tokens=10, temperature=0.8, seed=3, ignore_eos=True)
        assert got.token_ids == want.token_ids, method
