"""A target or draft model on ONNX Runtime, its KV cache in host memory (runtime/kv_cache.py).

Portable graphs take the past as views of the cache buffer and return the new rows'
KV, which commit copies; fused graphs (ORT CPU only) are bound once to the cache
buffers and write the new rows in place.

The smallest T's graph opens with the decoder, any other on its first call (or by `open`,
at a service's warm-up): a generation opens only the sizes it runs. Sessions are shared (backends/sessions.py), so
the fused graph, one file content for every T, is one session per model and process.

That one fused graph also runs at T no record names: a call of n rows binds it at T = n
(any n between the smallest and largest exported T) instead of padding to the next exported
size. On a CPU a row is not free: SmolLM2-135M's T=4/9/15/64 calls cost 1.1/1.4/1.7/5.7x
a T=1 call, so a 3-token draft verified at T=4 rather than T=9, or a 43-token prompt
prefilled at T=43 rather than T=64, saves that difference. The bindings share output buffers.

A prompt is prefilled in calls of up to LONG_PREFILL rows on it, past the largest exported T
(the export's prefill chunk, the size TensorRT's profiles and the check's references are built
for): each call streams every weight once more, so a 540-token prompt took 576 ms in chunks of 64
and 461 ms in chunks of 256, a 116-token one 120 and 95 ms (SmolLM2-135M float32, 2 threads). Such
a call scores its last row only and gets a binding of its own T for that call: a prompt's
remainder may take any T, so none is kept. Rows come out bit-identical to chunks of 64 (float32,
int8 and int4 exports: KV and logits compared), so the chunking changes no output.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ..decoder import Decoder, StaticCall, StepOutput
from ..errors import SpecDeployError
from ..graph_contract import (
    FEATURES,
    FUSED,
    HIDDEN,
    LOGIT_ROWS,
    LOGITS,
    PAST_LENGTH,
    PORTABLE,
    parse_kv_name,
    present_names,
)
from ..kv_cache import KVCache
from ..manifest import Manifest
from .ort import InPlaceGraph, OrtGraph, open_decoder_session
from .sessions import graph_identity

log = logging.getLogger("specdeploy.runtime")
_PADDED_ONE_ROW_CALLS: set[str] = set()  # graphs whose one-row calls this process pads (warned once)
# Call sizes a decoding step uses (verify rows, a draft's catch-up), run once per session by
# `warm_call_sizes`; larger ones are prefill chunks, outside any timed step.
WARM_SIZES = 16
# Rows per prefill call on a fused dynamic-T graph (module docstring): 512 was no faster on a 1,100-token
# prompt, and a call is also how often a prefill can be cancelled.
LONG_PREFILL = 256
_WARMED: set[str] = set()  # graphs (sessions: shared per process) whose small call sizes have run
LONE_ROW_PROBES = 8  # token ids a load-time probe scores alone and among others (_lone_rows_exact)
_LONE_ROWS_EXACT: dict[str, bool] = {}  # graph -> its probe's verdict on this machine


class OnFirstUse(dict):
    """A dict whose missing keys are made by `make(key)` when first read."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, key):
        value = self[key] = self.make(key)
        return value


class OrtDecoder(Decoder):
    def __init__(self, manifest: Manifest, model: str, backend: str = "ort-cpu", threads: int | None = None,
                 fused: bool = False):
        flavor = FUSED if fused else PORTABLE
        self.records = manifest.decoder_graphs(model, flavor)
        if not self.records:
            raise SpecDeployError(f"export has no {'fused ' if fused else ''}decoder graphs for model '{model}'")
        record = manifest.models[model]
        cache = KVCache(record, manifest.max_context, manifest.dtype, in_place=fused)
        super().__init__(record, cache, self.records, manifest.max_context)
        self.flavor = flavor
        if fused:  # a quantized or --exact-rows target's attentions carry a padding row (export/attention_pad.py)
            self.spare = manifest.attention_pad(model)
        self.presents = present_names(record.num_layers)
        self.manifest, self.backend, self.threads = manifest, backend, threads
        self.vocab_size = record.vocab_size
        self._unpadded: Path | None = None  # the graph every record runs instead (_without_attention_padding)
        self.graphs: dict[int, InPlaceGraph | OrtGraph] = OnFirstUse(self._open)
        # fused graphs with a logit_rows input: a second binding per T that scores the last row only
        self._last_row: dict[int, InPlaceGraph] = OnFirstUse(self._open_last_row)
        self._output_rows: dict[str, np.ndarray] = {}  # fused: the bindings' shared outputs
        self._long_bindings: dict[int, InPlaceGraph] = {}  # a long prefill chunk's (forward)
        if fused:  # a static T's inputs are its graph's bound arrays (filled in place)
            self.inputs: dict = OnFirstUse(lambda t: StaticCall(t, self.graphs[t].inputs))
        padded = manifest.graph_path(self.records[self.sizes[0]])
        unpadded = manifest.unpadded_graph_path(model) if fused and self.spare else None
        if unpadded is not None and _LONE_ROWS_EXACT.get(str(padded)) is False:  # probed by an earlier decoder
            self._unpadded, self.spare = unpadded, 0
        # Every generation decodes with the smallest graph: open it now, not inside a timed step.
        # With a dynamic-T export that is the model's one session; other T only add a binding.
        first = self.graphs[self.sizes[0]]
        if fused and self._one_graph(first):
            self.call_sizes = list(range(self.sizes[0], self.sizes[-1] + 1))
            if LOGIT_ROWS in first.inputs:
                self.long_rows = max(self.sizes[-1], min(LONG_PREFILL, manifest.max_context - 1))
        if self._unpadded is not None or (self.spare and self.call_sizes[0] == 1 and len(self.call_sizes) > 1
                                          and self.room >= 2 and not self._lone_rows_exact()):
            # The export measured its kernels row-exact on another CPU (export/quantize.py,
            # ROW_EXACT_BLOCK); here a one-row call would drift from `ar`'s rows: give it a padding row.
            self.call_sizes = [t for t in self.call_sizes if t > 1]
            if unpadded is not None and self._unpadded is None:
                self._without_attention_padding(unpadded)
            if str(padded) not in _PADDED_ONE_ROW_CALLS:  # once per graph and process, not per pool instance
                _PADDED_ONE_ROW_CALLS.add(str(padded))
                log.warning("%s: this CPU's ONNX Runtime scores a lone row differently from a row among others; "
                            "one-row calls take a padding row (still exact; on an int4 SmolLM2 with AVX2 it cost "
                            "16%% of decoding, of which the export's graph without attention padding, where it "
                            "has one, wins back 1-12%%; an int8 export has no such cost there)", self.what)

    def _without_attention_padding(self, unpadded: Path) -> None:
        """Every call now has two rows or more, so the attentions' padding rows (export/attention_pad.py) only
        cost time: decode with the export's unpadded graph instead (SmolLM2 int4 on an AVX2 CPU, calls of
        2 / 8 rows: 14.9 / 31.7 ms padded, 13.7 / 28.9 unpadded; `ar` 1-12% faster). Its rows differ from the
        padded graph's by ulps (measured at 2 and 8 rows), but every call of this decoder runs it,
        and from two rows up its rows are the same at any call size, as the padded graph's are. The padded
        graph's bindings are dropped (its session freed unless another decoder of the process holds it);
        later decoders of the process open the unpadded graph first (the probe's verdict is kept)."""
        self._unpadded, self.spare = unpadded, 0
        for opened in (self.graphs, self._last_row, self._output_rows, self.inputs):
            opened.clear()
        assert self._one_graph(self.graphs[self.call_sizes[0]])  # the one dynamic-T content

    def warm_call_sizes(self) -> None:
        """Run each small call size once, on an empty cache (once per graph and process: the session
        is shared). ONNX Runtime plans a shape's memory on its first run: on a fresh SmolLM2 export a
        first verify of 4 rows took 2x a warm one, and such steps, timed inside a request, set the
        adaptive policy's estimate of a drafting step high enough to keep a winning method plain."""
        if not self.fused:
            return
        path = str(self._graph_path(self.records[self.sizes[0]]))
        if path in _WARMED:
            return
        _WARMED.add(path)
        self._scratch_calls([np.arange(1, t + 1) for t in self.call_sizes if t <= min(WARM_SIZES, self.room)])

    def _lone_rows_exact(self) -> bool:
        """Whether a one-row call scores its row bit-identically to a two-row call on this machine
        (what keeps a quantized target's methods equal to its `ar`): LONE_ROW_PROBES tokens spread over
        the vocabulary, each alone and before another, on an empty cache; once per graph and process.
        Whether a row's sums come out the same depends on its values: on one CPU the micro family's int4
        target (block 128) scored 23 of the first 40 token ids differently alone, token 1 among the 17
        that matched, and a probe of token 1 alone let one-row calls drift from `ar`."""
        path = str(self.manifest.graph_path(self.records[self.sizes[0]]))
        if path not in _LONE_ROWS_EXACT:
            vocab = self.vocab_size
            tokens = np.linspace(1, vocab - 1, LONE_ROW_PROBES).astype(np.int64)
            rows = self._scratch_calls([ids for t in tokens for ids in ([t], [t, (t * 7 + 3) % vocab])])
            _LONE_ROWS_EXACT[path] = all(np.array_equal(alone, paired) for alone, paired in zip(rows[::2], rows[1::2]))
        return _LONE_ROWS_EXACT[path]

    def _scratch_calls(self, calls: list) -> list[np.ndarray]:
        """One call of each token array on an empty cache, then an empty cache and no calls counted:
        load-time checks and warm-up, never a request's. Each call's first row of logits, copied (a
        fused graph's outputs are its binding's buffers, which the next call of its size overwrites)."""
        rows = []
        for ids in calls:
            n = len(ids)
            out = self.forward(np.asarray(ids, dtype=np.int64), np.arange(n), np.tril(np.ones((n, n), dtype=bool)))
            rows.append(out.logits[0].copy())
        self.reset()
        self.calls, self.seconds = 0, 0.0
        return rows

    def _graph_path(self, record) -> Path:
        return self._unpadded or self.manifest.graph_path(record)

    def _one_graph(self, graph) -> bool:
        """Whether every record of this model is the one dynamic-T graph (one session)."""
        if not (isinstance(graph, InPlaceGraph) and graph.any_tokens):
            return False
        paths = [self._graph_path(r) for r in self.records.values()]
        return len({graph_identity(p) for p in paths}) == 1

    def _open(self, t: int):
        if t not in self.records and t not in self.call_sizes:
            raise SpecDeployError(f"no {self.what} graph for T={t} (exported sizes: {self.sizes})")
        record = self.records.get(t)
        if record is None:  # a T of the one dynamic-T graph: its session, not looked up again
            first = self._first_fused()
            path, session = first.path, first.session
        else:
            path = self._graph_path(record)
            # held: the graph below reuses it; checked against the manifest first (a stale or edited one)
            session = open_decoder_session(self.manifest, record, "ort-cpu" if self.fused else self.backend,
                                           self.threads, path=path)
        if self.fused:
            if not self._output_rows:  # sized for the largest T: every binding writes a prefix
                self._output_rows = {name: np.zeros((1, self.sizes[-1], *shape[2:]), dtype)
                                     for name, (shape, dtype) in _output_shapes(session).items()}
            return InPlaceGraph(path, self.threads, self.cache.buffers(), tokens=t, output_rows=self._output_rows,
                                session=session)
        return OrtGraph(path, self.backend, self.threads)

    def _first_fused(self) -> InPlaceGraph:
        graph = self.graphs[self.sizes[0]]
        assert isinstance(graph, InPlaceGraph)  # a T no record names: the one dynamic-T fused graph's
        return graph

    def _open_last_row(self, t: int) -> InPlaceGraph:
        full = self.graphs[t]
        assert isinstance(full, InPlaceGraph)
        return InPlaceGraph(full.path, self.threads, self.cache.buffers(), tokens=t, output_rows=self._output_rows,
                            logit_rows=1, shared_inputs=full.inputs, session=full.session)

    def open(self, sizes=None) -> None:
        """Open the graphs of `sizes` (default: every exported size) now rather than on first use."""
        for t in self.sizes if sizes is None else sizes:
            self.graphs[t]

    @property
    def opened(self) -> list[int]:
        """The static T whose graphs this decoder has opened."""
        return sorted(self.graphs)

    def forward(self, tokens: np.ndarray, positions: np.ndarray, mask: np.ndarray,
                last_logits: bool = False) -> StepOutput:
        n = len(tokens)
        if not (last_logits and self.sizes[-1] < n <= self.long_rows):
            return super().forward(tokens, positions, mask, last_logits)
        # a long prefill call (module docstring): a last-row binding at T = n, kept for a whole chunk's
        # T, made for this call alone at a remainder's (a binding costs ~1 ms)
        self._check_room(n)
        first = self._first_fused()
        graph = self._long_bindings.get(n) or InPlaceGraph(
            first.path, self.threads, self.cache.buffers(), tokens=n, output_rows=self._output_rows, logit_rows=1,
            session=first.session)
        if n == self.long_rows:
            self._long_bindings[n] = graph
        feeds = StaticCall(n, graph.inputs).fill(tokens, positions, mask, self.cache.length)
        return self._timed(self._call, graph, feeds, n)

    def _run(self, t: int, feeds: dict[str, np.ndarray], n: int) -> StepOutput:
        return self._call(self.graphs[t], feeds, n)

    def _run_last_logits(self, t: int, feeds: dict[str, np.ndarray], n: int) -> StepOutput:
        graph = self.graphs[t]
        if n == t and isinstance(graph, InPlaceGraph) and LOGIT_ROWS in graph.inputs:
            return self._call(self._last_row[t], feeds, n)
        return self._call(graph, feeds, n)  # padded rows follow the last real one, or no such input

    def _call(self, graph: InPlaceGraph | OrtGraph, feeds: dict[str, np.ndarray], n: int) -> StepOutput:
        if isinstance(graph, InPlaceGraph):  # fused: KV and small inputs are bound once
            feeds[PAST_LENGTH][0] = self.cache.length
            # The outputs are the graph's bound arrays, reused next call: copy the real rows
            # (the logits of a last-row binding are its one row).
            out = {k: v[0, :n].copy() for k, v in graph.run().items()}
            return StepOutput(out[LOGITS], out[HIDDEN], [], out.get(FEATURES))
        out = graph.run({**feeds, **self.cache.past_feeds()})
        return StepOutput(out[LOGITS][0, :n], out[HIDDEN][0, :n], [out[name] for name in self.presents],
                          out[FEATURES][0, :n] if FEATURES in out else None)

    def commit(self, step: StepOutput, rows) -> None:
        self.cache.commit(step.presents, rows)


def _output_shapes(session) -> dict[str, tuple[list, type]]:
    """A fused graph's non-KV outputs: name -> (shape, numpy dtype)."""
    types = {"tensor(float)": np.float32, "tensor(int64)": np.int64}
    return {o.name: (o.shape, types[o.type]) for o in session.get_outputs()
            if parse_kv_name(o.name) is None and o.type in types}
