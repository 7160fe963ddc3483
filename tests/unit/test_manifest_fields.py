"""Every manifest.json field is type- and range-checked before the runtime trusts it
(runtime/manifest.py, runtime/manifest_fields.py): hostile values in a hand-written manifest are one
clear single-line error naming the field, and refusing leaves the files as they were.
(tests/test_integrity.py sends a few of them through LoadedExport on a real export.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdeploy.runtime import graph_contract as gc
from specdeploy.runtime.errors import SpecDeployError
from specdeploy.runtime.manifest import load_manifest, sha256_file, write_manifest
from unit.manifest_edits import set_field


def _model(name: str, layers: int) -> gc.ModelRecord:
    return gc.ModelRecord(name, num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64,
                          vocab_size=100, architecture="LlamaForCausalLM", model_type="llama", source=f"/{name}",
                          extra={"max_position_embeddings": 512})


def write_export(root: Path) -> Path:
    """A manifest as `specdeploy export` writes one: target and draft graphs, tokenizer, files map,
    a passed check. Graph files are ModelProtos holding only their ir_version."""
    graphs = {g.name: g for g in (gc.GraphRecord.new("target_t1", "target", gc.DECODER, 1),
                                  gc.GraphRecord.new("target_t9", "target", gc.DECODER, 9),
                                  gc.GraphRecord.new("draft_t1", "draft", gc.DECODER, 1))}
    for g in graphs.values():
        (root / g.file).write_bytes(b"\x08\x07")
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "tokenizer.json").write_text("{}")
    files = {rel: sha256_file(root / rel) for rel in [*(g.file for g in graphs.values()), "tokenizer/tokenizer.json"]}
    write_manifest(root, dtype="float32", max_context=256, prefill_chunk=9,
                   models={"target": _model("target", 2), "draft": _model("draft", 1)}, graphs=graphs,
                   tokenizer={"dir": "tokenizer", "eos_token_ids": [2], "bos_token_id": 1}, methods={}, files=files,
                   check="passed", exported_in_s=1.5)
    return root


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


HOSTILE = {
    "prefill_chunk_negative": (set_field("prefill_chunk", value=-1), "prefill_chunk"),
    "prefill_chunk_zero": (set_field("prefill_chunk", value=0), "prefill_chunk"),
    "prefill_chunk_text": (set_field("prefill_chunk", value="64"), "prefill_chunk must be an integer"),
    "prefill_chunk_huge": (set_field("prefill_chunk", value=10**6), "prefill_chunk"),
    "max_context_huge": (set_field("max_context", value=10**12), "max_context"),
    "max_context_float": (set_field("max_context", value=256.5), "max_context must be an integer"),
    "max_context_bool": (set_field("max_context", value=True), "max_context must be an integer"),
    "dtype_unknown": (set_field("dtype", value="int4"), "dtype"),
    "dtype_missing": (set_field("dtype", drop=True), "'dtype' is missing"),
    "format_text": (set_field("format", value="1"), "unsupported format"),
    "files_missing": (set_field("files", drop=True), "'files' is missing"),
    "files_empty": (set_field("files", value={}), "not in the files map"),
    "files_list": (set_field("files", value=["target_t1.onnx"]), "files must be a JSON object"),
    "files_bad_digest": (set_field("files", "target_t1.onnx", value="abc"), "sha256"),
    "num_layers_negative": (set_field("models", "target", "num_layers", value=-1), "models.target.num_layers"),
    "num_layers_text": (set_field("models", "target", "num_layers", value="2"), "models.target.num_layers"),
    "vocab_size_huge": (set_field("models", "target", "vocab_size", value=10**10), "models.target.vocab_size"),
    "head_dim_missing": (set_field("models", "draft", "head_dim", drop=True), "models.draft.head_dim is missing"),
    "kv_heads_over_heads": (set_field("models", "target", "num_kv_heads", value=64), "num_kv_heads"),
    "model_extra_negative": (set_field("models", "target", "max_position_embeddings", value=-5),
                             "models.target.max_position_embeddings"),
    "models_list": (set_field("models", value=[]), "models must be a JSON object"),
    "no_target": (lambda m: m["models"].pop("target") and m["graphs"].clear(), "no 'target' model"),
    "graph_tokens_huge": (set_field("graphs", "target_t1", "tokens", value=10**6), "graphs.target_t1.tokens"),
    "graph_tokens_negative": (set_field("graphs", "target_t1", "tokens", value=-1), "graphs.target_t1.tokens"),
    "graph_unknown_model": (set_field("graphs", "target_t1", "model", value="ghost"), "graphs.target_t1.model"),
    "graph_kind": (set_field("graphs", "target_t1", "kind", value="lm"), "graphs.target_t1.kind"),
    "graph_file_number": (set_field("graphs", "target_t1", "file", value=7), "graphs.target_t1.file"),
    "graph_name_traversal": (lambda m: m["graphs"].update({"../../x": m["graphs"]["target_t1"]}), "unusable name"),
    "eos_text": (set_field("tokenizer", "eos_token_ids", value="2"), "tokenizer.eos_token_ids"),
    "eos_negative": (set_field("tokenizer", "eos_token_ids", value=[-1]), "tokenizer.eos_token_ids[0]"),
    "bos_out_of_vocab": (set_field("tokenizer", "bos_token_id", value=10**9), "tokenizer.bos_token_id"),
    "tokenizer_dir_number": (set_field("tokenizer", "dir", value=3), "tokenizer.dir"),
    "methods_list": (set_field("methods", value=[]), "methods must be a JSON object"),
    "check_failed": (set_field("check", value="failed"), "did not pass its accuracy check"),
    "exported_in_nan": (set_field("exported_in_s", value=float("nan")), "exported_in_s"),
    "attention_pad_two": (lambda m: m.update(quantization=_quantized(attention_pad=2)),
                          "quantization.models.target.attention_pad must be between 0 and 1"),
    "attention_pad_text": (lambda m: m.update(quantization=_quantized(attention_pad="1")),
                           "quantization.models.target.attention_pad must be an integer"),
    "unpadded_graph_number": (lambda m: m.update(quantization=_quantized(unpadded_graph=3)),
                              "quantization.models.target.unpadded_graph must be a string"),
    "unpadded_graph_unpadded": (lambda m: m.update(quantization=_quantized(attention_pad=0, unpadded_graph="x.onnx")),
                                "unpadded_graph names an unpadded graph of a model whose graphs are not padded"),
    "unpadded_graph_outside": (lambda m: m.update(quantization=_quantized(unpadded_graph="/etc/passwd")),
                               "unpadded_graph: '/etc/passwd' is an absolute path"),
    "exact_rows_list": (set_field("exact_rows", value=[]), "exact_rows must be a JSON object"),
    "exact_rows_unpadded": (set_field("exact_rows", value={"models": {"target": {"attention_pad": 0}}}),
                            "exact_rows.models.target.attention_pad must be 1"),
    "exact_rows_pad_two": (set_field("exact_rows", value={"models": {"target": {"attention_pad": 2}}}),
                           "exact_rows.models.target.attention_pad must be between 0 and 1"),
    "exact_rows_ghost": (set_field("exact_rows", value={"models": {"ghost": {"attention_pad": 1}}}),
                         "exact_rows.models.ghost names an unknown model"),
    "exact_rows_unpadded_outside": (set_field("exact_rows", value={"models": {"target": {
        "attention_pad": 1, "unpadded_graph": "/etc/passwd"}}}), "unpadded_graph: '/etc/passwd' is an absolute path"),
}


def _quantized(**scheme) -> dict:
    """A `quantization` entry as export/quantize.py writes one (an int8 target), with `scheme` changes."""
    return {"method": "matmul_nbits", "flavor": "fused",
            "models": {"target": {"bits": 8, "lm_head_bits": 8, "block_size": 32, "symmetric": False,
                                  "accuracy_level": 4, "embedding": "shared", "attention_pad": 1, **scheme}}}


def test_the_hand_written_export_loads(tmp_path):
    """The baseline each case changes one thing of: it loads, so each error below is that change's."""
    m = load_manifest(write_export(tmp_path))
    assert set(m.models) == {"target", "draft"} and list(m.decoder_graphs("target")) == [1, 9]
    path = tmp_path / "manifest.json"  # and with a well-formed quantization entry
    path.write_text(json.dumps({**json.loads(path.read_text()), "quantization": _quantized()}))
    assert load_manifest(tmp_path).quantization["models"]["target"]["attention_pad"] == 1
    assert load_manifest(tmp_path).exact_rows  # a quantized target's rows are held exact
    data = {**json.loads(path.read_text()), "exact_rows": {"models": {"target": {"attention_pad": 1}}}}
    del data["quantization"]  # and a float target exported with --exact-rows
    path.write_text(json.dumps(data))
    exact = load_manifest(tmp_path)
    assert exact.exact_rows and (exact.attention_pad("target"), exact.attention_pad("draft")) == (1, 0)
    assert not m.exact_rows and exact.unpadded_graph_path("target") is None
    assert m.check == "passed" and m.eos_token_ids == [2] and m.prefill_chunk == 9


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_manifest_value_is_one_clear_error(tmp_path, case):
    export = write_export(tmp_path)
    change, needle = HOSTILE[case]
    path = export / "manifest.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    before = snapshot(export)
    with pytest.raises(SpecDeployError) as info:
        load_manifest(export)
    message = str(info.value)
    assert needle in message and "\n" not in message, message
    assert snapshot(export) == before  # refusing never changes the export


DEEP_JSON = "[" * 100000 + "]" * 100000  # past the JSON parser's recursion limit


def test_json_nested_past_the_recursion_limit_is_invalid_json_not_an_internal_error(tmp_path):
    """'[' * 100000 as manifest.json raised RecursionError (an internal error); so did a tune-tree prompts
    file, a --tree file, a tree --out file and a tokenizer dir's JSON. Each says the file is not valid JSON."""
    from specdeploy.runtime.chat_template import ChatTemplate
    from specdeploy.runtime.tree_files import read_tree_file
    from specdeploy.runtime.tree_tuning import check_tree_out, read_prompts_file

    export = tmp_path / "export"
    export.mkdir()
    write_export(export)
    (export / "manifest.json").write_text(DEEP_JSON)
    with pytest.raises(SpecDeployError, match=r"manifest .*manifest.json is not valid JSON: nested too deeply$"):
        load_manifest(export)
    for name in ("prompts.json", "prompts.jsonl"):
        (tmp_path / name).write_text(DEEP_JSON + "\n")
        with pytest.raises(SpecDeployError, match=f"prompts file .*{name} is not valid JSON/JSONL: nested too deeply"):
            read_prompts_file(tmp_path / name)
    with pytest.raises(SpecDeployError, match="tree file .* is not valid JSON: nested too deeply"):
        read_tree_file(tmp_path / "prompts.json")
    with pytest.raises(SpecDeployError, match="is not a tree written by `specdeploy tune-tree`"):
        check_tree_out(tmp_path / "prompts.json")
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer_config.json").write_text(DEEP_JSON)
    with pytest.raises(SpecDeployError, match="tokenizer_config.json in the tokenizer dir is not valid JSON: nested"):
        ChatTemplate.from_tokenizer_dir(tmp_path / "tokenizer")
    assert (tmp_path / "prompts.json").read_text() == DEEP_JSON + "\n"  # refused, not overwritten
