"""draft.draft_vocab N: the draft model's LM head keeps its N most frequent tokens (draft_vocab.json
beside the draft). The export's graphs and accuracy check cover the restricted head; the runtime
maps the draft's columns back to target ids; greedy and seeded output stay ar's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import hf_greedy

from specdeploy.runtime.sampling import SamplingParams

SIZE = 96  # of the micro vocabulary's 512
NEW = 16
PROMPTS = ["def parse(line):\n    return", "class Stack:\n    def push(self, item):"]


@pytest.fixture(scope="module")
def vocab_draft(micro_family, tmp_path_factory) -> Path:
    """The micro draft with a draft_vocab.json ranked on a little Python source (as train/draft.py
    ranks the target's responses)."""
    import inspect
    import json as json_module

    import torch
    from tokenizers import Tokenizer

    from specdeploy.export.draft_vocab import write_draft_vocab

    draft = tmp_path_factory.mktemp("vocab_draft") / "draft"
    shutil.copytree(micro_family / "draft", draft)
    tok = Tokenizer.from_file(str(draft / "tokenizer.json"))
    ids = tok.encode(inspect.getsource(json_module.decoder)).ids
    write_draft_vocab(draft, torch.tensor(ids), 512)
    return draft


@pytest.fixture(scope="module")
def export(micro_family, vocab_draft, tmp_path_factory):
    from specdeploy.export.check import check_path
    from specdeploy.export.exporter import export_all
    from specdeploy.runtime.loaded_export import LoadedExport

    root = tmp_path_factory.mktemp("draft_vocab_export")
    config = root / "config.yaml"
    config.write_text(f"max_context: 256\nmethods:\n  draft: {{draft_vocab: {SIZE}}}\n")
    out = export_all(micro_family / "target", root / "export", draft=vocab_draft, config=config,
                     progress=lambda m: None, batched=False)
    checked = [r for r in check_path(out) if r.graph.startswith("draft")]
    assert len(checked) == 6 and all(r.passed for r in checked), [(r.graph, r.detail) for r in checked]
    return LoadedExport(out, threads=1)


def _allowed(vocab_draft: Path) -> set[int]:
    return set(json.loads((vocab_draft / "draft_vocab.json").read_text())["token_ids"][:SIZE])


def test_export_records_the_restricted_head(export, vocab_draft):
    record = export.manifest.models["draft"]
    assert record.vocab_size == 512  # input ids: the full vocabulary
    assert record.extra["draft_vocab_size"] == SIZE
    ids = np.load(export.manifest.root / record.extra["draft_vocab_file"])
    assert set(ids.tolist()) == _allowed(vocab_draft)
    assert record.extra["draft_vocab_file"] in export.manifest.files  # checksummed
    step = export.decoder("draft").prefill(export.tokenizer.encode(PROMPTS[0]), export.prefill_chunk)
    assert step.logits.shape[-1] == SIZE


def test_greedy_is_ars_and_drafts_come_from_the_draft_vocabulary(export, vocab_draft, micro_family):
    from specdeploy.runtime.generate import Generation, generate

    allowed = _allowed(vocab_draft)
    accepted = 0
    for prompt in PROMPTS:
        ids = export.tokenizer.encode(prompt)
        ours = generate(export, ids, method="draft", max_new_tokens=NEW, ignore_eos=True)
        assert ours.token_ids == hf_greedy(micro_family / "target", ids, NEW)
        accepted += ours.stats["accepted_drafts"]
    assert accepted > 0
    g = Generation(export, export.tokenizer.encode(PROMPTS[0]), method="draft", max_new_tokens=NEW)
    g.target.prefill(g.state.tokens[:-1], export.prefill_chunk)
    g.drafter.start(g.state)
    proposal = g.drafter.propose(g.state)
    assert set(proposal.tokens[1:].tolist()) <= allowed


@pytest.mark.parametrize("seed", [3, 11])
def test_seeded_sampling_is_ars(export, seed):
    from specdeploy.runtime.generate import generate

    ids = export.tokenizer.encode(PROMPTS[1])
    runs = {}
    for method, sampling in (("ar", None), ("draft", "seeded")):
        params = SamplingParams(temperature=0.8, top_k=40, seed=seed, sampling=sampling)
        runs[method] = generate(export, ids, method=method, params=params, max_new_tokens=NEW, ignore_eos=True)
    assert runs["draft"].token_ids == runs["ar"].token_ids
    assert runs["draft"].stats["sampling"] == "seeded"
    assert runs["draft"].stats["accepted_drafts"] > 0  # the drafts raced the target's noise


def test_rejection_sampling_q_is_zero_outside_the_draft_vocabulary(export, vocab_draft):
    """Verification's residual max(0, p - q) covers the tokens the draft cannot propose."""
    from specdeploy.runtime.generate import Generation

    params = SamplingParams(temperature=1.0, seed=5, sampling="rejection")  # the scheme whose residual this is
    g = Generation(export, export.tokenizer.encode(PROMPTS[0]), method="draft", params=params, max_new_tokens=NEW)
    g.target.prefill(g.state.tokens[:-1], export.prefill_chunk)
    g.drafter.start(g.state)
    proposal = g.drafter.propose(g.state)
    q = proposal.draft_probs
    assert q.shape == (len(proposal.tokens), 512)
    outside = np.setdiff1d(np.arange(512), sorted(_allowed(vocab_draft)))
    assert not q[1:, outside].any()
    np.testing.assert_allclose(q[1:].sum(-1), 1.0)
    assert all(q[i + 1, t] > 0 for i, t in enumerate(proposal.tokens[1:]))


def test_a_draft_without_draft_vocab_json_exports_the_full_vocabulary(micro_family, tmp_path):
    from specdeploy.export.exporter import export_all
    from specdeploy.runtime.manifest import load_manifest

    config = tmp_path / "config.yaml"
    config.write_text(f"max_context: 256\nmethods:\n  draft: {{draft_vocab: {SIZE}}}\n")
    said = []
    out = export_all(micro_family / "target", tmp_path / "export", draft=micro_family / "draft", config=config,
                     progress=said.append, fused=False)
    assert any("has no draft_vocab.json, drafting over the full vocabulary" in line for line in said)
    assert "draft_vocab_file" not in load_manifest(out).models["draft"].extra


def test_the_id_map_is_integrity_checked(export, tmp_path):
    from specdeploy.runtime.errors import SpecDeployError
    from specdeploy.runtime.manifest import load_manifest

    copy = tmp_path / "export"
    shutil.copytree(export.manifest.root, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    rel = manifest["models"]["draft"]["draft_vocab_file"]
    del manifest["files"][rel]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SpecDeployError, match=f"{rel} .models.draft.draft_vocab_file. is not in the files map"):
        load_manifest(copy)


def test_task_check_scores_a_quantized_restricted_draft(micro_family, vocab_draft, tmp_path):
    """The task check maps the text's ids to the draft's columns (it indexed the full vocabulary and
    crashed) and scores perplexity where the next token is one of them."""
    from specdeploy.export.exporter import export_all
    from specdeploy.export.quantize import QuantPlan
    from specdeploy.export.task_check import run_task_check
    from specdeploy.runtime.manifest import load_manifest

    config = tmp_path / "config.yaml"
    config.write_text(f"max_context: 256\nmethods:\n  draft: {{draft_vocab: {SIZE}}}\n")
    out = export_all(micro_family / "target", tmp_path / "export", draft=vocab_draft, config=config,
                     progress=lambda m: None, batched=False, quantize=QuantPlan.from_choices(32, draft="int8"))
    (result,) = run_task_check(load_manifest(out), tokens=256, threads=1)
    assert result.model == "draft" and result.tokens == 255
    assert result.passed, result.line()
    assert result.ppl_float is not None and 1 < result.ppl_float < SIZE
