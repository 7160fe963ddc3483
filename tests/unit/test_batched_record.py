"""The manifest's fused_batched record (runtime/graph_contract.FUSED_BATCHED): added to an existing
manifest with its checksums, found only as the batched graph, refused on any graph but the target's
decoder. No export needed (the hand-written manifest of test_manifest_fields)."""

from __future__ import annotations

import json

import pytest

from specdeploy.runtime import graph_contract as gc
from specdeploy.runtime.errors import SpecDeployError
from specdeploy.runtime.manifest import add_graph, load_manifest
from unit.test_manifest_fields import write_export


def _add_batched(root):
    record = gc.GraphRecord.new(gc.batched_graph_name(gc.TARGET), gc.TARGET, gc.DECODER, 1, flavor=gc.FUSED_BATCHED)
    (root / record.file).write_bytes(b"\x08\x07")
    weights = root / gc.weights_file(gc.TARGET, gc.FUSED_BATCHED)
    weights.parent.mkdir(exist_ok=True)
    weights.write_bytes(b"w")
    add_graph(root, record, [record.file, gc.weights_file(gc.TARGET, gc.FUSED_BATCHED)])
    return record


def test_the_batched_record_is_only_the_batched_graph(tmp_path):
    record = _add_batched(write_export(tmp_path))
    m = load_manifest(tmp_path)  # checksums of the added files verified
    assert m.batched_graph() == record and record.file == "target_fused_batched.onnx"
    assert "weights/target.fused_batched.bin" in m.files
    assert list(m.decoder_graphs("target")) == [1, 9] and not m.decoder_graphs("target", gc.FUSED)
    assert record.name not in m.trt_graphs()
    (tmp_path / "weights" / "target.fused_batched.bin").write_bytes(b"x")
    with pytest.raises(SpecDeployError, match="checksum mismatch .*target.fused_batched.bin"):
        load_manifest(tmp_path)
    (tmp_path / record.file).unlink()
    with pytest.raises(SpecDeployError, match=r"graph file missing: .*target_fused_batched.onnx \(re-export it\)"):
        load_manifest(tmp_path)


def test_only_the_targets_decoder_may_be_batched(tmp_path):
    write_export(tmp_path)
    path = tmp_path / "manifest.json"
    data = json.loads(path.read_text())
    data["graphs"]["draft_t1"]["flavor"] = gc.FUSED_BATCHED
    path.write_text(json.dumps(data))
    with pytest.raises(SpecDeployError, match="graphs.draft_t1.flavor .*only the target's decoder graph"):
        load_manifest(tmp_path)
