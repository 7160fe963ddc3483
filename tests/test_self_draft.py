"""`export --draft self`: the target drafts for itself through int4 weights (export/main.py,
runtime/drafters/draft_model.py). Its graphs are the target's, quantized; the accuracy check holds
it to the draft floor only; greedy output equals `ar` whatever the stop rule drafts; and the
stop rule drafts fewer tokens the higher it is set."""

from __future__ import annotations

import json

import pytest

PROMPTS = [
    "def foo(x):\n    return",
    "import os\nimport sys\n\n\nclass Config",
    "for i in range(10):\n    if i %",
    "    def __init__(self, name, value=None):\n        self.",
]


@pytest.fixture(scope="module")
def self_draft(micro_family, tmp_path_factory):
    from specdeploy.cli import main

    out = tmp_path_factory.mktemp("self-draft") / "export"
    config = out.parent / "config.yaml"  # as make export's: a draft vocabulary for a distilled draft
    config.write_text("methods:\n  draft: {draft_vocab: 64}\n")
    code = main(["export", "--target", str(micro_family / "target"), "--draft", "self", "--out", str(out),
                 "--config", str(config)])
    assert code == 0
    return out


def test_the_draft_is_the_target_with_int4_weights(self_draft, micro_family):
    manifest = json.loads((self_draft / "manifest.json").read_text())
    assert manifest["check"] == "passed"  # the task check held the draft to the draft floor, the target to float
    assert list(manifest["quantization"]["models"]) == ["draft"]
    assert manifest["quantization"]["models"]["draft"]["bits"] == 4
    target, draft = manifest["models"]["target"], manifest["models"]["draft"]
    for key in ("num_layers", "hidden_size", "vocab_size", "num_heads", "num_kv_heads"):
        assert draft[key] == target[key], key
    assert "draft_vocab_file" not in draft  # a self-draft keeps the whole LM head
    methods = manifest["methods"]
    assert methods["draft"]["stop_below"] == 0.4 and methods["draft"]["k"] >= 4
    assert methods["draft"]["draft_vocab"] == 0  # the whole LM head, and the manifest says so


def test_greedy_output_equals_ar_whatever_the_stop_rule_drafts(self_draft):
    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.loaded_export import LoadedExport

    export = LoadedExport(self_draft)
    calls = {}
    for stop in (0.0, 0.4, 0.95):
        total = 0
        for text in PROMPTS:
            ids = export.tokenizer.encode(text)
            ar = generate(export, ids, method="ar", max_new_tokens=40, ignore_eos=True)
            got = generate(export, ids, method="draft", max_new_tokens=40, ignore_eos=True, adaptive=False,
                           method_overrides={"stop_below": stop})
            assert got.token_ids == ar.token_ids, (stop, text)
            total += got.stats["target_calls"]
        calls[stop] = total
    # the int4 copy agrees with its target on most tokens: far fewer target calls than tokens
    assert calls[0.0] < 0.6 * 40 * len(PROMPTS), calls
    # a high stop drafts fewer tokens per step, so it verifies more often
    assert calls[0.0] < calls[0.95], calls


@pytest.mark.parametrize("extra,message", [
    (["--draft-weights", "float"], "would cost at least as much per token as the float target"),
    (["--weights", "int8", "--draft-weights", "int8"], "would cost at least as much per token as the int8 target"),
    (["--weights", "int4"], "an int4 target has none"),
])
def test_a_self_draft_no_cheaper_than_its_target_is_refused(micro_family, tmp_path, capsys, extra, message):
    from specdeploy.cli import main

    code = main(["export", "--target", str(micro_family / "target"), "--draft", "self", "--out",
                 str(tmp_path / "never"), "--no-check", *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert not (tmp_path / "never").exists()
