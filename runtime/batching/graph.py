"""The batched target graph (the manifest's fused_batched record: export/batched_graph.py) run
over a contiguous range of row slots.

Inputs per call: input_ids, position_ids [B, T], tree_mask [B, T, T], past_length [B]; the
KV buffers of the B slots, [B, kv_heads, S, D] views of the slot buffers (kv_slots.py), are
bound as both past and present, so the graph writes each row's new KV at its own past_length
in place.

ONNX Runtime's CPU GroupQueryAttention takes several rows only one token each ("batch_size
must be 1 when sequence_length > 1 and past context is given"), so a call is either a decode
step over many rows at T=1 or one row at any T (a prefill chunk or a speculative step).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..backends.ort import open_session
from ..errors import SpecDeployError
from ..graph_contract import HIDDEN, INPUT_IDS, LOGITS, PAST_LENGTH, POSITION_IDS, TARGET, TREE_MASK, present_of
from ..manifest import Manifest

# The graph's RoPE table and the slots' buffers hold max_context + 1 rows: the last one is where
# rows that sit in a call's slot range without taking part write their one token (kv_slots.TRASH).
EXTRA_ROWS = 1


def batched_graph_path(manifest: Manifest) -> Path:
    """The batched graph's file, as the manifest records it (checksummed and kept inside the
    export when the manifest loaded, like every graph)."""
    record = manifest.batched_graph()
    quantized = (manifest.quantization or {}).get("models", {}).get(TARGET)
    if record is None and quantized:
        raise SpecDeployError(f"{manifest.root} holds the target with {quantized['bits']}-bit weights and no batched "
                              "graph (it is float32, so its rows would not match this export's batch-1 output): "
                              "serve it without --batch, or export without quantizing the target")
    if record is None:
        raise SpecDeployError(f"{manifest.root} has no batched target graph (exported before continuous batching, "
                              "or with batched=False): re-export it, or add it with "
                              f"`python -m specdeploy.export.batched_graph {manifest.root}`")
    return manifest.graph_path(record)


class BatchedGraph:
    def __init__(self, manifest: Manifest, threads: int | None = None):
        import onnxruntime as ort

        self._ort = ort
        self.session = open_session(batched_graph_path(manifest), "ort-cpu", threads)
        outputs = {o.name: o.shape for o in self.session.get_outputs()}
        self.vocab, self.hidden = int(outputs[LOGITS][2]), int(outputs[HIDDEN][2])

    def run(self, ids: np.ndarray, positions: np.ndarray, mask: np.ndarray, past: np.ndarray,
            kv: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """(logits [B, T, vocab], hidden [B, T, hidden]) of one call; `kv` maps past_* names to
        [B, kv_heads, S, D] contiguous views, written in place."""
        ort = self._ort
        b, t = ids.shape
        io = self.session.io_binding()
        keep = []  # OrtValues must outlive the run
        for name, value in ((INPUT_IDS, ids), (POSITION_IDS, positions), (TREE_MASK, mask), (PAST_LENGTH, past)):
            io.bind_cpu_input(name, np.ascontiguousarray(value))
        for name, buf in kv.items():
            value = ort.OrtValue.ortvalue_from_numpy(buf)  # shares the slots' memory
            keep.append(value)
            io.bind_ortvalue_input(name, value)
            io.bind_ortvalue_output(present_of(name), value)
        logits = np.empty((b, t, self.vocab), np.float32)
        hidden = np.empty((b, t, self.hidden), np.float32)
        for name, array in ((LOGITS, logits), (HIDDEN, hidden)):
            value = ort.OrtValue.ortvalue_from_numpy(array)
            keep.append(value)
            io.bind_ortvalue_output(name, value)
        self.session.run_with_iobinding(io)
        return logits, hidden
