"""The batched target graph (the manifest's fused_batched record: export/batched_graph.py) and
its calls: plain decode steps of many rows, speculative steps and prefill chunks in one call.

A call's N tokens are laid out flat, input_ids / position_ids [1, N]: first the decoding
rows' tokens, one each, then each run's. Attention comes in parts:

* the decode part: D rows of one token (past_length [D]) over their slots' buffers bound as
  one [D, kv_heads, S, D] view, one GroupQueryAttention of batch D; `decode_tokens` [D] says
  which of the call's tokens each row reads;
* then SEGMENTS runs (`segments` [R, 3]: first token, end, past length), each one row of any
  T with its own tree (tree_mask [N, N], the run's diagonal block) and its own
  [1, kv_heads, S, D] buffers: a GroupQueryAttention of batch 1 per run, the batch-1 graph's
  very call for that row. ONNX Runtime's CPU GroupQueryAttention refuses batch > 1 at T > 1
  with a past ("batch_size must be 1 when sequence_length > 1 and past context is given"), so
  rows of several tokens each take a run of their own;
* `context_rows` [N]: each token's row among the parts' outputs (decode part, then each run);
* `logit_tokens` [M]: the call's tokens that get logits (logits [1, M, vocab]): every decode
  row's and speculative run's, a prefill chunk's last (the LM head, 49152 x 576 on SmolLM2, is
  ~20% of a token's work, and the target reads no logits of its prompt). Graphs exported
  before it score every token (the runtime then picks the rows);
* `lone_row` [1]: the call is one row's tokens (a decode step, a speculative step or a prefill
  chunk), laid out as run 0: the graph's If then runs the batch-1 graph's nodes for it alone
  (one attention node per layer) over the same weights, not the unused parts' attention
  nodes (export/fused_graph.build_batched_decoder); the other parts' buffers are left as bound.

Every linear layer, where the weights are read, runs once over the N tokens (ORT's MatMul
computes a row the same for any N), so each row's logits and KV are the batch-1 graph's.
The graph writes each row's new KV at its own past length, in place. A part with no row of
its own (a slot inside the decode range that takes no part, an unused run, the decode part
when no row decodes) reads one of the call's tokens and writes it to a trash row: it adds a
small attention node, never a token to the linear layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..backends.ort import open_session
from ..errors import SpecDeployError
from ..graph_contract import (
    FUSED,
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
DECODE_TOKENS = "decode_tokens"  # input [D] int64: the call token each decode-part row reads
CONTEXT_ROWS = "context_rows"  # input [N] int64: each token's row among the attention parts' outputs
LOGIT_TOKENS = "logit_tokens"  # input [M] int64: the call's tokens whose logits the graph computes
LONE_ROW = "lone_row"  # input [1] bool: the call is one row's tokens, laid out as run 0 (see below)
# Runs of several tokens one call takes (exported; the graph's inputs say how many): rows that
# speculate in one call. An unused run costs only a small attention node per layer (SmolLM2,
# 2 threads, a one-row decode call took 35.5 ms of CPU with 4 runs and 41.8 with 2: noise), while
# a run more than the call takes costs a whole further call.
RUNS = 4


def run_kv_name(run: int, name: str) -> str:
    """The name of a run's KV buffer input or output (`name`: past_key.3, present_value.0, ...)."""
    return f"run{run}.{name}"


def batched_kv_pairs(num_layers: int, runs: int) -> list[tuple[str, str]]:
    """Every KV buffer's (input, output) names: the decode part's, then each run's."""
    pairs = list(zip(past_names(num_layers), present_names(num_layers)))
    return pairs + [(run_kv_name(r, past), run_kv_name(r, present)) for r in range(runs) for past, present in pairs]


def batched_io(num_layers: int, runs: int) -> GraphIO:
    pairs = batched_kv_pairs(num_layers, runs)
    inputs = [INPUT_IDS, POSITION_IDS, TREE_MASK, PAST_LENGTH, SEGMENTS, DECODE_TOKENS, CONTEXT_ROWS,
              LOGIT_TOKENS, LONE_ROW, *(past for past, _ in pairs)]
    return GraphIO(tuple(inputs), (LOGITS, HIDDEN, *(present for _, present in pairs)))


def batched_graph_path(manifest: Manifest) -> Path:
    """The batched graph's file, as the manifest records it (checksummed and kept inside the
    export when the manifest loaded, like every graph)."""
    record = manifest.batched_graph()
    quantized = manifest.weight_scheme(TARGET)
    if record is None and quantized:
        raise SpecDeployError(f"{manifest.root} holds the target with {quantized['bits']}-bit weights and no batched "
                              "graph (it is float32, so its rows would not match this export's batch-1 output): "
                              "serve it without --batch, or export without quantizing the target")
    if record is None and manifest.exact_rows:
        raise SpecDeployError(f"{manifest.root} was exported with --exact-rows and has no batched graph (its decode "
                              "rows would run the one-row attention its batch-1 graphs pad away): serve it without "
                              "--batch, or export without --exact-rows")
    if record is None and not manifest.decoder_graphs(TARGET, FUSED):
        raise SpecDeployError(f"{manifest.root} has no fused target graphs, and the batched graph is one of them "
                              "(exported with --no-fused, or this model's ONNX Runtime CPU graphs could not be "
                              "built: the export said which): serve it without --batch, or re-export it without "
                              "--no-fused where that was the cause")
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
    logit_rows: np.ndarray | None = None  # the run's tokens (0..T-1) that need logits; None: all


class BatchedGraph:
    def __init__(self, source: Manifest | Path, threads: int | None = None):
        """The batched graph of an export (its manifest), or the graph file at a path (one built
        outside an export: train/responses.py generates a target's training data with it)."""
        import onnxruntime as ort

        self._ort = ort
        path = Path(source) if isinstance(source, (str, Path)) else batched_graph_path(source)
        self.session = open_session(path, "ort-cpu", threads)
        inputs = {i.name: i.shape for i in self.session.get_inputs()}
        outputs = {o.name: o.shape for o in self.session.get_outputs()}
        if CONTEXT_ROWS not in inputs:
            root = path.parent
            raise SpecDeployError(f"{root} holds a batched target graph from an older specdeploy (a "
                                  "placeholder token per unused part of a call): replace it with "
                                  f"`python -m specdeploy.export.batched_graph {root}`")
        self.vocab, self.hidden = int(outputs[LOGITS][2]), int(outputs[HIDDEN][2])
        self.runs = int(inputs[SEGMENTS][0])
        self.picks_logits = LOGIT_TOKENS in inputs  # else every token's logits (an older export)
        self.has_lone_row = LONE_ROW in inputs  # else a lone row's call computes every part too
        self.kv_names = [n for n in inputs if is_past(n)]
        _, heads, _, dim = inputs[self.kv_names[0]]
        # where an unused run (and the decode part with no row decoding) writes its token's KV
        self._scratch = [{n: np.zeros((1, heads, 2, dim), np.float32) for n in self.kv_names}
                         for _ in range(self.runs + 1)]
        # One binding for every call: each part's KV buffers are bound again only when they change
        # (a lone row's calls bind none; a bind is a few microseconds, and a call has 2 * layers * 5)
        self._io = self.session.io_binding()
        self._bound: list[tuple | None] = [None] * (self.runs + 1)  # per part: its buffers' identity
        self._bound_values: list[list] = [[] for _ in range(self.runs + 1)]  # their OrtValues, kept alive

    def _bind_kv(self, part: int, kv: dict[str, np.ndarray]) -> None:
        """Bind part `part`'s buffers (0: the decode part, r + 1: run r) in place, past and present
        the same memory. The buffers are known by the first one's address and shape: a part's
        views all come from one slot range, and the bound arrays stay alive until replaced, so
        another array cannot take that address meanwhile."""
        first = next(iter(kv.values()))
        key = (first.ctypes.data, first.shape, len(kv))
        if self._bound[part] == key:
            return
        values = []
        for name, buf in kv.items():
            value = self._ort.OrtValue.ortvalue_from_numpy(buf)  # shares the slots' memory
            values.append(value)
            present = present_of(name)
            if part:
                name, present = run_kv_name(part - 1, name), run_kv_name(part - 1, present)
            self._io.bind_ortvalue_input(name, value)
            self._io.bind_ortvalue_output(present, value)
        self._bound[part], self._bound_values[part] = key, values

    def run(self, decode: list[tuple[int, int, int] | int], decode_kv: dict[str, np.ndarray] | None,
            runs: list[Run]) -> tuple[np.ndarray, np.ndarray]:
        """(logits [M, vocab], hidden [N, hidden]) of one call's N tokens, in order: each decode
        row's, then each run's (logits: of its `logit_rows` only); KV written in place. `decode`:
        the rows of `decode_kv` ([D, kv_heads, S, D] views by past_* name), each (token, position,
        past), or a bare past (a trash row) for a row that takes no part; none: the decode part
        works on a scratch buffer."""
        if len(runs) > self.runs:
            raise ValueError(f"{len(runs)} runs in one call; the graph takes {self.runs}")
        if not runs and not any(isinstance(row, tuple) for row in decode):
            raise ValueError("a call needs at least one token")
        ort = self._ort
        lone = self.has_lone_row and (len(runs) == 1 and not any(isinstance(row, tuple) for row in decode)
                                      or not runs and len(decode) == 1 and isinstance(decode[0], tuple))
        if lone and not runs:  # a lone decode row: a run of one token over its own buffers
            assert decode_kv is not None and isinstance(decode[0], tuple)
            token, position, row_past = decode[0]
            runs = [Run(np.array([token]), np.array([position]), np.ones((1, 1), bool), row_past, decode_kv)]
            decode = []
        if not decode:
            decode, decode_kv = [0], self._scratch[-1]
        assert decode_kv is not None
        n = sum(isinstance(row, tuple) for row in decode) + sum(len(r.ids) for r in runs)
        ids = np.empty((1, n), np.int64)
        positions = np.empty((1, n), np.int64)
        mask = np.eye(n, dtype=bool)  # a decode token's diagonal: a borrowing unused run reads it
        segments = np.zeros((self.runs, 3), np.int64)  # unused runs: (0, 1, 0), the first token at past 0
        segments[:, 1] = 1
        past = np.zeros(len(decode), np.int64)
        decode_tokens = np.zeros(len(decode), np.int64)  # rows taking no part read token 0
        context_rows = np.empty(n, np.int64)
        logit_tokens = []
        at = 0
        for i, row in enumerate(decode):
            if isinstance(row, tuple):
                ids[0, at], positions[0, at], past[i] = row
                decode_tokens[i], context_rows[at] = at, i
                at += 1
            else:
                past[i] = row
        logit_tokens.append(np.arange(at))  # every decode row's
        rows = len(decode)  # the decode part's outputs come first, then each run's
        for r, run in enumerate(runs):
            end = at + len(run.ids)
            ids[0, at:end], positions[0, at:end] = run.ids, run.positions
            mask[at:end, at:end] = run.mask
            segments[r] = at, end, run.past
            context_rows[at:end] = np.arange(rows, rows + end - at)
            logit_tokens.append(at + (np.arange(end - at) if run.logit_rows is None else run.logit_rows))
            rows += end - at
            at = end
        picked = np.concatenate(logit_tokens).astype(np.int64)
        io = self._io
        feeds = [(INPUT_IDS, ids), (POSITION_IDS, positions), (TREE_MASK, mask), (PAST_LENGTH, past),
                 (SEGMENTS, segments), (DECODE_TOKENS, decode_tokens), (CONTEXT_ROWS, context_rows)]
        if self.picks_logits:
            feeds.append((LOGIT_TOKENS, picked))
        if self.has_lone_row:
            feeds.append((LONE_ROW, np.array([lone])))
        for name, value in feeds:
            io.bind_cpu_input(name, value)
        for part, kv in enumerate([decode_kv, *(run.kv for run in runs), *self._scratch[len(runs):self.runs]]):
            self._bind_kv(part, kv)  # unused runs: their scratch
        logits = np.empty((1, len(picked) if self.picks_logits else n, self.vocab), np.float32)
        hidden = np.empty((1, n, self.hidden), np.float32)
        keep = [ort.OrtValue.ortvalue_from_numpy(array) for array in (logits, hidden)]  # alive through the run
        io.bind_ortvalue_output(LOGITS, keep[0])
        io.bind_ortvalue_output(HIDDEN, keep[1])
        self.session.run_with_iobinding(io)
        if not self.picks_logits and len(picked) < n:
            return logits[0, picked], hidden[0]
        return logits[0], hidden[0]
