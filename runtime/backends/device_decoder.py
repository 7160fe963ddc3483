"""A target or draft decoder whose KV cache stays in device memory (runtime/backends/device_kv.py).

It is a runtime/decoder.Decoder like the host one: padding, graph choice, prefill and
timing are the interface's; subclasses (TensorRT in trt.py, ONNX Runtime with IOBinding
in ort_bound.py) only implement `_execute`: run the static-T graph with the past read
in place from the cache buffers and the presents written to the cache's scratch area,
returning the first n rows of every other output on the host.
"""

from __future__ import annotations

import numpy as np

from ..decoder import Decoder, StepOutput
from ..errors import SpecDeployError
from ..graph_contract import FEATURES, HIDDEN, LOGITS
from ..manifest import Manifest
from .device_kv import DeviceKVCache


class DeviceDecoder(Decoder):
    def __init__(self, manifest: Manifest, model: str, memory):
        self.graph_records = manifest.decoder_graphs(model)
        if not self.graph_records:
            raise SpecDeployError(f"export has no decoder graphs for model '{model}'")
        record = manifest.models[model]
        cache = DeviceKVCache(record, manifest.max_context, manifest.dtype, memory, max(self.graph_records))
        super().__init__(record, cache, self.graph_records, manifest.max_context)
        self.memory = memory
        # The presents of a step live in the scratch area until the next forward overwrites
        # them, so only the latest step may be committed.
        self._last: tuple[StepOutput, int] | None = None

    def _execute(self, t: int, feeds: dict[str, np.ndarray], past: int, n: int) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def _run(self, t: int, feeds: dict[str, np.ndarray], n: int) -> StepOutput:
        self.memory.sync()  # the last commit's copies land before the graph reads the cache
        out = self._execute(t, feeds, self.cache.length, n)
        step = StepOutput(out[LOGITS], out[HIDDEN], [], out.get(FEATURES))
        self._last = (step, n)
        return step

    def commit(self, step: StepOutput, rows) -> None:
        if self._last is None or step is not self._last[0]:
            raise SpecDeployError("internal: only a decoder's latest step can be committed "
                                  "(its new KV lives in a scratch buffer that the next call overwrites)")
        self.cache.commit(rows, available=self._last[1])
