"""`export --exact-rows` (export/exact_rows.py): a float target whose fused attentions carry a padding
row, so a one-row call scores its row bit for bit as a call of several rows does, trees are verified
along their exact chain, and every method's greedy output is the target's `ar`'s exactly; the export
still passes its polygraphy check, writes no batched graph, and a batched service refuses it."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import assert_manifest_edits_refused, methods_differing_from_ar, run_cli

PROMPTS = [
    "def foo(x):\n    return",
    "import os\nimport sys\n\n\nclass Config",
    "for i in range(10):\n    if i %",
    "with open(path) as f:\n    data = f.read()\n",
]
NEW = 32


@pytest.fixture(scope="module")
def exact(micro_with_heads, tmp_path_factory):
    """Target, draft, EAGLE and Medusa of the micro family, exported with --exact-rows, checked."""
    from specdeploy.export.exporter import export_all
    from specdeploy.export.main import accuracy_check

    lines: list[str] = []
    out = tmp_path_factory.mktemp("exact") / "micro"
    family = micro_with_heads
    export_all(family / "target", out, draft=family / "draft", eagle=family / "eagle", medusa=family / "medusa",
               progress=lines.append, check=accuracy_check(lines.append), exact_rows=True)
    return out, lines


def _rows_by_call_size(export, prompt: str, sizes) -> dict[int, np.ndarray]:
    """The logits of calls of t rows (t in `sizes`) after the same 4-token past."""
    target = export.decoder("target")
    ids = np.array((export.tokenizer.encode(prompt) * 8)[: 4 + max(sizes)])
    calls = {}
    for t in sizes:
        target.reset()
        target.prefill(ids[:4], 64)
        calls[t] = target.forward(ids[4 : 4 + t], np.arange(4, 4 + t), np.tril(np.ones((t, t), bool))).logits.copy()
    target.reset()
    return calls


def test_the_manifest_records_the_padding_and_the_check_passed(exact):
    out, lines = exact
    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["exact_rows"]["models"]["target"]
    assert entry == {"attention_pad": 1, "unpadded_graph": "target_fused_unpadded.onnx"}
    assert entry["unpadded_graph"] in manifest["files"]  # checksummed like every graph
    assert manifest["check"] == "passed" and any("padded by one row" in line for line in lines)
    assert not [g for g in manifest["graphs"].values() if g.get("flavor") == "fused_batched"]
    assert "target_fused_batched.onnx" not in manifest["files"]
    proc = run_cli("check", out)  # the padded graphs against their references (with the padding row)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr


def test_a_lone_row_equals_the_same_row_among_others(exact):
    """What a float export without --exact-rows does not promise: its one-row attention kernel
    scores a lone row apart by ulps."""
    from specdeploy.runtime.loaded_export import LoadedExport

    out, _ = exact
    export = LoadedExport(out)
    target = export.decoder("target")
    # one-row calls with padded attentions, or, where this CPU sums a lone row apart even so, every
    # call of two rows or more on the unpadded graph (ort_decoder.py: the load-time probe)
    assert (target.call_sizes[0], target.spare) in ((1, 1), (2, 0))
    for prompt in PROMPTS:
        calls = _rows_by_call_size(export, prompt, (1, 2, 3, 5))
        for t, logits in calls.items():
            np.testing.assert_array_equal(logits[: min(t, 2)], calls[2][: min(t, 2)], err_msg=f"T={t} {prompt!r}")


def test_every_method_equals_ar_and_trees_follow_their_exact_chain(exact, micro_export):
    from specdeploy.runtime.generate import exact_rows_only
    from specdeploy.runtime.loaded_export import LoadedExport

    out, _ = exact
    export = LoadedExport(out)
    assert exact_rows_only(export) and not exact_rows_only(LoadedExport(micro_export))
    assert export.method_config("draft").runner_up > 0  # configured, but only the chain is verified
    methods = [m for m in export.methods if m != "ar"]
    assert {"draft", "eagle", "medusa", "prompt-lookup", "lookahead", "suffix", "eagle+suffix"} <= set(methods)
    assert not methods_differing_from_ar(export, methods, PROMPTS, NEW)


def test_no_batched_graph_and_a_batched_service_says_why(exact):
    from specdeploy.export.batched_graph import add_batched_target
    from specdeploy.runtime.errors import SpecDeployError
    from specdeploy.runtime.service import Service

    out, _ = exact
    with pytest.raises(SpecDeployError, match="--exact-rows"):
        Service.load(out, batch=2)
    with pytest.raises(SpecDeployError, match="--exact-rows"):
        add_batched_target(out)


def test_the_cli_refuses_exact_rows_without_fused_graphs(micro_family, tmp_path, capsys):
    from specdeploy.cli import main

    code = main(["export", "--target", str(micro_family / "target"), "--out", str(tmp_path / "never"), "--no-check",
                 "--no-fused", "--exact-rows"])
    err = capsys.readouterr().err
    assert code == 2 and "--exact-rows pads the ORT CPU fused graphs" in err and "Traceback" not in err
    assert not (tmp_path / "never").exists()


def test_the_manifest_entry_names_a_graph_inside_the_export(exact, tmp_path):
    """(Its fields' types and ranges: tests/unit/test_manifest_fields.py.)"""
    out, _ = exact
    assert_manifest_edits_refused(out, "exact_rows", (
        (("models", "target", "attention_pad"), 0, "are not padded"),
        (("models", "target", "unpadded_graph"), "../x.onnx", "outside the export"),
        (("models", "target", "unpadded_graph"), "gone.onnx", "graph file missing")), tmp_path)


def test_tune_tree_builds_the_chain_an_exact_rows_target_follows(exact):
    """Only the leading chain is verified, so tune-tree prices side nodes at nothing: it picks a chain,
    and its replay of the export's own static tree (chain nodes only) predicts what EAGLE-1 accepts."""
    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.loaded_export import LoadedExport
    from specdeploy.runtime.tree_tuning import tune

    out, _ = exact
    export = LoadedExport(out)
    prompts = [export.tokenizer.encode(p) for p in PROMPTS[:2]]
    result = tune(export, "eagle", prompts, max_new_tokens=NEW, max_nodes=16, progress=lambda m: None)
    report = result["report"]
    assert report["exact_rows"] and result["paths"] and not any(any(p) for p in result["paths"])
    calls = sum(generate(export, ids, method="eagle", max_new_tokens=NEW, ignore_eos=True,
                         method_overrides={"mode": "eagle1"}).stats["target_calls"] for ids in prompts)
    real = len(prompts) * NEW / calls
    assert abs(report["export_tree"]["empirical_tokens_per_step"] - real) < 0.5, (report["export_tree"], real)
