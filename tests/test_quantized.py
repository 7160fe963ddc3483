"""Quantized exports (--weights int4|int8): the fused graphs' weights as MatMulNBits, each model's
weights once, greedy output of every method equal to the quantized target's own ar, the scheme
in the manifest, and the task-level accuracy check (top-1 agreement, perplexity vs float32)
passing on a sound quantization and failing on a broken one (export/quantize.py, task_check.py)."""

from __future__ import annotations

import gc
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_manifest_edits_refused, methods_differing_from_ar, run_cli

PROMPTS = [
    "def foo(x):\n    return",
    "import os\nimport sys\n\n\nclass Config",
    "for i in range(10):\n    if i %",
    "    def __init__(self, name, value=None):\n        self.",
    "with open(path) as f:\n    data = f.read()\n",
    "raise ValueError(",
]
NEW = 32


def _export(family: Path, out: Path, check: bool = True, **choices):
    from specdeploy.export.exporter import export_all
    from specdeploy.export.main import accuracy_check
    from specdeploy.export.quantize import QuantPlan

    lines: list[str] = []
    plan = QuantPlan.from_choices(choices.pop("block_size", 32), **choices)
    export_all(family / "target", out, draft=family / "draft", eagle=family / "eagle", medusa=family / "medusa",
               progress=lines.append, check=accuracy_check(lines.append) if check else None, quantize=plan)
    return out, lines


@pytest.fixture(scope="module", params=["int4", "int8"])
def quantized(request, micro_with_heads, tmp_path_factory):
    """Target, draft and EAGLE head quantized alike, published after the accuracy check."""
    bits = request.param
    out, lines = _export(micro_with_heads, tmp_path_factory.mktemp("quantized") / bits, target=bits, draft=bits,
                         eagle=bits)
    return bits, out, lines


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def _ops(path: Path) -> list[str]:
    import onnx

    return [n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node]


def test_manifest_records_the_scheme_and_only_fused_graphs_change(quantized, micro_export):
    bits, out, lines = quantized
    manifest = _manifest(out)
    assert manifest["check"] == "passed"
    q = manifest["quantization"]
    assert q["flavor"] == "fused" and q["method"] == "matmul_nbits"
    assert set(q["models"]) == {"target", "draft", "eagle"}  # Medusa heads stay float
    for model, scheme in q["models"].items():
        assert scheme["bits"] == int(bits[3:]) and scheme["block_size"] == 32
        assert scheme["lm_head_bits"] == 8  # the LM head stays 8-bit under an int4 body
        assert scheme["embedding"] == "float"  # the micro family's embeddings are untied
        # a quantized target's attentions carry a padding row (export/attention_pad.py); drafters'
        # rows only change proposals
        assert scheme.get("attention_pad", 0) == (1 if model == "target" else 0), model
    # and the same graph without the padding, for a CPU that pads every call to two rows: the same weights
    unpadded = out / q["models"]["target"]["unpadded_graph"]
    padded = out / manifest["graphs"]["target_fused_t1"]["file"]
    assert [op for op in _ops(padded) if op not in ("Slice", "Concat", "Pad", "Add")] == \
        [op for op in _ops(unpadded) if op not in ("Slice", "Concat", "Add")] and "Pad" not in _ops(unpadded)
    assert len(_ops(unpadded)) < len(_ops(padded)) and _weight_refs(unpadded) == _weight_refs(padded)
    assert all("unpadded_graph" not in scheme for model, scheme in q["models"].items() if model != "target")
    for name, g in manifest["graphs"].items():
        ops = _ops(out / g["file"])
        if g.get("flavor") == "fused":
            assert "MatMulNBits" in ops and "MatMul" not in ops, name  # every weight, the LM head included
        else:
            assert "MatMulNBits" not in ops, name  # portable graphs (TensorRT's source) stay float
    for model in ("target", "draft"):
        size = (out / "weights" / f"{model}.fused.bin").stat().st_size
        assert size < (0.6 if bits == "int4" else 0.7) * _payload(micro_export, model, "fused"), (model, size)
        both = set(_manifest(out)["graphs"]) & set(_manifest(micro_export)["graphs"])
        assert _payload(out, model, "portable", both) == _payload(micro_export, model, "portable", both), model


def _weight_refs(path: Path) -> set:
    """(location, offset, length) of each external payload the graph at `path` reads."""
    import onnx

    return {tuple(e.value for e in t.external_data)
            for t in onnx.load(str(path), load_external_data=False).graph.initializer if t.external_data}


def _payload(export, model: str, flavor: str, names=None) -> int:
    """Bytes of external weights `model`'s `flavor` graphs read (wherever stored: a payload another
    model already holds is stored once, export/onnx_writer.SharedWeights)."""
    import onnx

    manifest = _manifest(export)
    seen = set()
    for name, g in manifest["graphs"].items():
        if g["model"] == model and g.get("flavor", "portable") == flavor and (names is None or name in names):
            for t in onnx.load(str(export / g["file"]), load_external_data=False).graph.initializer:
                entry = {e.key: e.value for e in t.external_data}
                if entry:
                    seen.add((entry["location"], int(entry["offset"]), int(entry["length"])))
    return sum(length for _, _, length in seen)


def test_weights_stay_once_per_model(quantized):
    """Every T of a model is one file content over one weights file, as before quantization."""
    _, out, _ = quantized
    manifest = _manifest(out)
    for model in ("target", "draft", "eagle"):
        files = [out / g["file"] for g in manifest["graphs"].values()
                 if g["model"] == model and g.get("flavor") == "fused"]
        assert len(files) >= 2
        assert len({hashlib.sha256(f.read_bytes()).hexdigest() for f in files}) == 1, model
    assert {p.name for p in (out / "weights").iterdir()} == {  # quantized in place: no second fused file
        "target.bin", "target.fused.bin", "draft.bin", "draft.fused.bin", "eagle.bin", "eagle.fused.bin", "medusa.bin"}


def _methods_differing_from_ar(export, methods, prompts=PROMPTS) -> list:
    return methods_differing_from_ar(export, methods, prompts, NEW)


def test_every_method_equals_the_quantized_targets_ar(quantized):
    from specdeploy.runtime.loaded_export import LoadedExport

    _, out, _ = quantized
    export = LoadedExport(out)
    assert export.decoder("target").fused  # the quantized graphs are what runs
    methods = [m for m in export.methods if m != "ar"]
    assert {"draft", "eagle", "medusa", "prompt-lookup", "lookahead", "suffix"} <= set(methods)
    assert not _methods_differing_from_ar(export, methods)


def test_every_method_reports_ars_logprobs_bit_for_bit(quantized):
    """Every emitted token comes from a row computed as sequential decoding computes it (padded one-row
    calls, exact chains), so its logprob and alternatives are ar's to the bit, greedy or seeded."""
    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.loaded_export import LoadedExport
    from specdeploy.runtime.sampling import SamplingParams

    _, out, _ = quantized
    export = LoadedExport(out)
    for params in (SamplingParams(0.0), SamplingParams(0.9, seed=4, sampling="seeded")):
        for prompt in PROMPTS:
            ids = export.tokenizer.encode(prompt)
            runs = {m: generate(export, ids, method=m, params=params, max_new_tokens=NEW, ignore_eos=True, logprobs=4)
                    for m in export.methods}
            want = runs.pop("ar")
            assert want.logprobs is not None and len(want.logprobs) == len(want.token_ids) == NEW
            for method, got in runs.items():
                assert got.token_ids == want.token_ids and got.logprobs == want.logprobs, (method, prompt, params)
            # the text scored whole (prefill rows: echo's prompt logprobs) gives the generation's numbers too
            scored = generate(export, ids + want.token_ids, method="ar", max_new_tokens=1, logprobs=4,
                              prompt_logprobs=True).prompt_logprobs
            assert scored[0] is None and len(scored) == len(ids) + NEW
            assert [(lp.token_id, lp.logprob, lp.top) for lp in scored[len(ids):]] == \
                [(lp.token_id, lp.logprob, lp.top) for lp in want.logprobs]


def test_auto_runs_prompt_lookup_on_a_quantized_target(quantized):
    """A quantized target's default method is prompt lookup alone (runtime/methods.py: the fused methods
    measured slower than it there), though the export serves the draft and heads too."""
    from specdeploy.runtime.generate import Generation
    from specdeploy.runtime.loaded_export import LoadedExport

    _, out, _ = quantized
    export = LoadedExport(out)
    assert "draft+prompt-lookup" in export.methods
    ids = export.tokenizer.encode("def main():")
    auto = Generation(export, ids, method="auto", max_new_tokens=16, ignore_eos=True).result()
    ar = Generation(export, ids, method="ar", max_new_tokens=16, ignore_eos=True).result()
    assert auto.stats["method"] == "prompt-lookup" and auto.token_ids == ar.token_ids
    # the export's own API takes `auto` wherever it takes a method (its error lists `auto` as one)
    assert export.method_config("auto") == export.method_config("prompt-lookup")
    export.warm_up("auto")


def test_rows_are_identical_from_any_call_size(quantized):
    """Every call size gives bit-identical rows, one-row calls included: what keeps every method
    equal to ar. A quantized target (block 32) runs one-row calls, its attentions padded by a row
    (one spare position)."""
    from specdeploy.runtime.loaded_export import LoadedExport

    bits, out, _ = quantized
    export = LoadedExport(out)
    target = export.decoder("target")
    # one-row calls with padded attentions (one spare position), or, where this CPU sums a lone row apart,
    # every call of two rows or more on the unpadded graph (no spare position)
    assert target.sizes[0] == 1 and (target.call_sizes[0], target.spare) in ((1, 1), (2, 0))
    assert export.decoder("draft").sizes[0] == 1 and export.decoder("draft").spare == 0  # rows change proposals only
    ids = np.array((export.tokenizer.encode("\n".join(PROMPTS)) * 8)[: 4 + max(target.sizes)])
    target.reset()
    target.prefill(ids[:4], 64)
    calls = {}
    for t in sorted({1, 2, *target.sizes}):  # t rows
        calls[t] = target.forward(ids[4 : 4 + t], np.arange(4, 4 + t), np.tril(np.ones((t, t), bool))).logits.copy()
    for t, logits in calls.items():  # a causal row depends on the rows before it only
        np.testing.assert_array_equal(logits[: min(t, 2)], calls[2][: min(t, 2)], err_msg=f"T={t}")


def test_a_call_never_ends_at_the_context_end(quantized):
    """A one-row call writes a padding row one position past its token (the padded attention, or the
    padding row of a two-row call where this CPU pads them): one before the context end it is refused,
    never written past the KV buffer (generation stops a position earlier: test_decoding_to_the_context_end)."""
    from specdeploy.runtime.errors import SpecDeployError
    from specdeploy.runtime.loaded_export import LoadedExport

    bits, out, _ = quantized
    target = LoadedExport(out).decoder("target")
    target.reset()
    one = target.graph_for(1)  # 1; 2 on a CPU where the load check pads one-row calls
    n = target.max_context - one
    target.prefill(np.zeros(n, np.int64), 64)  # its calls end before the last position
    assert target.cache.length == n
    if target.spare:  # padded attentions: one spare position
        assert target.room == one - 1
        with pytest.raises(SpecDeployError, match="less 1 spare"):
            target.forward(np.zeros(1, np.int64), np.array([n]), np.ones((1, 1), bool))
        return
    # the unpadded graph, every call two rows or more: a lone token's call fills the last position
    assert one == 2 and target.room == 2
    target.forward(np.zeros(1, np.int64), np.array([n]), np.ones((1, 1), bool))
    with pytest.raises(SpecDeployError, match="context full"):
        target.forward(np.zeros(3, np.int64), np.arange(n, n + 3), np.tril(np.ones((3, 3), bool)))


ONE_ROW_METHODS = ("draft", "eagle", "prompt-lookup")  # a model drafter, a tree, a host drafter


def test_a_block_whose_lone_rows_differ_never_runs_one_row_calls(micro_with_heads, tmp_path):
    """Block 128 (past ROW_EXACT_BLOCK): MatMulNBits sums a lone row differently, so the target's
    T=1 record becomes T=2 (one padding row through every weight) and its attentions stay unpadded."""
    from specdeploy.runtime.loaded_export import LoadedExport

    out, _ = _export(micro_with_heads, tmp_path / "b128", check=False, target="int4", draft="int4", eagle="int4",
                     block_size=128)
    assert "attention_pad" not in _manifest(out)["quantization"]["models"]["target"]
    export = LoadedExport(out)
    target = export.decoder("target")
    assert target.sizes[0] == 2 and target.call_sizes[0] == 2 and target.spare == 0
    assert not _methods_differing_from_ar(export, ONE_ROW_METHODS, PROMPTS[:3])


def test_the_runtime_pads_one_row_calls_where_this_cpu_sums_them_apart(micro_with_heads, tmp_path, monkeypatch,
                                                                       caplog):
    """An export whose one-row calls were row-exact where it was made, loaded on a CPU where they
    are not (simulated: the table claims block 128 exact, so the export pads attention and keeps
    T=1): the decoder's load-time probe finds the difference and gives one-row calls a padding
    row, so every method still equals ar."""
    from specdeploy.export import quantize
    from specdeploy.runtime.backends.ort_decoder import OrtDecoder
    from specdeploy.runtime.backends.sessions import live_sessions
    from specdeploy.runtime.loaded_export import LoadedExport

    monkeypatch.setattr(quantize, "ROW_EXACT_BLOCK", {4: 128, 8: 128})
    out, _ = _export(micro_with_heads, tmp_path / "claimed", check=False, target="int4", draft="int4", eagle="int4",
                     block_size=128)
    assert _manifest(out)["quantization"]["models"]["target"]["attention_pad"] == 1
    # the premise, with the probe answering "exact": on this CPU a lone row does differ
    monkeypatch.setattr(OrtDecoder, "_lone_rows_exact", lambda self: True)
    unchecked = LoadedExport(out).decoder("target")
    assert unchecked.call_sizes[0] == 1
    rows = [unchecked.forward(np.array([5, 6][:n]), np.arange(n), np.tril(np.ones((n, n), bool))).logits[0]
            for n in (1, 2)]
    if np.array_equal(rows[0], rows[1]):
        pytest.skip("this CPU's MatMulNBits sums a lone row at block 128 as it sums it among others")
    monkeypatch.undo()
    del unchecked  # its padded session: freed once no decoder holds it

    export = LoadedExport(out)
    target = export.decoder("target")
    assert target.sizes[0] == 1 and target.call_sizes[0] == 2  # T=1 exported, refused here
    assert "one-row calls take a padding row" in caplog.text  # said as a warning
    # every call has two rows now, so it runs the export's unpadded graph, the padded one's session let go
    unpadded = out / _manifest(out)["quantization"]["models"]["target"]["unpadded_graph"]
    padded = out / "target_fused_t1.onnx"
    assert target.spare == 0 and {g.path for g in target.graphs.values()} == {unpadded}

    def live() -> set[Path]:
        gc.collect()
        return {p.resolve() for p in live_sessions()}

    assert unpadded.resolve() in live() and padded.resolve() not in live()
    assert not _methods_differing_from_ar(export, ONE_ROW_METHODS, PROMPTS[:3])
    second = LoadedExport(out).decoder("target")  # the probe's verdict is kept: no padded session reopened
    assert second.spare == 0 and padded.resolve() not in live()


def test_a_trees_leading_chain_is_sequential_decoding(quantized, micro_export):
    """A tree row whose ancestors are not one run from the root sums in another order; int8
    activations turn that into whole logits (SmolLM2 int8: up to 0.7). So a quantized target's
    verification follows only the leading chain, whose rows equal a plain chain call bit for bit
    whatever siblings follow (runtime/verify.py, exact_rows; the tree runs in preorder)."""
    from specdeploy.runtime.generate import exact_rows_only
    from specdeploy.runtime.loaded_export import LoadedExport
    from specdeploy.runtime.tree import Tree

    _, out, _ = quantized
    export = LoadedExport(out)
    assert exact_rows_only(export) and not exact_rows_only(LoadedExport(micro_export))
    target = export.decoder("target")
    ids = np.array(export.tokenizer.encode("\n".join(PROMPTS))[:12])

    def call(tree, tokens):
        target.reset()
        target.prefill(ids[:4], 64)
        return target.forward(np.asarray(tokens), 4 + tree.depth, tree.mask).logits.copy()

    chain = call(Tree.chain(3), ids[4:8])
    tree = Tree(parents=(-1, 0, 1, 2, 0, 4, 1))  # the chain, then a second branch and a sibling
    assert tree.chain_rows == 4
    np.testing.assert_array_equal(call(tree, [*ids[4:8], 7, 8, 9])[:4], chain)


def test_decoding_to_the_context_end(quantized):
    """A quantized target stops at the context end ("length") a position early (its calls write
    one past their rows), every method alike."""
    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.loaded_export import LoadedExport

    _, out, _ = quantized
    export = LoadedExport(out)
    room = 40
    ids = (export.tokenizer.encode("\n".join(PROMPTS)) * 200)[: export.manifest.max_context - room]
    ar = generate(export, ids, method="ar", max_new_tokens=2 * room, ignore_eos=True)
    assert ar.finish_reason == "length" and room - 2 <= len(ar.token_ids) <= room
    for method in ("draft", "eagle", "prompt-lookup"):
        got = generate(export, ids, method=method, max_new_tokens=2 * room, ignore_eos=True)
        assert (got.finish_reason, got.token_ids) == ("length", ar.token_ids), method


def test_a_whole_context_window_is_scored(quantized):
    """Scoring alone (prompt logprobs, 0 new tokens) prefills all but the last token: a padded target's
    calls, which write one past their rows, fit a prompt as long as the context; its numbers are those of
    the same text one token shorter."""
    from specdeploy.runtime.generate import Generation
    from specdeploy.runtime.loaded_export import LoadedExport

    _, out, _ = quantized
    export = LoadedExport(out)
    ids = (export.tokenizer.encode("\n".join(PROMPTS)) * 200)[: export.manifest.max_context]

    def scored(prompt):
        gen = Generation(export, prompt, method="ar", max_new_tokens=0, logprobs=0, prompt_logprobs=True)
        assert gen.result().finish_reason == "length" and not gen.new_ids
        return gen.prompt_logprobs

    whole = scored(ids)
    assert len(whole) == len(ids) and whole[0] is None
    assert whole[:-1] == scored(ids[:-1])


def test_task_check_passes_with_its_numbers(quantized):
    bits, out, lines = quantized
    assert any("top-1 agreement with float32" in line for line in lines)  # ran at export, before publishing
    proc = run_cli("check", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    task = [line for line in proc.stdout.splitlines() if "top-1 agreement with float32" in line]
    assert [line.split()[1] for line in task] == ["target", "draft", "eagle"]
    for line in task:
        assert line.startswith("ok ") and "threshold >=" in line and f"{bits} (block 32)" in line
    assert all("perplexity" in line and "threshold <=" in line for line in task[:2])
    assert "target_fused_t" not in proc.stdout  # quantized graphs are not held to float rounding bounds


def _broken(monkeypatch):
    """Quantization with a corrupted scale: the first attention projection's scales x4."""
    from onnx import numpy_helper

    from specdeploy.export import quantize

    real = quantize.quantize_model

    def corrupt(model, scheme):
        out, embedding = real(model, scheme)
        node = next(n for n in out.graph.node if n.op_type == "MatMulNBits")
        scales = next(t for t in out.graph.initializer if t.name == node.input[2])
        scales.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scales) * 4, scales.name))
        return out, embedding

    monkeypatch.setattr(quantize, "quantize_model", corrupt)


def test_task_check_fails_on_a_corrupted_scale(micro_with_heads, tmp_path, monkeypatch):
    from specdeploy.runtime.errors import SpecDeployError

    _broken(monkeypatch)
    with pytest.raises(SpecDeployError, match="task check"):  # the export refuses to publish it
        _export(micro_with_heads, tmp_path / "refused", target="int4")
    assert not (tmp_path / "refused").exists()
    out, _ = _export(micro_with_heads, tmp_path / "unchecked", check=False, target="int4")
    proc = run_cli("check", out)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (line,) = [line for line in proc.stdout.splitlines() if "top-1 agreement with float32" in line]
    assert line.startswith("FAIL target int4")
    assert "below the task-level accuracy thresholds" in proc.stderr


def test_models_are_quantized_independently(micro_with_heads, tmp_path):
    out, _ = _export(micro_with_heads, tmp_path / "draft-only", check=False, target="float", draft="int4")
    manifest = _manifest(out)
    assert list(manifest["quantization"]["models"]) == ["draft"]
    fused = {g["model"]: out / g["file"] for g in manifest["graphs"].values() if g.get("flavor") == "fused"}
    assert "MatMulNBits" in _ops(fused["draft"])
    assert "MatMulNBits" not in _ops(fused["target"]) and "MatMulNBits" not in _ops(fused["eagle"])


def test_tied_embedding_reads_the_quantized_lm_head():
    """A tied table (the LM head's weight transposed) becomes GatherBlockQuantized over the LM head's
    MatMulNBits initializers (one copy); a hidden size that is not a whole number of blocks is sliced."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from specdeploy.export.quantize import WeightScheme, quantize_model

    vocab, hidden = 96, 48  # 48 = 1.5 blocks of 32
    table = np.random.default_rng(0).standard_normal((vocab, hidden)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["embed.weight", "ids"], ["emb"], name="embed"),
         helper.make_node("MatMul", ["x", "lm_head.weight"], ["logits"], name="lm_head")], "tied",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, "t"]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "t", hidden])],
        [helper.make_tensor_value_info("emb", TensorProto.FLOAT, [1, "t", hidden]),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "t", vocab])],
        [numpy_helper.from_array(table, "embed.weight"), numpy_helper.from_array(table.T.copy(), "lm_head.weight")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    for bits in (4, 8):
        quantized, embedding = quantize_model(onnx.ModelProto.FromString(model.SerializeToString()),
                                              WeightScheme(bits, 32, lm_head_bits=bits))
        assert embedding == "shared"
        ops = [n.op_type for n in quantized.graph.node]
        assert "GatherBlockQuantized" in ops and "Gather" not in ops and "Slice" in ops
        assert {t.name for t in quantized.graph.initializer if t.data_type == TensorProto.FLOAT and
                len(t.dims) == 2 and t.dims[0] * t.dims[1] == vocab * hidden} == set()  # no float table left
        session = ort.InferenceSession(quantized.SerializeToString(), providers=["CPUExecutionProvider"])
        ids = np.arange(vocab, dtype=np.int64)[None]
        one_hot = np.eye(hidden, dtype=np.float32)[None]
        emb = session.run(["emb"], {"ids": ids, "x": np.zeros((1, vocab, hidden), np.float32)})[0][0]
        lm_rows = session.run(["logits"], {"ids": ids[:, :hidden], "x": one_hot})[0][0].T  # dequantized W.T
        np.testing.assert_allclose(emb, lm_rows, atol=1e-5)  # the same quantized numbers
        assert 0 < np.abs(emb - table).max() < (0.6 if bits == 4 else 0.05)


def test_tensorrt_weight_only_qdq_lints_and_runs(micro_export, tmp_path):
    """The TensorRT path (not built here): int4 blocked / int8 per-channel weights through
    DequantizeLinear -> MatMul; TensorRT's parser (offline lint) takes it, ONNX Runtime runs it."""
    import onnx
    import onnxruntime as ort

    from specdeploy.engines.lint import lint_model
    from specdeploy.export.quantize_trt import weight_only_qdq
    from specdeploy.export.reference import load_reference

    # a private copy: other tests hard-link the session's export, and onnx.load refuses external
    # data with more than one link (its hard-link attack check)
    (tmp_path / "weights").mkdir()
    shutil.copy(micro_export / "target_t15.onnx", tmp_path / "target_t15.onnx")
    for f in (micro_export / "weights").iterdir():
        shutil.copy(f, tmp_path / "weights" / f.name)
    path = tmp_path / "target_t15.onnx"
    feeds, _ = load_reference(micro_export / "check", "target_t15")
    float_logits = ort.InferenceSession(str(path)).run(["logits"], feeds)[0]
    model = onnx.load(str(path))
    for bits, versions in ((4, ["10.15", "11"]), (8, ["10.0", "10.15", "11"])):
        qdq = weight_only_qdq(model, bits, block_size=32)
        ops = [n.op_type for n in qdq.graph.node]
        assert ops.count("DequantizeLinear") == 15  # 2 layers x (q, k, v, o, gate, up, down) + the LM head
        findings, _ = lint_model(qdq, f"target_t15_int{bits}", targets=versions)
        assert not findings, [str(f) for f in findings]
        logits = ort.InferenceSession(qdq.SerializeToString()).run(["logits"], feeds)[0]
        assert np.isfinite(logits).all()
        if bits == 8:
            assert (logits.argmax(-1) == float_logits.argmax(-1)).mean() >= 0.9


def test_cli_refuses_what_it_cannot_quantize(micro_family, tmp_path, capsys):
    """Before anything is written (in-process: the same parser and error path as the command)."""
    from specdeploy.cli import main

    target, draft = micro_family / "target", micro_family / "draft"
    cases = [
        (["--weights", "int4", "--block-size", "24"], "--block-size must be one of 16, 32, 64, 128, 256 (got 24)"),
        (["--weights", "int4", "--block-size", "512"], "--block-size must be one of"),  # past MLAS's kernels
        (["--weights", "int8", "--block-size", "0"], "--block-size must be one of"),  # was taken as the default
        (["--block-size", "64"], "--block-size applies to quantized weights"),  # was ignored on a float export
        (["--weights", "int4", "--dtype", "float16"], "need --dtype float32"),
        (["--weights", "int4", "--no-fused"], "need --dtype float32 and no --no-fused"),
        (["--draft-weights", "int4"], "--draft-weights needs --draft"),
        (["--draft", draft, "--heads-weights", "int4"], "--heads-weights applies to an EAGLE head"),
        (["--lm-head-bits", "4"], "--lm-head-bits applies to quantized weights"),
    ]
    for extra, message in cases:
        code = main(["export", "--target", str(target), "--out", str(tmp_path / "never"), "--no-check",
                     *map(str, extra)])
        err = capsys.readouterr().err
        assert code == 2 and message in err, (extra, err)
        assert not (tmp_path / "never").exists()


def test_the_task_check_fits_a_short_context(micro_family, tmp_path):
    """The task check scores windows of up to 256 tokens; with a shorter context, a padded
    target's windows leave its spare position (a window of max_context rows would not fit)."""
    from specdeploy.export.exporter import export_all
    from specdeploy.export.main import accuracy_check
    from specdeploy.export.quantize import QuantPlan

    config = tmp_path / "short.yaml"
    config.write_text("max_context: 96\n")
    lines: list[str] = []
    out = export_all(micro_family / "target", tmp_path / "short", config=config, progress=lines.append,
                     check=accuracy_check(lines.append), quantize=QuantPlan.from_choices(target="int8"))
    manifest = _manifest(out)
    assert manifest["max_context"] == 96 and manifest["check"] == "passed"
    assert manifest["quantization"]["models"]["target"]["attention_pad"] == 1


def test_the_lm_head_bits_are_chosen_on_the_command_line(micro_family, tmp_path):
    """`--lm-head-bits 4`: the LM head (the widest MatMul) at 4 bits like the body, recorded."""
    import onnx
    from onnx import helper

    proc = run_cli("export", "--target", micro_family / "target", "--out", tmp_path / "lm4", "--no-check",
                   "--weights", "int4", "--lm-head-bits", "4")
    assert proc.returncode == 0, proc.stderr
    manifest = _manifest(tmp_path / "lm4")
    assert manifest["quantization"]["models"]["target"]["lm_head_bits"] == 4
    fused = next(g["file"] for g in manifest["graphs"].values() if g.get("flavor") == "fused")
    nodes = [n for n in onnx.load(str(tmp_path / "lm4" / fused), load_external_data=False).graph.node
             if n.op_type == "MatMulNBits"]
    attrs = [{a.name: helper.get_attribute_value(a) for a in n.attribute} for n in nodes]
    lm = max(attrs, key=lambda a: a["N"])
    assert lm["N"] == manifest["models"]["target"]["vocab_size"] and {a["bits"] for a in attrs} == {4}


def test_manifest_validates_the_scheme(quantized, tmp_path):
    _, out, _ = quantized
    assert_manifest_edits_refused(out, "quantization", (
        (("models", "target", "bits"), 3, "bits must be one of"),
        (("models", "target", "block_size"), 48, "power of two"),
        (("models", "nobody"), {}, "unknown model"),
        (("flavor",), "tiny", "quantization.flavor"),
        (("models", "eagle", "unpadded_graph"), "eagle_fused_t1.onnx", "are not padded"),
        (("models", "target", "unpadded_graph"), "../x.onnx", "outside the export"),
        (("models", "target", "unpadded_graph"), "gone.onnx", "graph file missing")), tmp_path)
