"""One padding row inside every GroupQueryAttention of a fused graph, so no call attends a single row.

ONNX Runtime's GroupQueryAttention runs another kernel for a single query row than for two
or more, and the two differ by ulps (layer 0 of SmolLM2: 6e-8). Under int8 activations
(MatMulNBits, accuracy level 4) such an ulp can flip a rounding that grows through the layers
into whole logits, and `ar` (one row a step) would then print other tokens than a method
verifying k+1 rows. From two rows up every call size gives bit-identical rows, and MatMulNBits
is row-exact across M from one row up at the default block size (not at larger blocks, whose
targets never run one-row calls: export/quantize.py, ROW_EXACT_BLOCK).

So each attention gets one more query row than the call has: a copy of the call's last row
(its q, k and v, at its position), seeing what that row sees. Its context row is dropped
right after the node; its key and value are written to the KV buffer one position past the
call's rows, which the next call overwrites before anything reads it. That costs one
attention row per call instead of a padding row through every weight matrix, and one spare
position: a call must end one row before the context end (the manifest's `attention_pad`,
which runtime/backends/ort_decoder.py turns into `Decoder.spare`). Rows of every call size
come out as in a call of two or more.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

GQA = "GroupQueryAttention"
PREFIX = "attention_pad"
# GroupQueryAttention's inputs (com.microsoft): query, key, value, past_key, past_value,
# seqlens_k, total_sequence_length, cos_cache, sin_cache, position_ids, attention_bias
ROW_INPUTS = (0, 1, 2)  # [1, T, ...]: one row per query token
SEQLENS, TOTAL, POSITIONS, BIAS = 5, 6, 9, 10


def can_pad(graph: onnx.GraphProto) -> bool:
    """Whether every attention of `graph` takes the inputs the padding rewrites (fused decoders do)."""
    nodes = [n for n in graph.node if n.op_type == GQA]
    return bool(nodes) and all(len(n.input) > BIAS and n.input[BIAS] and n.input[POSITIONS] for n in nodes)


def pad_attention(graph: onnx.GraphProto) -> bool:
    """Rewrite `graph` in place: every GroupQueryAttention over one more row (module docstring).
    False (nothing changed) where some attention lacks the position ids or bias it pads."""
    if not can_pad(graph):
        return False
    consts: dict[str, np.ndarray] = {
        "one_i32": np.array([1], np.int32), "one_scalar_i32": np.array(1, np.int32),
        "last": np.array([-1], np.int64), "end": np.array([np.iinfo(np.int64).max], np.int64),
        "zero": np.array([0], np.int64), "axis1": np.array([1], np.int64), "axis2": np.array([2], np.int64),
        "pad_col": np.array([0, 0, 0, 0, 0, 0, 0, 1], np.int64),  # Pad: one column after dim 3
        "minf": np.array(np.finfo(np.float32).min, np.float32)}
    graph.initializer.extend(numpy_helper.from_array(v, f"{PREFIX}.{k}") for k, v in consts.items())
    c = {k: f"{PREFIX}.{k}" for k in consts}
    padded: dict[str, str] = {}  # an input's name -> its padded tensor's (shared inputs padded once)
    out_nodes: list[onnx.NodeProto] = []
    count = 0

    def node(op: str, inputs: list[str], **attrs) -> str:
        nonlocal count
        count += 1
        name = f"{PREFIX}/{op}_{count}"
        out_nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        return name

    def with_last_row(x: str, axis: int) -> str:
        """x with a copy of its last row along `axis` (1 or 2) appended."""
        last = node("Slice", [x, c["last"], c["end"], c[f"axis{axis}"]])
        return node("Concat", [x, last], axis=axis)

    def once(x: str, make) -> str:
        if x not in padded:
            padded[x] = make(x)
        return padded[x]

    for gqa in list(graph.node):
        if gqa.op_type != GQA:
            out_nodes.append(gqa)
            continue
        inputs = list(gqa.input)
        for i in ROW_INPUTS:
            if inputs[i]:
                inputs[i] = with_last_row(inputs[i], 1)
        inputs[SEQLENS] = once(inputs[SEQLENS], lambda x: node("Add", [x, c["one_i32"]]))
        inputs[TOTAL] = once(inputs[TOTAL], lambda x: node("Add", [x, c["one_scalar_i32"]]))
        inputs[POSITIONS] = once(inputs[POSITIONS], lambda x: with_last_row(x, 1))
        # bias [1, 1, T, S]: a column for the padding key that no real row sees, then the padding
        # row seeing what the last real row sees
        inputs[BIAS] = once(inputs[BIAS], lambda x: with_last_row(node("Pad", [x, c["pad_col"], c["minf"]]), 2))
        context = gqa.output[0]
        wide = f"{PREFIX}/{gqa.name or 'gqa'}_{count}_context"
        out_nodes.append(helper.make_node(gqa.op_type, inputs, [wide, *gqa.output[1:]], name=gqa.name,
                                          domain=gqa.domain, **{a.name: helper.get_attribute_value(a)
                                                                for a in gqa.attribute}))
        out_nodes.append(helper.make_node("Slice", [wide, c["zero"], c["last"], c["axis1"]], [context],
                                          name=f"{wide}_rows"))
    graph.ClearField("node")
    graph.node.extend(out_nodes)
    return True
