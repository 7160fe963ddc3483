"""ONNX Runtime with IOBinding: the KV cache never leaves the device.

With plain `session.run(feeds)` on the CUDA provider, every step uploads the
whole past (O(context)) and downloads every present. Here each `past_*` input
is bound to the cache buffer's own pointer with shape [1, P, kv_heads,
head_dim] (a contiguous prefix, so no copy), `present_*` outputs are bound to
the cache's scratch rows, and only the first n rows of logits/hidden come back
to the host. Token ids, positions and the mask are tiny and are bound from host
memory (ORT copies them).

On "ort-cpu" the same code runs on HostMemory (raw pointers into numpy
buffers); that is how the tests exercise the binding logic without a GPU.

The smallest T's session opens with the decoder, any other on its first call (or by
`open`), and sessions are
shared by every decoder of the process that runs the same graph (backends/sessions.py):
a serving pool holds the weights once on the device, each instance only its bindings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..errors import SpecDeployError
from ..graph_contract import (
    INPUT_IDS,
    KV_KINDS,
    POSITION_IDS,
    TOKENS_DIM,
    TREE_MASK,
    GraphRecord,
    parse_kv_name,
    past_name,
)
from ..manifest import Manifest
from .device_decoder import DeviceDecoder
from .device_memory import CudaMemory, HostMemory, cuda_unavailable_reason
from .ort import ORT_PROVIDERS, open_decoder_session
from .ort_decoder import OnFirstUse
from .trt_profiles import graph_profile

_ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
              "tensor(bool)": np.bool_, "tensor(int32)": np.int32}
FIXED_INPUTS = (INPUT_IDS, POSITION_IDS, TREE_MASK)


def iobinding_unavailable_reason(backend: str) -> str | None:
    """Why the device-resident ORT path cannot serve `backend` here (None: it can)."""
    if backend == "ort-cpu":
        return None
    if backend not in ("ort-cuda", "ort-trt"):
        return f"no IOBinding path for backend {backend!r}"
    return cuda_unavailable_reason()


def _trt_ep_options(manifest: Manifest, graph: GraphRecord, root: Path) -> dict:
    """Explicit TensorRT-EP profiles so a growing past never triggers an engine rebuild."""
    shapes = graph_profile(manifest, graph)
    fmt = lambda which: ",".join(f"{name}:{'x'.join(map(str, getattr(r, which)))}" for name, r in shapes.items())  # noqa: E731
    cache = root / "engines" / "ort-trt"
    cache.mkdir(parents=True, exist_ok=True)
    return {"trt_profile_min_shapes": fmt("min"), "trt_profile_opt_shapes": fmt("opt"),
            "trt_profile_max_shapes": fmt("max"), "trt_fp16_enable": manifest.dtype == "float16",
            "trt_engine_cache_enable": True, "trt_engine_cache_path": str(cache)}


class OrtBoundDecoder(DeviceDecoder):
    def __init__(self, manifest: Manifest, model: str, backend: str = "ort-cuda", threads: int | None = None,
                 memory=None):
        if memory is None:
            memory = HostMemory() if backend == "ort-cpu" else CudaMemory()
        super().__init__(manifest, model, memory)
        self.backend, self.threads, self.manifest = backend, threads, manifest
        self.graph_outputs: dict[int, list[str]] = {}
        self.outputs: dict[str, tuple[int, tuple, np.dtype]] = {}  # name -> (device ptr, row shape, dtype)
        self.sessions = OnFirstUse(self._open_session)
        self.bindings = OnFirstUse(lambda t: self._bind_outputs(self.sessions[t], t))
        self.bindings[self.sizes[0]]  # the decode graph every generation runs: opened now, not in a timed step

    def _open_session(self, t: int):
        g = self.graph_records[t]
        providers: list[Any] = list(ORT_PROVIDERS[self.backend])  # a name, or (name, options)
        if self.backend == "ort-trt":
            providers[0] = (providers[0], _trt_ep_options(self.manifest, g, self.manifest.root))
        path = self.manifest.graph_path(g)
        sess = open_decoder_session(self.manifest, g, self.backend, self.threads, providers)
        wanted = ORT_PROVIDERS[self.backend][0]
        if wanted not in sess.get_providers():
            # ORT falls back to CPU when a GPU provider fails to load; device pointers would then be wrong.
            raise SpecDeployError(f"onnxruntime could not start {wanted} for {path.name} "
                                  "(missing CUDA/cuDNN libraries for this onnxruntime-gpu build?)")
        return sess

    def open(self, sizes=None) -> None:
        """Open and bind the graphs of `sizes` (default: all) now rather than on first use."""
        for t in self.sizes if sizes is None else sizes:
            self.bindings[t]

    @property
    def opened(self) -> list[int]:
        return sorted(self.bindings)

    def _bind_outputs(self, sess, t: int):
        """Bind every output once: presents into the cache scratch, the rest into shared device buffers."""
        io = sess.io_binding()
        self.graph_outputs[t] = []
        dev, dev_id = self.memory.device_type, self.memory.device_id
        kv_dtype = self.cache.np_dtype
        kv_shape = (1, t, *self.cache.row_shape)
        for o in sess.get_outputs():
            kv = parse_kv_name(o.name)
            if kv is not None:
                io.bind_output(o.name, dev, dev_id, kv_dtype, kv_shape, self.cache.present_ptr(kv.layer, kv.kind_index))
                continue
            shape = tuple(t if d == TOKENS_DIM else d for d in o.shape)
            if len(shape) < 2 or not all(isinstance(d, int) for d in shape) or shape[:2] != (1, t):
                raise SpecDeployError(
                    f"output {o.name} of the T={t} graph has shape {shape}, expected static [1, {t}, ...]")
            if o.type not in _ORT_TYPES:
                raise SpecDeployError(f"output {o.name} has unsupported type {o.type}")
            dtype = np.dtype(_ORT_TYPES[o.type])
            row_shape = shape[2:]
            if o.name not in self.outputs:
                # One buffer per output name, sized for the largest graph: calls never overlap.
                row_bytes = int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize
                self.outputs[o.name] = (self.memory.alloc(max(self.sizes) * row_bytes), row_shape, dtype)
            ptr, known_rows, _ = self.outputs[o.name]
            if known_rows != row_shape:
                raise SpecDeployError(f"output {o.name} changes shape across graphs: {known_rows} vs {row_shape}")
            io.bind_output(o.name, dev, dev_id, dtype, shape, ptr)
            self.graph_outputs[t].append(o.name)
        return io

    def _execute(self, t, feeds, past, n):
        io = self.bindings[t]  # opens the T graph on its first call
        dev, dev_id = self.memory.device_type, self.memory.device_id
        for name in FIXED_INPUTS:
            io.bind_cpu_input(name, feeds[name])
        shape = (1, past, *self.cache.row_shape)
        for layer in range(self.spec.num_layers):
            for index, kind in enumerate(KV_KINDS):
                io.bind_input(past_name(layer, kind), dev, dev_id, self.cache.np_dtype, shape,
                              self.cache.past_ptr(layer, index))
        self.sessions[t].run_with_iobinding(io)
        out = {}
        for name in self.graph_outputs[t]:
            ptr, row_shape, dtype = self.outputs[name]
            host = np.empty((n, *row_shape), dtype)
            self.memory.d2h(host, ptr)
            out[name] = host
        return out
