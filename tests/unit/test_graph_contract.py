"""The graph contract (names per kind and flavor, file names, KV geometry, manifest records) and the
manifest written and read back: no export needed."""

from __future__ import annotations

import types

import pytest

from specdeploy.runtime import graph_contract as gc
from specdeploy.runtime.errors import SpecDeployError
from specdeploy.runtime.manifest import load_manifest, sha256_file, write_manifest


def test_decoder_io_per_flavor_and_features():
    io = gc.decoder_io(2)
    assert io.inputs == ("input_ids", "position_ids", "tree_mask",
                         "past_key.0", "past_value.0", "past_key.1", "past_value.1")
    assert io.outputs == ("logits", "hidden", "present_key.0", "present_value.0", "present_key.1", "present_value.1")
    fused = gc.decoder_io(2, features=True, flavor=gc.FUSED)
    assert fused.inputs[:4] == ("input_ids", "position_ids", "tree_mask", "past_length")
    assert fused.outputs[:3] == ("logits", "hidden", "features")
    assert gc.graph_io(gc.DECODER, 2) == io


def test_head_graph_io():
    eagle = gc.eagle_draft_io(1)
    assert eagle.inputs == ("input_ids", "features", "position_ids", "tree_mask", "past_key.0", "past_value.0")
    assert eagle.outputs == ("topk_logprobs", "topk_ids", "hidden", "present_key.0", "present_value.0")
    assert gc.eagle_draft_io(1, gc.FUSED).inputs[4] == "past_length"
    assert gc.graph_io(gc.MEDUSA_HEADS) == gc.GraphIO(("hidden",), ("topk_ids", "topk_logprobs"))
    with pytest.raises(ValueError, match="unknown graph kind"):
        gc.graph_io("lm_head")


def test_kv_names_parse_both_ways():
    assert gc.parse_kv_name("present_value.11") == gc.KVName(present=True, kind="value", layer=11)
    assert gc.parse_kv_name("past_key.3").kind_index == 0
    assert gc.parse_kv_name("past_length") is None and not gc.is_past("past_length")
    assert gc.present_of("past_value.2") == "present_value.2" and gc.past_of("present_key.0") == "past_key.0"
    assert gc.is_present("present_key.5") and not gc.is_present("past_key.5")
    with pytest.raises(ValueError):
        gc.present_of("present_key.0")


def test_file_names():
    assert gc.decoder_graph_name("target", 9) == "target_t9"
    assert gc.decoder_graph_name("draft", 1, gc.FUSED) == "draft_fused_t1"
    assert gc.eagle_graph_name(4, 64, 64) == "eagle_t4"
    assert gc.eagle_graph_name(4, 192, 64) == "eagle_f192_t4"
    assert gc.eagle_graph_name(4, 192, 64, gc.FUSED) == "eagle_fused_f192_t4"
    assert gc.graph_file("target_t1") == "target_t1.onnx"
    assert (gc.weights_file("target"), gc.weights_file("target", gc.FUSED)) == ("weights/target.bin",
                                                                               "weights/target.fused.bin")


def test_kv_geometry_from_config_dict_or_object():
    cfg = {"num_hidden_layers": 3, "num_attention_heads": 8, "hidden_size": 256}
    assert gc.KVGeometry.from_config(cfg) == gc.KVGeometry(3, 8, 8, 32)  # no GQA, derived head_dim
    obj = types.SimpleNamespace(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, hidden_size=256,
                                head_dim=64)
    geo = gc.KVGeometry.from_config(obj)
    assert geo == gc.KVGeometry(2, 8, 2, 64) and geo.past_shape(5) == (1, 5, 2, 64)


def _model() -> gc.ModelRecord:
    return gc.ModelRecord("target", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64,
                          vocab_size=100, architecture="LlamaForCausalLM", model_type="llama", source="/m",
                          extra={"max_position_embeddings": 512, "feature_layers": [0, 1]})


def test_model_record_json_round_trip():
    rec = _model()
    data = rec.to_json()
    assert data["num_kv_heads"] == 2 and data["feature_layers"] == [0, 1] and data["source"] == "/m"
    assert gc.ModelRecord.from_json("target", data) == rec
    assert rec.geometry == gc.KVGeometry(2, 4, 2, 16)
    with pytest.raises(KeyError, match="head_dim"):
        gc.ModelRecord.from_json("target", {k: v for k, v in data.items() if k != "head_dim"})


def test_graph_record_json_round_trip():
    portable = gc.GraphRecord.new("target_t1", "target", gc.DECODER, 1)
    assert portable.to_json() == {"file": "target_t1.onnx", "model": "target", "kind": "decoder", "tokens": 1}
    eagle = gc.GraphRecord.new("eagle_fused_t4", "eagle", gc.EAGLE_DRAFT, 4, flavor=gc.FUSED, features=64)
    medusa = gc.GraphRecord.new("medusa_heads", "target", gc.MEDUSA_HEADS, 1, extra={"num_heads": 3, "top_k": 8})
    for rec in (portable, eagle, medusa):
        assert gc.GraphRecord.from_json(rec.name, rec.to_json()) == rec
    assert eagle.to_json()["flavor"] == "fused" and medusa.to_json()["top_k"] == 8
    with pytest.raises(ValueError, match="flavor"):
        gc.GraphRecord.from_json("x", {**portable.to_json(), "flavor": "turbo"})


def test_manifest_written_is_the_manifest_read(tmp_path):
    graphs = {g.name: g for g in (gc.GraphRecord.new("target_t1", "target", gc.DECODER, 1),
                                  gc.GraphRecord.new("target_fused_t1", "target", gc.DECODER, 1, flavor=gc.FUSED))}
    for g in graphs.values():
        (tmp_path / g.file).write_bytes(b"\x08\x07")  # a ModelProto with only its ir_version
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.json").write_text("{}")
    files = {rel: sha256_file(tmp_path / rel) for rel in ("target_t1.onnx", "target_fused_t1.onnx",
                                                           "tokenizer/tokenizer.json")}
    write_manifest(tmp_path, dtype="float32", max_context=64, prefill_chunk=1, models={"target": _model()},
                   graphs=graphs, tokenizer={"eos_token_ids": [2]}, methods={}, files=files, exported_in_s=1.0)
    m = load_manifest(tmp_path)
    assert m.models == {"target": _model()} and m.graphs == graphs
    assert list(m.decoder_graphs("target")) == [1] and m.decoder_graphs("target", gc.FUSED)[1].name == "target_fused_t1"
    assert set(m.trt_graphs()) == {"target_t1"} and m.raw["exported_in_s"] == 1.0
    (tmp_path / "manifest.json").write_text((tmp_path / "manifest.json").read_text().replace('"decoder"', '"lm"'))
    with pytest.raises(SpecDeployError, match="graphs.target_t1.kind is 'lm'"):
        load_manifest(tmp_path)
