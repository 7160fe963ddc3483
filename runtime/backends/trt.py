"""The "trt" backend: prebuilt TensorRT engines run with execute_async_v3.

Engines come from `specdeploy engines OUT` (engines/builder.py) and are listed
in OUT/engines.json (read with engine_records.py); an engine whose ONNX or weights changed, whose
bytes do not match their recorded sha256, or that was built by another TensorRT version or for
another GPU, is refused with a clear error (never silently used).

One engine per model (engines/builder.py): the decoder's graphs for every static T,
one optimization profile each. Each T gets its own execution context on its own
profile (`profile_index` in engines.json; TensorRT lets a profile serve one live
context at a time), with the T-sized input shapes set once; the weights are on the
GPU once. Engines of older exports, one per T, load the same way (profile 0 each).

Per model, every tensor address is bound once, at load:
* `past_key.{i}`/`past_value.{i}` -> the start of that layer's device KV buffer.
  The past is sequence-major, so `[:P]` is the buffer's first P rows and each
  step only changes the input *shape* ([1, P, kv_heads, head_dim]), never the
  address: the past is never copied;
* `present_*` -> the cache's scratch rows; commit copies only accepted rows
  device-to-device (runtime/backends/device_kv.py);
* input_ids/position_ids/tree_mask and every other output -> preallocated device
  buffers shared by the model's graphs (calls never overlap).
A step uploads the ids/positions/mask, runs, and downloads the first n rows of
logits and hidden: O(new tokens) traffic.

Written against the TensorRT 10/11 Python API; nothing here imports tensorrt
until a TrtDecoder is built, so the module imports cleanly without it.
"""

from __future__ import annotations

import sys
from functools import lru_cache
from typing import Any

import numpy as np

from ..errors import SpecDeployError
from ..graph_contract import INPUT_IDS, KV_KINDS, POSITION_IDS, TREE_MASK, parse_kv_name, past_name
from ..manifest import Manifest
from .device_decoder import DeviceDecoder
from .device_memory import CudaMemory, cuda_runtime, cuda_unavailable_reason
from .engine_records import check_engine_bytes, file_digests, load_engines, stale_reasons

FIXED_INPUTS = (INPUT_IDS, POSITION_IDS, TREE_MASK)


@lru_cache(maxsize=None)
def unavailable_reason() -> str | None:
    """None when TensorRT imports and a CUDA device is visible, else the reason (one line)."""
    try:
        import tensorrt  # noqa: F401
    except ImportError as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if getattr(exc, "name", None) == "tensorrt":
            return "TensorRT is not installed (pip install tensorrt)"
        return f"TensorRT does not import ({msg})"
    except Exception as exc:  # broken installs raise OSError/RuntimeError from the bindings
        return f"TensorRT does not import ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return cuda_unavailable_reason()


def is_available() -> bool:
    return unavailable_reason() is None


def gpu_identity(device: int = 0) -> dict:
    """What an engine is tied to: the GPU's name and compute capability."""
    rt = cuda_runtime()
    if rt is None:
        return {"gpu": "none", "compute_capability": "none"}
    return {"gpu": rt.device_name(device), "compute_capability": rt.compute_capability(device)}


def trt_logger():
    """A tensorrt.ILogger that keeps errors (for our messages) and prints only warnings and worse."""
    import tensorrt as trt

    class Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity, msg):
            if int(severity) <= int(trt.ILogger.Severity.ERROR):
                self.errors.append(msg)
            if int(severity) <= int(trt.ILogger.Severity.WARNING):
                print(f"[TensorRT] {msg}", file=sys.stderr, flush=True)

    return Logger()


class TrtDecoder(DeviceDecoder):
    def __init__(self, manifest: Manifest, model: str, trusted_digests: dict | None = None, device: int = 0):
        reason = unavailable_reason()
        if reason:
            raise SpecDeployError(f"backend 'trt' is not available here: {reason}")
        import tensorrt as trt

        records = load_engines(manifest.root)["engines"]
        here = {"tensorrt": trt.__version__, **gpu_identity(device)}
        hashed = file_digests(manifest.root)
        trusted = trusted_digests or {}  # digests load_manifest already checked against the files

        def digest(rel: str) -> str:
            return trusted[rel] if rel in trusted else hashed(rel)

        plans = {}
        for t, g in sorted(manifest.decoder_graphs(model).items()):
            rec = records.get(g.name)
            if rec is None:
                raise SpecDeployError(f"no TensorRT engine for graph {g.name} in {manifest.root} "
                                      f"(run `specdeploy engines {manifest.root}`)")
            why = stale_reasons(manifest.root, rec, digest, **here)
            if why:
                raise SpecDeployError(f"the TensorRT engine for {g.name} is stale: {why[0]} "
                                      f"(rebuild it with `specdeploy engines {manifest.root}`)")
            plans[t] = (manifest.root / rec["file"], rec)
        logger = trt_logger()
        runtime = trt.Runtime(logger)
        loaded, engines = {}, {}
        for t, (path, rec) in plans.items():
            if path not in loaded:  # an engine serving several T is deserialized once
                blob = path.read_bytes()
                check_engine_bytes(rec, blob, path)  # on the bytes deserialized: nothing can change in between
                loaded[path] = runtime.deserialize_cuda_engine(blob)
                if loaded[path] is None:
                    detail = logger.errors[-1] if logger.errors else "no detail"
                    raise SpecDeployError(f"TensorRT could not load {path} ({detail}); rebuild with "
                                          f"`specdeploy engines {manifest.root} --rebuild`")
            engines[t] = (loaded[path], int(rec.get("profile_index", 0)))
        self._attach(manifest, model, trt, CudaMemory(device), engines, logger)
        self.runtime = runtime

    @classmethod
    def from_engines(cls, manifest: Manifest, model: str, trt, memory, engines: dict, logger=None) -> TrtDecoder:
        """A decoder over already deserialized engines and a given memory: {T: engine} or
        {T: (engine, profile index)}; the tests use it to drive the binding logic with a
        stand-in engine on host memory."""
        self = cls.__new__(cls)
        self._attach(manifest, model, trt, memory, engines, logger)
        return self

    def _attach(self, manifest, model, trt, memory, engines, logger) -> None:
        super().__init__(manifest, model, memory)
        if sorted(engines) != self.sizes:
            raise SpecDeployError(f"engines for T={sorted(engines)}, the export has decoder graphs for T={self.sizes}")
        self.trt, self.logger = trt, logger
        engines = {t: e if isinstance(e, tuple) else (e, 0) for t, e in engines.items()}
        self.engines = {t: engine for t, (engine, _) in engines.items()}
        self.contexts: dict[int, Any] = {}
        self.graph_outputs: dict[int, list[str]] = {}
        self.buffers: dict[str, tuple[int, tuple, np.dtype]] = {}  # name -> (device ptr, row shape, dtype)
        for t, (engine, profile) in sorted(engines.items()):
            context = engine.create_execution_context()
            if context is None:
                raise SpecDeployError(f"TensorRT could not create an execution context for T={t} (out of GPU memory?)")
            # The profile first: choosing one resets the context's input shapes.
            several = getattr(engine, "num_optimization_profiles", 1) > 1
            if (profile or several) and not context.set_optimization_profile_async(profile, self.memory.stream):
                raise SpecDeployError(f"TensorRT refused optimization profile {profile} for T={t}")
            self.contexts[t] = context
            self._bind(t, engine, context)

    def _buffer(self, name: str, row_shape: tuple, dtype: np.dtype) -> int:
        if name not in self.buffers:
            row_bytes = int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize
            self.buffers[name] = (self.memory.alloc(max(self.sizes) * row_bytes), row_shape, dtype)
        ptr, known, _ = self.buffers[name]
        if known != row_shape:
            raise SpecDeployError(f"tensor {name} changes shape across engines: {known} vs {row_shape}")
        return ptr

    def _bind(self, t: int, engine, context) -> None:
        trt = self.trt
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self.graph_outputs[t] = []
        for name in names:
            is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
            dtype = np.dtype(trt.nptype(engine.get_tensor_dtype(name)))
            kv = parse_kv_name(name)
            if kv is not None:
                if dtype != self.cache.np_dtype:
                    raise SpecDeployError(
                        f"engine tensor {name} is {dtype}, the export's KV cache is {self.cache.np_dtype}")
                ptr = (self.cache.present_ptr if kv.present else self.cache.past_ptr)(kv.layer, kv.kind_index)
            elif is_input:
                if name not in FIXED_INPUTS:
                    raise SpecDeployError(f"engine for T={t} has an unexpected input {name!r}")
                # [1, T] ids/positions and the [1, T, T] mask, in buffers sized for the largest T;
                # their shapes are this context's for good (T is dynamic in a one-engine-per-model plan).
                rows = (max(self.sizes),) if name == TREE_MASK else ()
                ptr = self._buffer(name, rows, dtype)
                shape = (1, t, t) if name == TREE_MASK else (1, t)
                if -1 in tuple(engine.get_tensor_shape(name)) and not context.set_input_shape(name, shape):
                    raise SpecDeployError(f"TensorRT rejected shape {shape} for {name} (outside the T={t} profile?)")
            else:
                shape = tuple(engine.get_tensor_shape(name))
                if len(shape) >= 2 and shape[1] == -1:  # a dynamic T: this context's
                    shape = (shape[0], t, *shape[2:])
                if len(shape) < 2 or shape[:2] != (1, t) or min(shape) < 0:
                    raise SpecDeployError(f"engine output {name} has shape {shape}, expected static [1, {t}, ...]")
                ptr = self._buffer(name, shape[2:], dtype)
                self.graph_outputs[t].append(name)
            if not context.set_tensor_address(name, ptr):
                raise SpecDeployError(f"TensorRT refused the address of {name}")

    def _execute(self, t, feeds, past, n):
        context = self.contexts[t]
        for name in FIXED_INPUTS:
            self.memory.h2d(self.buffers[name][0], feeds[name])
        shape = (1, past, *self.cache.row_shape)
        for layer in range(self.spec.num_layers):
            for kind in KV_KINDS:
                if not context.set_input_shape(past_name(layer, kind), shape):
                    raise SpecDeployError(f"TensorRT rejected past length {past} for {past_name(layer, kind)} "
                                          f"(outside the engine's profile?)")
        if not context.execute_async_v3(self.memory.stream):
            detail = self.logger.errors[-1] if self.logger and self.logger.errors else "no detail"
            raise SpecDeployError(f"TensorRT execution failed for the T={t} engine: {detail}")
        out = {}
        for name in self.graph_outputs[t]:
            ptr, row_shape, dtype = self.buffers[name]
            host = np.empty((n, *row_shape), dtype)
            self.memory.d2h(host, ptr)  # same stream: waits for the engine, then copies n rows
            out[name] = host
        return out
