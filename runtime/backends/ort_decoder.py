"""A target or draft model on ONNX Runtime, its KV cache in host memory (runtime/kv_cache.py).

Portable graphs take the past as views of the cache buffer and return the new rows'
KV, which commit copies; fused graphs (ORT CPU only) are bound once to the cache
buffers and write the new rows in place.
"""

from __future__ import annotations

import numpy as np

from ..decoder import Decoder, StaticCall, StepOutput
from ..errors import SpecDeployError
from ..graph_contract import FEATURES, FUSED, HIDDEN, LOGITS, PAST_LENGTH, PORTABLE, present_names
from ..kv_cache import KVCache
from ..manifest import Manifest
from .ort import InPlaceGraph, OrtGraph


class OrtDecoder(Decoder):
    def __init__(self, manifest: Manifest, model: str, backend: str = "ort-cpu", threads: int | None = None,
                 fused: bool = False):
        flavor = FUSED if fused else PORTABLE
        graphs = manifest.decoder_graphs(model, flavor)
        if not graphs:
            raise SpecDeployError(f"export has no {'fused ' if fused else ''}decoder graphs for model '{model}'")
        record = manifest.models[model]
        cache = KVCache(record, manifest.max_context, manifest.dtype, in_place=fused)
        super().__init__(record, cache, graphs, manifest.max_context)
        self.flavor = flavor
        self.presents = present_names(record.num_layers)
        if fused:
            buffers = cache.buffers()
            self.graphs = {t: InPlaceGraph(manifest.graph_path(g), threads, buffers) for t, g in sorted(graphs.items())}
            self.inputs = {t: StaticCall(t, g.inputs) for t, g in self.graphs.items()}  # fill the bound arrays
        else:
            self.graphs = {t: OrtGraph(manifest.graph_path(g), backend, threads) for t, g in sorted(graphs.items())}

    def _run(self, t: int, feeds: dict[str, np.ndarray], n: int) -> StepOutput:
        graph = self.graphs[t]
        if self.fused:
            feeds[PAST_LENGTH][0] = self.cache.length
            # The outputs are the graph's bound arrays, reused next call: copy the real rows.
            out = {k: v[0, :n].copy() for k, v in graph.run().items()}
            return StepOutput(out[LOGITS], out[HIDDEN], [], out.get(FEATURES))
        out = graph.run({**feeds, **self.cache.past_feeds()})
        return StepOutput(out[LOGITS][0, :n], out[HIDDEN][0, :n], [out[name] for name in self.presents],
                          out[FEATURES][0, :n] if FEATURES in out else None)

    def commit(self, step: StepOutput, rows) -> None:
        self.cache.commit(step.presents, rows)
