"""TensorRT's weight-only path: a portable graph's MatMul weights as int4/int8 through Q/DQ nodes.

MatMulNBits (export/quantize.py) is an ONNX Runtime contrib op; TensorRT's ONNX parser
takes weight-only quantization in the standard form instead, explicit quantization:
a constant integer weight, `DequantizeLinear` with its scales, then the float `MatMul`
(TensorRT fuses the three into a weight-only quantized GEMM):

* INT4 (what TensorRT-Model-Optimizer writes for INT4-AWQ): signed int4 weights in blocks of
  `block_size` input rows along K (DequantizeLinear's `block_size`, opset 21, so TensorRT
  10.x with opset 21 support, not 10.0), symmetric: TensorRT requires zero zero-points.
  AWQ differs from this round-to-nearest form only in its numbers (scales searched on
  calibration activations, an activation pre-scale folded into the op before), not in the
  graph, so this is the layout an AWQ checkpoint would be written in.
* INT8 weight-only: per output channel (axis 1, one scale per column), symmetric, opset 17.

`specdeploy export` does not write these graphs (the portable graphs stay float: they are
the float reference of the task check and the source of float TensorRT engines), and no
TensorRT build or timing of them was run here. `weight_only_qdq` produces the graph; the
offline lint (engines/lint.py) checks TensorRT's parser would take it, ONNX Runtime runs it
(tests/test_quantized.py).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

INT4_OPSET = 21  # DequantizeLinear's block_size and the INT4 type


def _pack_int4(q: np.ndarray) -> bytes:
    """Signed int4 values, two per byte, the first in the low nibble (ONNX's INT4 layout)."""
    flat = (q.reshape(-1).astype(np.int8) & 0x0F).astype(np.uint8)
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    return (flat[0::2] | (flat[1::2] << 4)).tobytes()


def quantize_weight(w: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric round-to-nearest: (integer weights [K, N], scales: [ceil(K/block), N] for int4,
    [N] for int8)."""
    qmax = (1 << (bits - 1)) - 1
    if bits == 8:
        scale = np.abs(w).max(axis=0) / qmax
        scale[scale == 0] = 1.0
        return np.clip(np.rint(w / scale), -qmax - 1, qmax).astype(np.int8), scale.astype(np.float32)
    k, n = w.shape
    blocks = -(-k // block_size)
    padded = np.zeros((blocks * block_size, n), np.float32)
    padded[:k] = w
    scale = np.abs(padded.reshape(blocks, block_size, n)).max(axis=1) / qmax
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(padded.reshape(blocks, block_size, n) / scale[:, None]), -qmax - 1, qmax)
    return q.reshape(-1, n)[:k].astype(np.int8), scale.astype(np.float32)


def weight_only_qdq(model: onnx.ModelProto, bits: int, block_size: int = 128) -> onnx.ModelProto:
    """A copy of `model` (a portable graph, weights loaded) whose constant-weight MatMuls read
    int4/int8 weights through DequantizeLinear."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    if bits == 4:  # Reduce* and friends change between 17 and 21: convert the float graph first
        from onnx import version_converter

        model = version_converter.convert_version(model, INT4_OPSET)
        model.ir_version = max(model.ir_version, 10)  # INT4 tensors
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    nodes, done = [], set()
    for node in graph.node:
        w = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if w is None or len(w.dims) != 2 or w.data_type != TensorProto.FLOAT:
            nodes.append(node)
            continue
        name = w.name
        if name not in done:  # a weight read by several MatMuls is quantized once
            q, scale = quantize_weight(numpy_helper.to_array(w), bits, block_size)
            if bits == 4:
                graph.initializer.append(helper.make_tensor(f"{name}_q4", TensorProto.INT4, q.shape, _pack_int4(q),
                                                            raw=True))
            else:
                graph.initializer.append(numpy_helper.from_array(q, f"{name}_q8"))
            graph.initializer.append(numpy_helper.from_array(scale, f"{name}_scale"))
            done.add(name)
        attrs = {"axis": 0, "block_size": block_size} if bits == 4 else {"axis": 1}
        nodes.append(helper.make_node("DequantizeLinear", [f"{name}_q{bits}", f"{name}_scale"], [f"{name}_dq"],
                                      name=f"{node.name or name}_dq", **attrs))
        nodes.append(helper.make_node("MatMul", [node.input[0], f"{name}_dq"], list(node.output), name=node.name))
    graph.ClearField("node")
    graph.node.extend(nodes)
    used = {i for n in graph.node for i in n.input}
    kept = [t for t in graph.initializer if t.name in used]
    graph.ClearField("initializer")
    graph.initializer.extend(kept)
    return model
