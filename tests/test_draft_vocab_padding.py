"""A draft whose vocab_size differs from the target's by embedding padding alone (the canonical pair
Qwen2.5-7B, 152,064 rows, with Qwen2.5-0.5B, 151,936): same tokenizer, so it exports; the draft reads
every target token and drafts among the ids both models score; output equals the target's own."""

from __future__ import annotations

import json

import pytest
from conftest import hf_greedy

PROMPT_IDS = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def padded_pair(micro_family, tmp_path_factory):
    from specdeploy.export.exporter import export_all
    from specdeploy.train.family import make_random_model

    root, tok = tmp_path_factory.mktemp("padded"), micro_family / "tokenizer"  # 512 ids
    target = make_random_model("qwen2", root / "target", tok, seed=1, overrides={"vocab_size": 640})
    # drafts that are the target with fewer or more embedding rows: they agree with it, so they draft
    draft, wide = _resized(target, root / "draft", 576), _resized(target, root / "wide", 704)
    said: list[str] = []
    export = export_all(target, root / "out", draft=draft, progress=said.append)
    export_wide = export_all(target, root / "out_wide", draft=wide, progress=lambda m: None)
    return target, export, export_wide, said


def _resized(model_dir, out, rows: int):
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    torch.manual_seed(0)
    model.resize_token_embeddings(rows, mean_resizing=False)
    model.save_pretrained(out)
    for f in model_dir.glob("tokenizer*"):
        shutil.copy(f, out)
    return out


def test_a_padded_draft_exports_and_says_so(padded_pair):
    _, export, _, said = padded_pair
    assert any("vocab_size is 576, the target's 640" in line for line in said), said
    manifest = json.loads((export / "manifest.json").read_text())
    draft = manifest["models"]["draft"]
    assert draft["vocab_size"] == 640 and draft["draft_vocab_size"] == 576


@pytest.mark.parametrize("which", ["smaller", "larger"])
@pytest.mark.parametrize("graphs", ["fused", "portable"])
def test_a_padded_draft_drafts_losslessly(padded_pair, which, graphs):
    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.loaded_export import LoadedExport
    from specdeploy.runtime.sampling import SamplingParams

    target, export, export_wide, _ = padded_pair
    loaded = LoadedExport(export if which == "smaller" else export_wide, flavor=graphs)
    reference = hf_greedy(target, PROMPT_IDS, 24)
    for method in ("draft", "draft+prompt-lookup"):
        ours = generate(loaded, PROMPT_IDS, method=method, max_new_tokens=24, ignore_eos=True, adaptive=False)
        assert ours.token_ids == reference, method
        assert ours.stats["target_calls"] < 24  # it drafted
    # rejection sampling compares the draft's distribution with the target's over the full vocabulary
    sampled = generate(loaded, PROMPT_IDS, method="draft", max_new_tokens=24, ignore_eos=True, adaptive=False,
                       params=SamplingParams(temperature=1.0, seed=7, sampling="rejection"))
    assert len(sampled.token_ids) == 24 and all(0 <= t < 640 for t in sampled.token_ids)
