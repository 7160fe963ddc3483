"""torch module -> ONNX file whose large weights live in one shared, deduplicated file.

Every static token count T is its own graph record, but all graphs of a model hold the
same weights; storing them once keeps an export's disk size ~1x the model. A decoder is
traced with its token count as a dynamic dimension (`decoder_dynamic_axes`), so the
graph written for each T is the same file content: the runtime opens it once per model
(runtime/backends/sessions.py) and TensorRT builds one engine with a profile per T
(engines/builder.py), the weights once either way.

A model with tied word embeddings reads one matrix twice: the embedding Gather takes it as
[vocab, hidden], the LM head MatMul as [hidden, vocab]. The exporters write both layouts (the
TorchScript exporter folds the transpose into a second constant, the fused graph builder
writes the MatMul's own layout); `SharedWeights` stores the MatMul's weight as a Transpose of
the table's bytes (`store_tied_tables_once`), so the payload is one on disk. At session load
ONNX Runtime folds that Transpose back into the very [hidden, vocab] constant and prepacks it
as before (the logits are bit-identical, and the table stays memory-mapped, its rows read on
demand); TensorRT folds it at build time.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from ..runtime.graph_contract import TOKENS_DIM, TREE_MASK, is_past

INLINE_LIMIT = 1024  # bytes: small constants stay inside the graph
ALIGN = 64


class SharedWeights:
    """Appends tensors to one external-data file, each distinct payload once."""

    def __init__(self, root: Path, rel_path: str):
        self.root, self.rel_path = root, rel_path
        self.path = root / rel_path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_bytes(b"")
        self.offsets: dict[str, tuple[int, int]] = {}

    def externalize(self, model: onnx.ModelProto, graph_file: Path) -> None:
        store_tied_tables_once(model.graph)
        location = os.path.relpath(self.path, graph_file.parent)
        with open(self.path, "ab") as out:
            for tensor in model.graph.initializer:
                payload = numpy_helper.to_array(tensor).tobytes()
                if len(payload) < INLINE_LIMIT:
                    continue
                key = hashlib.sha256(payload).hexdigest() + str(tensor.data_type)
                if key not in self.offsets:
                    pad = (-out.tell()) % ALIGN
                    out.write(b"\0" * pad)
                    self.offsets[key] = (out.tell(), len(payload))
                    out.write(payload)
                offset, length = self.offsets[key]
                tensor.ClearField("raw_data")
                for fld in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                    tensor.ClearField(fld)
                tensor.data_location = onnx.TensorProto.EXTERNAL
                del tensor.external_data[:]
                for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
                    entry = tensor.external_data.add()
                    entry.key, entry.value = k, v


def store_tied_tables_once(graph: onnx.GraphProto) -> list[str]:
    """Rewrite each MatMul weight (an initializer) that equals an embedding Gather's table
    transposed as a Transpose of an initializer holding the table's layout: the same bytes
    as the table, so SharedWeights writes them once. Returns the rewritten weights' names.

    The initializer stays separate from the table (not the table itself): ONNX Runtime maps
    each external initializer on its own, and the one folded into the prepacked MatMul is
    released after load, while the table's mapping is read only at the rows gathered. (One
    initializer for both measured ~110 MiB more resident on SmolLM2: prepacking reads it all.)"""
    inits = {t.name: t for t in graph.initializer}
    tables: dict[tuple, list[onnx.TensorProto]] = {}
    for node in graph.node:
        table = inits.get(node.input[0]) if node.op_type == "Gather" and node.input else None
        if table is not None and len(table.dims) == 2 and _axis(node) == 0:
            tables.setdefault((tuple(table.dims), table.data_type), []).append(table)
    if not tables:
        return []
    table_names = {t.name for group in tables.values() for t in group}
    transposed: dict[str, bytes] = {}
    for node in graph.node:
        weight = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if weight is None or len(weight.dims) != 2 or weight.name in table_names or weight.name in transposed:
            continue
        for table in tables.get(((weight.dims[1], weight.dims[0]), weight.data_type), []):
            payload = _payload(table)
            if _is_transpose(_view(_payload(weight), weight), _view(payload, table)):
                transposed[weight.name] = payload
                break
    for name, payload in transposed.items():  # in place: the graph's other tensors are not copied
        weight = inits[name]
        weight.ClearField("float_data")
        weight.name, weight.raw_data = f"{name}.transposed", payload
        weight.dims[:] = list(reversed(weight.dims))
    # every consumer of a rewritten weight now reads the Transpose's output, of the same name
    for name in transposed:
        graph.node.insert(0, helper.make_node("Transpose", [f"{name}.transposed"], [name], perm=[1, 0],
                                              name=f"{name}.transpose"))
    return list(transposed)


def _payload(tensor: onnx.TensorProto) -> bytes:
    """A loaded tensor's bytes (each read of raw_data copies them: read once)."""
    return tensor.raw_data or numpy_helper.to_array(tensor).tobytes()


def _view(payload: bytes, tensor: onnx.TensorProto) -> np.ndarray:
    return np.frombuffer(payload, helper.tensor_dtype_to_np_dtype(tensor.data_type)).reshape(tensor.dims)


def _is_transpose(a: np.ndarray, b: np.ndarray, block: int = 1024) -> bool:
    """a == b.T, compared a block of b's rows at a time (5x faster than one strided pass)."""
    return all(np.array_equal(a[:, i : i + block], b[i : i + block].T) for i in range(0, b.shape[0], block))


def _axis(node: onnx.NodeProto) -> int:
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)


def decoder_dynamic_axes(input_names, output_names) -> dict[str, dict[int, str]]:
    """A decoder graph's dynamic axes: the past length P of past_* inputs ([1, P, kv, D]) and
    the token count T of everything else ([1, T, ...]; tree_mask [1, T, T])."""
    axes = {}
    for name in input_names:
        axes[name] = {1: "past_len"} if is_past(name) else {1: TOKENS_DIM}
    axes[TREE_MASK] = {1: TOKENS_DIM, 2: TOKENS_DIM}
    axes.update((name, {1: TOKENS_DIM}) for name in output_names)
    return axes


def export_module(module, args, graph_file: Path, input_names, output_names, dynamic_axes,
                  weights: SharedWeights, opset: int = 17) -> None:
    """Trace `module` with the TorchScript exporter (`dynamic_axes` as torch.onnx takes them) and write it."""
    graph_file.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_file = Path(tmp) / "graph.onnx"
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                module, tuple(args), str(tmp_file), input_names=input_names, output_names=output_names,
                dynamic_axes=dynamic_axes, opset_version=opset, dynamo=False, do_constant_folding=True,
            )
        model = onnx.load(str(tmp_file), load_external_data=True)
    weights.externalize(model, graph_file)
    onnx.save(model, str(graph_file))
