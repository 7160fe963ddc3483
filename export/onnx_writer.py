"""torch module -> ONNX file whose large weights live in one shared, deduplicated file.

Every static token count T is its own graph record, but all graphs of a model hold the
same weights; storing them once keeps an export's disk size ~1x the model. A decoder is
traced with its token count as a dynamic dimension (`decoder_dynamic_axes`), so the
graph written for each T is the same file content: the runtime opens it once per model
(runtime/backends/sessions.py) and TensorRT builds one engine with a profile per T
(engines/builder.py), the weights once either way.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import warnings
from pathlib import Path

import onnx
import torch
from onnx import numpy_helper

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
