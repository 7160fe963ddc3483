"""Every method decodes to the exact end of the context (issue 13).

A padded static call must never need more rows than the context has left: near the end
the prefill's last chunk, the draft model's catch-up and the EAGLE head's catch-up fall
back to smaller graphs, the drafters propose less (or nothing), and the verify loop
decodes plainly. Exports use a small max_context that is not a multiple of the prefill
chunk (160 = 3 x 48 + 16 and 2 x 64 + 32), so the last prefill chunk is short too.
"""

from __future__ import annotations

import inspect

import pytest
from conftest import hf_greedy
from test_eagle import _random_head, _random_target

CONTEXT = 160
TEXT = ("import os\nimport sys\n\n\nclass Config:\n    def __init__(self, name, value=None):\n"
        "        self.name = name\n        self.value = value\n\n    def get(self, key):\n"
        "        return self.value.get(key)\n\n\ndef foo(x):\n    return x + 1\n\n")


def _lengths(chunk: int) -> list[int]:
    """Prompt lengths near every boundary: the start, each chunk, and the context end."""
    near = {1, 2, 3}
    for edge in range(chunk, CONTEXT, chunk):
        near |= {edge - 1, edge, edge + 1, edge + 2}
    near |= set(range(CONTEXT - 12, CONTEXT))
    return sorted(n for n in near if 1 <= n < CONTEXT)


def _prompt(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(TEXT)
    return (ids * (n // len(ids) + 1))[:n]


def _export(out, target, config: str, **inputs):
    from specdeploy.export.exporter import export_all

    cfg = out.parent / f"{out.name}.yaml"
    cfg.write_text(config)
    return export_all(target, out, config=cfg, progress=lambda m: None, **inputs)


@pytest.fixture(scope="module")
def full(micro_with_heads, tmp_path_factory):
    """Target + draft + Medusa + EAGLE-2 heads, chunk 48; EAGLE with no static tree and
    top_k 3: no small catch-up graph unless the export adds one."""
    from specdeploy.runtime.loaded_export import LoadedExport

    out = _export(tmp_path_factory.mktemp("context_end") / "full", micro_with_heads / "target",
                  f"max_context: {CONTEXT}\nprefill_chunk: 48\nmethods:\n  eagle: {{tree: null, top_k: 3}}\n",
                  draft=micro_with_heads / "draft", eagle=micro_with_heads / "eagle",
                  medusa=micro_with_heads / "medusa")
    return LoadedExport(out, threads=1)


@pytest.fixture(scope="module")
def eagle3(micro_family, tmp_path_factory):
    """A random 4-layer target with an EAGLE-3 head (feature width 3H != H), chunk 64, eagle1's
    63-node tree (a 64-token verify graph)."""
    from specdeploy.runtime.loaded_export import LoadedExport

    root = tmp_path_factory.mktemp("context_end3")
    target = _random_target(micro_family, root / "target4", layers=4)
    head = _random_head(3, target, root / "head3", "bin", seed=3, draft_vocab=200)
    config = f"max_context: {CONTEXT}\nprefill_chunk: 64\nmethods:\n  eagle: {{mode: eagle1}}\n"
    out = _export(root / "eagle3", target, config, eagle=head)
    return target, LoadedExport(out, threads=1)


def _generate(export, ids, method, overrides=None, **kw):
    from specdeploy.runtime.generate import Generation

    if "adaptive" in inspect.signature(Generation).parameters:
        kw["adaptive"] = False  # always speculate: the drafters' end-of-context paths are what is tested
    return Generation(export, ids, method=method, max_new_tokens=CONTEXT - len(ids), ignore_eos=True,
                      method_overrides=overrides, **kw).result()


def _to_the_end(export, runs: dict[str, tuple[str, dict | None]], chunk: int) -> None:
    failures = []
    for n in _lengths(chunk):
        ids = _prompt(export.tokenizer, n)
        ref = _generate(export, ids, "ar")
        assert ref.finish_reason == "length" and n + len(ref.token_ids) == CONTEXT, n
        for label, (method, overrides) in runs.items():
            try:
                out = _generate(export, ids, method, overrides)
            except Exception as exc:  # noqa: BLE001 - collect every failing length, not just the first
                failures.append((label, n, repr(exc)))
                continue
            if out.finish_reason != "length" or n + len(out.token_ids) != CONTEXT or out.token_ids != ref.token_ids:
                failures.append((label, n, out.finish_reason, len(out.token_ids)))
    assert not failures, failures


def test_every_method_decodes_to_the_context_end(full):
    runs = {m: (m, None) for m in full.methods if m != "ar"}
    runs["eagle top_k 2"] = ("eagle", {"top_k": 2})
    runs["draft k 3"] = ("draft", {"k": 3})
    runs["draft k 3, every draft"] = ("draft", {"k": 3, "stop_below": 0})  # full chains up to the end
    _to_the_end(full, runs, 48)


def test_eagle3_decodes_to_the_context_end(eagle3):
    _, export = eagle3
    runs = {"eagle2": ("eagle", {"mode": "eagle2"}), "eagle1": ("eagle", None),
            "prompt-lookup": ("prompt-lookup", None)}
    _to_the_end(export, runs, 64)


def test_the_last_tokens_equal_hf_greedy(full, eagle3, micro_family):
    ids = _prompt(full.tokenizer, 2 * 48 + 1)
    assert _generate(full, ids, "draft").token_ids == hf_greedy(micro_family / "target", ids, CONTEXT - len(ids))
    target, export = eagle3
    ids = _prompt(export.tokenizer, CONTEXT - 40)
    assert _generate(export, ids, "eagle").token_ids == hf_greedy(target, ids, 40)


@pytest.mark.parametrize("method", ["draft", "medusa", "eagle", "lookahead"])
def test_sampling_reaches_the_context_end(full, method):
    from specdeploy.runtime.sampling import SamplingParams

    for n in (CONTEXT - 20, CONTEXT - 3, CONTEXT - 1):
        # the draft model under rejection sampling, its scheme for unseeded requests (a seed alone means seeded)
        scheme = "rejection" if method == "draft" else None
        out = _generate(full, _prompt(full.tokenizer, n), method,
                        params=SamplingParams(temperature=0.8, seed=n, sampling=scheme))
        assert out.finish_reason == "length" and n + len(out.token_ids) == CONTEXT


def test_export_has_the_small_graphs_the_end_needs(full, eagle3):
    from specdeploy.runtime.graph_contract import EAGLE, EAGLE_DRAFT, PORTABLE

    assert 2 in full.decoder("draft").sizes  # a fully accepted step's two pending tokens
    for export in (full, eagle3[1]):
        head = export.manifest.models[EAGLE]
        graphs = export.manifest.graphs_of(EAGLE_DRAFT, EAGLE, PORTABLE)
        width = int(head.extra["feature_dim"])  # a one-row catch-up fits until the last position
        assert any(g.tokens == 1 and g.features == width for g in graphs)


def test_a_tree_verified_before_anything_is_cached_equals_ar(full):
    """A one-token prompt is all root: the first verify call has no past. A tree there (a sibling
    before the accepted path) must still give sequential decoding's tokens (ONNX Runtime's
    GroupQueryAttention attends causally in a call with no past, whatever the mask)."""
    import numpy as np

    from specdeploy.runtime.drafters.base import Drafter, Proposal
    from specdeploy.runtime.tree import Tree

    ids = _prompt(full.tokenizer, 1)
    want = _generate(full, ids, "ar").token_ids

    class SiblingFirst(Drafter):
        """First step: a wrong guess, then beside it the right two tokens; plain steps after."""

        def propose(self, state):
            if len(state.tokens) > 1:
                return Proposal.root_only(state.tokens[-1])
            wrong = (want[0] + 1) % full.manifest.models["target"].vocab_size
            return Proposal(Tree((-1, 0, 0, 2)), np.array([state.tokens[-1], wrong, want[0], want[1]], np.int64))

    got = _generate(full, ids, "prompt-lookup", drafter=SiblingFirst())
    assert got.token_ids == want  # (the tree is verified plainly: with it, token 3 came out wrong)
