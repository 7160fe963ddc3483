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


def files_by_content(paths) -> list[list[Path]]:
    """Graph files grouped by identical bytes, in first-seen order: a model's static-T graphs are
    one content (module docstring), so a rewrite (quantization, padding) runs once per group."""
    groups: dict[str, list[Path]] = {}
    for path in paths:
        groups.setdefault(hashlib.sha256(Path(path).read_bytes()).hexdigest(), []).append(Path(path))
    return list(groups.values())


class SharedWeights:
    """Appends tensors to one external-data file, each distinct payload once.

    `reuse`: other models' weight files written earlier in this export and never rewritten after
    (portable files; a fused file whose model is not quantized). A payload one of them already
    holds is referenced there instead of written again: a self-draft's portable graphs are the
    target's weights (0.65 GB on SmolLM2), the batched graph is the fused target's but for its
    RoPE tables, an EAGLE head's embedding is the target's. The file is created by the first
    payload it takes: one whose every payload lives elsewhere leaves none."""

    def __init__(self, root: Path, rel_path: str, reuse: tuple[SharedWeights, ...] = ()):
        self.root, self.rel_path = root, rel_path
        self.path = root / rel_path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)  # a rewrite (quantization) starts from nothing
        self.offsets: dict[str, tuple[int, int]] = {}
        self.reuse = tuple(reuse)

    @classmethod
    def written(cls, graph_files) -> tuple[SharedWeights, ...]:
        """Indexes of the weight files the graphs in `graph_files` read, as written, to be reused
        (nothing is appended to them)."""
        indexes: dict[Path, SharedWeights] = {}
        seen: set[tuple[Path, int]] = set()  # every static T's graph reads the same payloads
        for graph_file in graph_files:
            for tensor in onnx.load(str(graph_file), load_external_data=False).graph.initializer:
                if tensor.data_location != onnx.TensorProto.EXTERNAL:
                    continue
                entry = {e.key: e.value for e in tensor.external_data}
                # absolute, symlinks kept: externalize writes it relative to a graph's dir as given
                path = Path(os.path.abspath(Path(graph_file).parent / entry["location"]))
                index = indexes.get(path)
                if index is None:
                    index = indexes[path] = cls.__new__(cls)
                    index.root, index.rel_path, index.path, index.offsets, index.reuse = None, None, path, {}, ()
                offset, length = int(entry.get("offset", 0)), int(entry["length"])
                if (path, offset) in seen:
                    continue
                seen.add((path, offset))
                with open(path, "rb") as f:
                    f.seek(offset)
                    index.offsets[hashlib.sha256(f.read(length)).hexdigest() + str(tensor.data_type)] = (offset, length)
        return tuple(indexes.values())

    def holder(self, key: str) -> SharedWeights | None:
        """The file that already holds the payload `key`: this one first, then those it reuses (and theirs)."""
        if key in self.offsets:
            return self
        return next((h for w in self.reuse if (h := w.holder(key)) is not None), None)

    def _append(self, key: str, payload: bytes) -> None:
        with open(self.path, "ab") as out:
            out.write(b"\0" * ((-out.tell()) % ALIGN))
            self.offsets[key] = (out.tell(), len(payload))
            out.write(payload)

    def externalize(self, model: onnx.ModelProto, graph_file: Path) -> None:
        for tensor in model.graph.initializer:
            payload = numpy_helper.to_array(tensor).tobytes()
            if len(payload) < INLINE_LIMIT:
                continue
            key = hashlib.sha256(payload).hexdigest() + str(tensor.data_type)
            holder = self.holder(key)
            if holder is None:
                holder = self
                self._append(key, payload)
            offset, length = holder.offsets[key]
            tensor.ClearField("raw_data")
            for fld in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                tensor.ClearField(fld)
            tensor.data_location = onnx.TensorProto.EXTERNAL
            del tensor.external_data[:]
            location = os.path.relpath(holder.path, graph_file.parent)
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
