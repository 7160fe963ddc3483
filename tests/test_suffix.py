"""Suffix decoding on exports: greedy output equal to Hugging Face and to `ar`, and a repeated
request accepted more the second time. The suffix tree alone (counts, longest match, proposals
within the node budget, a cross-request cache whose memory stays flat) is in
tests/unit/test_suffix_tree.py."""

from __future__ import annotations

import inspect
import json

import pytest
from conftest import hf_greedy, run_cli

PROMPTS = [
    "def foo(x):\n    return",
    "import os\nimport sys\n\n\nclass Config",
    "    def __init__(self, name, value=None):\n        self.",
    "with open(path) as f:\n    data = f.read()\n",
    "def f(x):\n    return x\n\n\ndef f(x):\n    return",
]
NEW = 40


def every_step_drafts() -> dict:
    """Generation options that draft on every step: an adaptive fallback to plain steps
    (runtime/adaptive.py, where present) goes by measured time, so acceptance would vary."""
    from specdeploy.runtime.generate import Generation

    return {"adaptive": False} if "adaptive" in inspect.signature(Generation).parameters else {}


@pytest.mark.parametrize("graphs", ["fused", "portable"])
def test_micro_greedy_equals_hf_and_ar(micro_export, micro_family, graphs):
    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.loaded_export import LoadedExport

    export, accepted = LoadedExport(micro_export, flavor=graphs), 0
    for prompt in PROMPTS:
        ids = export.tokenizer.encode(prompt)
        ours = generate(export, ids, method="suffix", max_new_tokens=NEW, ignore_eos=True, **every_step_drafts())
        ar = generate(export, ids, method="ar", max_new_tokens=NEW, ignore_eos=True)
        assert ours.token_ids == ar.token_ids == hf_greedy(micro_family / "target", ids, NEW), prompt
        assert ours.stats["target_calls"] <= NEW
        accepted += ours.stats["accepted_drafts"]
    assert accepted > NEW  # the drafts were tried, not just plain steps


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "mistral"])
def test_other_architectures_match_hf_greedy(arch_exports, random_models, arch):
    """Each prompt twice: the second time the cache proposes the whole answer."""
    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.loaded_export import LoadedExport

    export = LoadedExport(arch_exports[arch])
    for prompt in PROMPTS[:2] + PROMPTS[-1:]:
        ids = export.tokenizer.encode(prompt)
        ref = hf_greedy(random_models[arch][0], ids, 24)
        runs = [generate(export, ids, method="suffix", max_new_tokens=24, ignore_eos=True, **every_step_drafts())
                for _ in range(2)]
        assert runs[0].token_ids == runs[1].token_ids == ref, (arch, prompt)
        assert runs[1].stats["accepted_drafts"] > runs[0].stats["accepted_drafts"]


def test_a_repeated_request_is_accepted_more_the_second_time(micro_export):
    """The first answer is in the export's cache when the same request comes again; a
    freshly loaded export (another service) has nothing cached."""
    from functools import partial

    from specdeploy.runtime.generate import generate as generate_any
    from specdeploy.runtime.loaded_export import LoadedExport

    generate = partial(generate_any, **every_step_drafts())
    export = LoadedExport(micro_export)
    ids = export.tokenizer.encode("import os\nimport sys\n\n\nclass Config")
    first = generate(export, ids, method="suffix", max_new_tokens=48, ignore_eos=True)
    second = generate(export, ids, method="suffix", max_new_tokens=48, ignore_eos=True)
    assert second.token_ids == first.token_ids
    assert second.stats["acceptance_length"] > 1.5 * first.stats["acceptance_length"], (first.stats, second.stats)
    fresh = generate(LoadedExport(micro_export), ids, method="suffix", max_new_tokens=48, ignore_eos=True)
    assert fresh.stats["target_calls"] == first.stats["target_calls"]
    # without the cache the second request is no better than the first
    uncached = {"cache_tokens": 0}
    again = [generate(export, ids, method="suffix", max_new_tokens=48, ignore_eos=True, method_overrides=uncached)
             for _ in range(2)]
    assert again[0].stats["target_calls"] == again[1].stats["target_calls"] > second.stats["target_calls"]


def test_cli_and_service_serve_the_method(micro_export):
    from specdeploy.runtime.service import Service

    proc = run_cli("generate", micro_export, "--method", "suffix", "--prompt", PROMPTS[-1], "--max-new-tokens",
                   "12", "--ignore-eos", "--json", "--param", "max_nodes=6")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["stats"]["method"] == "suffix" and len(result["token_ids"]) == 12
    svc = Service.load(micro_export, pool_size=1)
    assert "suffix" in svc.status()["methods"]
    served = svc.generate(PROMPTS[-1], method="suffix", max_new_tokens=12, ignore_eos=True)
    assert served.token_ids == result["token_ids"]


def test_sampling_accepts_suffix_drafts(micro_export):
    """Deterministic drafts under rejection sampling: a sampled request runs to its length and
    the repeated one is proposed (and accepts) its predecessor's text."""
    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.loaded_export import LoadedExport
    from specdeploy.runtime.sampling import SamplingParams

    micro = LoadedExport(micro_export)
    ids = micro.tokenizer.encode(PROMPTS[0])
    runs = [generate(micro, ids, method="suffix", params=SamplingParams(0.7, 0, 0.95, seed), max_new_tokens=32,
                     ignore_eos=True, **every_step_drafts()) for seed in (1, 1, 2)]
    assert all(len(r.token_ids) == 32 for r in runs)
    assert runs[1].stats["accepted_drafts"] > 0
