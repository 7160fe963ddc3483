"""A target or draft model on ONNX Runtime, its KV cache in host memory (runtime/kv_cache.py).

Portable graphs take the past as views of the cache buffer and return the new rows'
KV, which commit copies; fused graphs (ORT CPU only) are bound once to the cache
buffers and write the new rows in place.

The smallest T's graph opens with the decoder, any other on its first call (or by `open`,
at a service's warm-up): a generation opens only the sizes it runs. Sessions are shared (backends/sessions.py), so
the fused graph, one file content for every T, is one session per model and process.
"""

from __future__ import annotations

import numpy as np

from ..decoder import Decoder, StaticCall, StepOutput
from ..errors import SpecDeployError
from ..graph_contract import FEATURES, FUSED, HIDDEN, LOGITS, PAST_LENGTH, PORTABLE, present_names
from ..kv_cache import KVCache
from ..manifest import Manifest
from .ort import InPlaceGraph, OrtGraph


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
        self.presents = present_names(record.num_layers)
        self.manifest, self.backend, self.threads = manifest, backend, threads
        self.graphs: dict[int, InPlaceGraph | OrtGraph] = OnFirstUse(self._open)
        if fused:  # a static T's inputs are its graph's bound arrays (filled in place)
            self.inputs = OnFirstUse(lambda t: StaticCall(t, self.graphs[t].inputs))
        # Every generation decodes with the smallest graph: open it now, not inside a timed step.
        # With a dynamic-T export that is the model's one session; other T only add a binding.
        self.graphs[self.sizes[0]]

    def _open(self, t: int):
        if t not in self.records:
            raise SpecDeployError(f"no {self.what} graph for T={t} (exported sizes: {self.sizes})")
        path = self.manifest.graph_path(self.records[t])
        if self.fused:
            return InPlaceGraph(path, self.threads, self.cache.buffers(), tokens=t)
        return OrtGraph(path, self.backend, self.threads)

    def open(self, sizes=None) -> None:
        """Open the graphs of `sizes` (default: every exported size) now rather than on first use."""
        for t in self.sizes if sizes is None else sizes:
            self.graphs[t]

    @property
    def opened(self) -> list[int]:
        """The static T whose graphs this decoder has opened."""
        return sorted(self.graphs)

    def _run(self, t: int, feeds: dict[str, np.ndarray], n: int) -> StepOutput:
        graph = self.graphs[t]
        if isinstance(graph, InPlaceGraph):  # fused: KV and small inputs are bound once
            feeds[PAST_LENGTH][0] = self.cache.length
            # The outputs are the graph's bound arrays, reused next call: copy the real rows.
            out = {k: v[0, :n].copy() for k, v in graph.run().items()}
            return StepOutput(out[LOGITS], out[HIDDEN], [], out.get(FEATURES))
        out = graph.run({**feeds, **self.cache.past_feeds()})
        return StepOutput(out[LOGITS][0, :n], out[HIDDEN][0, :n], [out[name] for name in self.presents],
                          out[FEATURES][0, :n] if FEATURES in out else None)

    def commit(self, step: StepOutput, rows) -> None:
        self.cache.commit(step.presents, rows)
