"""The external-data scan the manifest's containment check relies on (runtime/onnx_external.py),
on hand-built ONNX protobufs."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from specdeploy.runtime.onnx_external import external_data_locations


def test_external_data_scan_sees_every_tensor(tmp_path):
    """Initializers, sparse initializers, Constant attributes, subgraphs: every location found,
    and a group field (which protobuf skips) does not hide what follows it."""
    def external(name):
        t = helper.make_tensor(name, TensorProto.FLOAT, [1], [0.0])
        t.ClearField("float_data")
        t.data_location = TensorProto.EXTERNAL
        t.external_data.add(key="location", value=f"../{name}.bin")
        return t

    def sparse(name):
        return helper.make_sparse_tensor(external(name), helper.make_tensor(f"{name}_i", TensorProto.INT64, [1], [0]),
                                         [2])

    inner = helper.make_graph([helper.make_node("Constant", [], ["d"], sparse_value=sparse("deep"))], "inner", [],
                              [helper.make_tensor_value_info("d", TensorProto.FLOAT, None)])
    graph = helper.make_graph([helper.make_node("Constant", [], ["c"], value=external("const")),
                               helper.make_node("If", ["cond"], ["o"], then_branch=inner, else_branch=inner)],
                              "g", [], [], initializer=[external("init")], sparse_initializer=[sparse("sparse")])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph), str(path))
    expected = ["../const.bin", "../deep.bin", "../init.bin", "../sparse.bin"]
    assert external_data_locations(path) == expected
    group = bytes([0x9B, 0x06, 0x28, 0x01, 0x9C, 0x06])  # field 99 as a group holding a varint
    path.write_bytes(group + path.read_bytes())
    assert len(onnx.load(str(path), load_external_data=False).graph.initializer) == 1  # protobuf skips it
    assert external_data_locations(path) == expected
