"""The offline TensorRT lint (engines/lint.py) on hand-built ONNX graphs: each unsupported op named
with its reason and the TensorRT versions it fails on; the support matrix names its source."""

from __future__ import annotations

import json

import onnx
from onnx import TensorProto as TP
from onnx import helper as oh

from specdeploy.engines import lint


def _planted_model(path):
    """A graph with ops TensorRT's parser rejects, next to ops it takes."""
    nodes = [
        oh.make_node("Relu", ["x"], ["r"], name="fine_relu"),
        oh.make_node("FancyGelu", ["r"], ["g"], name="plugin_op", domain="com.acme"),
        oh.make_node("Unique", ["x"], ["u"], name="unique_op"),
        oh.make_node("MatMul", ["a", "b"], ["c"], name="int_matmul"),
        oh.make_node("Slice", ["x", "st", "en", "axes_in"], ["s"], name="dynamic_axes_slice"),
    ]
    graph = oh.make_graph(
        nodes, "planted",
        [oh.make_tensor_value_info("x", TP.FLOAT, [4]), oh.make_tensor_value_info("a", TP.INT32, [2, 2]),
         oh.make_tensor_value_info("b", TP.INT32, [2, 2]), oh.make_tensor_value_info("axes_in", TP.INT64, [1])],
        [oh.make_tensor_value_info(n, t, None) for n, t in (("g", TP.FLOAT), ("u", TP.FLOAT), ("c", TP.INT32),
                                                             ("s", TP.FLOAT))],
        initializer=[oh.make_tensor("st", TP.INT64, [1], [0]), oh.make_tensor("en", TP.INT64, [1], [2])])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("com.acme", 1)])
    onnx.save(model, str(path))
    return path


def test_lint_names_each_planted_unsupported_op(tmp_path, capsys):
    path = _planted_model(tmp_path / "planted.onnx")
    findings, nodes = lint.lint_file(path)
    by_node = {f.node: f for f in findings}
    assert nodes == 5
    assert set(by_node) == {"plugin_op", "unique_op", "int_matmul", "dynamic_axes_slice"}
    assert "com.acme" in by_node["plugin_op"].reason
    assert "not supported" in by_node["unique_op"].reason
    assert "INT32" in by_node["int_matmul"].reason
    # Slice axes must be an initializer in TensorRT 10.0; the 10.15 matrix dropped that restriction.
    assert by_node["dynamic_axes_slice"].versions == ("10.0",)
    assert lint.cli_report(path) == 4
    out = capsys.readouterr().out
    assert out.startswith("FAIL trt-lint planted: 4 unsupported")
    for name in ("plugin_op", "unique_op", "int_matmul", "dynamic_axes_slice"):
        assert f"'{name}'" in out


def test_lint_rejects_op_missing_from_matrix_and_bad_opset(tmp_path):
    node = oh.make_node("NotAnOnnxOp", ["x"], ["y"], name="mystery")
    graph = oh.make_graph([node], "g", [oh.make_tensor_value_info("x", TP.FLOAT, [1])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, [1])])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 8)])
    findings, _ = lint.lint_model(model, "g")
    reasons = {f.node: f.reason for f in findings}
    assert "not in the TensorRT operator matrix" in reasons["mystery"]
    assert "opset 8" in reasons["(model)"]


def test_support_matrix_names_its_source():
    data = json.loads(lint.SUPPORT_FILE.read_text())
    assert "onnx/onnx-tensorrt" in data["source"]["repository"] and "operators.md" in data["source"]["file"]
    m = lint.SupportMatrix.load()
    assert m.entry("RMSNormalization", "10.0")["supported"] is False
    assert m.entry("RMSNormalization", "10.15")["supported"] is True
    assert m.entry("RMSNormalization", "11")["supported"] is True
