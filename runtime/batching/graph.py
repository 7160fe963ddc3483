"""The batched target graph (the manifest's fused_batched record: export/batched_graph.py) and
its calls: plain decode steps of many rows, speculative steps and prefill chunks in one call.

A call's tokens are laid out flat, input_ids / position_ids [1, N]:

* first D decode rows, one token each (past_length [D]): one GroupQueryAttention over their
  slots' buffers bound as one [D, kv_heads, S, D] view (decode part);
* then up to SEGMENTS runs of tokens (`segments` [R, 3]: first token, end, past length), each
  one row of any T with its own tree (tree_mask [N, N], the run's diagonal block) and its own
  [1, kv_heads, S, D] buffers: a GroupQueryAttention of batch 1 per run, the batch-1 graph's
  very call for that row. ONNX Runtime's CPU GroupQueryAttention refuses batch > 1 at T > 1
  with a past ("batch_size must be 1 when sequence_length > 1 and past context is given"), so
  rows of several tokens each take a run of their own; every linear layer, where the weights
  are read, runs once over all N tokens (ORT's MatMul computes a row the same for any N).

The graph writes each row's new KV at its own past length, in place. A run the call does not
use holds one placeholder token over a small scratch buffer; so does the decode part when no
row decodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..backends.ort import open_session
from ..errors import SpecDeployError
from ..graph_contract import (
    HIDDEN,
    INPUT_IDS,
    LOGITS,
    PAST_LENGTH,
    POSITION_IDS,
    TARGET,
    TREE_MASK,
    GraphIO,
    is_past,
    past_names,
    present_names,
    present_of,
)
from ..manifest import Manifest

# The graph's RoPE table and the slots' buffers hold max_context + 1 rows: the last one is where
# rows that sit in a call's slot range without taking part write their one token (kv_slots.TRASH).
EXTRA_ROWS = 1
SEGMENTS = "segments"  # input [R, 3] int64: each run's first token, end and past length
# Runs of several tokens one call takes (exported; the graph's inputs say how many). Each unused
# run costs a placeholder's nodes in every call (SmolLM2, 2 threads: a 1-row decode call took
# 36.8 ms of CPU with 4 runs against 28.1 for the batch-1 graph), so few.
RUNS = 2


def run_kv_name(run: int, name: str) -> str:
    """The name of a run's KV buffer input or output (`name`: past_key.3, present_value.0, ...)."""
    return f"run{run}.{name}"


def batched_io(num_layers: int, runs: int) -> GraphIO:
    inputs = [INPUT_IDS, POSITION_IDS, TREE_MASK, PAST_LENGTH, SEGMENTS, *past_names(num_layers)]
    outputs = [LOGITS, HIDDEN, *present_names(num_layers)]
    for r in range(runs):
        inputs += [run_kv_name(r, n) for n in past_names(num_layers)]
        outputs += [run_kv_name(r, n) for n in present_names(num_layers)]
    return GraphIO(tuple(inputs), tuple(outputs))


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


@dataclass
class Run:
    """One row of several tokens in a call (a speculative step or a prefill chunk)."""

    ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    mask: np.ndarray  # [T, T]
    past: int
    kv: dict[str, np.ndarray]  # past_* name -> the row's [1, kv_heads, S, D] buffer view


class BatchedGraph:
    def __init__(self, manifest: Manifest, threads: int | None = None):
        import onnxruntime as ort

        self._ort = ort
        self.session = open_session(batched_graph_path(manifest), "ort-cpu", threads)
        inputs = {i.name: i.shape for i in self.session.get_inputs()}
        outputs = {o.name: o.shape for o in self.session.get_outputs()}
        if SEGMENTS not in inputs:
            raise SpecDeployError(f"{manifest.root} holds a batched target graph from an older specdeploy (one "
                                  "row per call at T > 1): replace it with "
                                  f"`python -m specdeploy.export.batched_graph {manifest.root}`")
        self.vocab, self.hidden = int(outputs[LOGITS][2]), int(outputs[HIDDEN][2])
        self.runs = int(inputs[SEGMENTS][0])
        self.kv_names = [n for n in inputs if is_past(n)]
        _, heads, _, dim = inputs[self.kv_names[0]]
        # where an unused run (and the decode part with no row decoding) writes its placeholder token
        self._scratch = [{n: np.zeros((1, heads, 2, dim), np.float32) for n in self.kv_names}
                         for _ in range(self.runs + 1)]

    def run(self, decode: list[tuple[int, int, int]], decode_kv: dict[str, np.ndarray] | None,
            runs: list[Run]) -> tuple[np.ndarray, np.ndarray]:
        """(logits [N, vocab], hidden [N, hidden]) of one call, tokens in order: the decode rows'
        (token, position, past) over `decode_kv` ([D, kv_heads, S, D] views by past_* name; with
        none, its placeholder row is left out), then each run's; KV written in place."""
        if len(runs) > self.runs:
            raise ValueError(f"{len(runs)} runs in one call; the graph takes {self.runs}")
        ort = self._ort
        first = 0 if decode else 1  # with no decode rows, the decode part takes a placeholder row
        if not decode:
            decode, decode_kv = [(0, 0, 0)], self._scratch[-1]
        assert decode_kv is not None
        used = [*runs, *(Run(np.zeros(1, np.int64), np.zeros(1, np.int64), np.ones((1, 1), bool), 0,
                             self._scratch[r]) for r in range(len(runs), self.runs))]
        d = len(decode)
        n = d + sum(len(r.ids) for r in used)
        ids = np.empty((1, n), np.int64)
        positions = np.empty((1, n), np.int64)
        mask = np.zeros((n, n), bool)
        segments = np.empty((self.runs, 3), np.int64)
        ids[0, :d], positions[0, :d], past = (np.array(c, np.int64) for c in zip(*decode))
        at = d
        for r, run in enumerate(used):
            end = at + len(run.ids)
            ids[0, at:end], positions[0, at:end] = run.ids, run.positions
            mask[at:end, at:end] = run.mask
            segments[r] = at, end, run.past
            at = end
        io = self.session.io_binding()
        for name, value in ((INPUT_IDS, ids), (POSITION_IDS, positions), (TREE_MASK, mask), (PAST_LENGTH, past),
                            (SEGMENTS, segments)):
            io.bind_cpu_input(name, value)
        keep = []  # OrtValues must outlive the run
        for prefix, kv in ((None, decode_kv), *((r, run.kv) for r, run in enumerate(used))):
            for name, buf in kv.items():
                value = ort.OrtValue.ortvalue_from_numpy(buf)  # shares the slots' memory
                keep.append(value)
                io.bind_ortvalue_input(name if prefix is None else run_kv_name(prefix, name), value)
                present = present_of(name)
                io.bind_ortvalue_output(present if prefix is None else run_kv_name(prefix, present), value)
        logits = np.empty((1, n, self.vocab), np.float32)
        hidden = np.empty((1, n, self.hidden), np.float32)
        for name, array in ((LOGITS, logits), (HIDDEN, hidden)):
            value = ort.OrtValue.ortvalue_from_numpy(array)
            keep.append(value)
            io.bind_ortvalue_output(name, value)
        self.session.run_with_iobinding(io)
        real = n - (self.runs - len(runs))  # without the placeholder tokens
        return logits[0, first:real], hidden[0, first:real]
