"""The Decoder interface for graphs whose KV cache stays in device memory.

It subclasses runtime/decoder.Decoder and replaces only what touches the graph
and the cache (construction, forward, commit); prefill, reset and graph_for are
inherited, so the generator's view of a decoder stays one definition.
Subclasses (TensorRT in trt_backend.py, ONNX Runtime with IOBinding in
ort_bound.py) only implement `_run`: execute the static-T graph with the past
read in place from the cache buffers and the presents written to the cache's
scratch area, returning the first n rows of every other output on the host.
Everything the generator sees (forward/commit/prefill/reset, graph_for,
cache.length, max_context, calls, seconds) behaves exactly as runtime/decoder.Decoder.
"""

from __future__ import annotations

import time

import numpy as np

from .decoder import Decoder, StepOutput
from .device_kv import DeviceKVCache
from .errors import SpecDeployError
from .manifest import Manifest


class DeviceDecoder(Decoder):
    def __init__(self, manifest: Manifest, model: str, memory):  # not super(): that opens host sessions
        self.spec = manifest.models[model]
        self.max_context = manifest.max_context
        self.graph_specs = manifest.decoder_graphs(model)
        if not self.graph_specs:
            raise SpecDeployError(f"export has no decoder graphs for model '{model}'")
        self.graphs = self.graph_specs  # T -> GraphSpec (the host Decoder keeps sessions here)
        self.sizes = sorted(self.graph_specs)
        self.memory = memory
        self.cache = DeviceKVCache(self.spec, manifest.max_context, manifest.dtype, memory, max(self.sizes))
        self.calls = 0
        self.seconds = 0.0
        # The presents of a step live in the scratch area until the next forward overwrites
        # them, so only the latest step may be committed.
        self._last: tuple[StepOutput, int] | None = None

    def _run(self, t: int, feeds: dict[str, np.ndarray], past: int, n: int) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def forward(self, tokens: np.ndarray, positions: np.ndarray, mask: np.ndarray) -> StepOutput:
        n = len(tokens)
        t = self.graph_for(n)
        if self.cache.length + t > self.max_context:
            raise SpecDeployError(
                f"context full: {self.cache.length} cached + {t} new tokens exceed max_context {self.max_context}"
            )
        ids = np.zeros((1, t), np.int64)
        ids[0, :n] = tokens
        pos = np.empty((1, t), np.int64)
        pos[0, :n] = positions
        pos[0, n:] = positions[-1] if n else self.cache.length
        full = np.eye(t, dtype=bool)
        full[:n, :n] = mask
        feeds = {"input_ids": ids, "position_ids": pos, "tree_mask": np.ascontiguousarray(full[None])}
        start = time.perf_counter()
        self.memory.sync()  # the last commit's copies land before the graph reads the cache
        out = self._run(t, feeds, self.cache.length, n)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        step = StepOutput(out["logits"], out["hidden"], [], out.get("features"))
        self._last = (step, n)
        return step

    def commit(self, step: StepOutput, rows) -> None:
        if self._last is None or step is not self._last[0]:
            raise SpecDeployError("internal: only a decoder's latest step can be committed "
                                  "(its new KV lives in a scratch buffer that the next call overwrites)")
        self.cache.commit(rows, available=self._last[1])
