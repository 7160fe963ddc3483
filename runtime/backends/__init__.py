"""Where graphs run. Each module has one job:

* ort.py: ONNX Runtime sessions, the shared thread pool, plain and in-place bound graphs;
* ort_decoder.py: a target/draft decoder on those graphs, its KV cache in host memory;
* device_memory.py, device_kv.py, device_decoder.py: decoders whose KV cache stays in device
  memory, run by ort_bound.py (ONNX Runtime with IOBinding) or trt.py (TensorRT engines);
* trt_profiles.py, engine_records.py: the engines' shape profiles and OUT/engines.json;
* availability.py: which backends this machine can run.

The runtime never imports specdeploy.engines; engines/ imports what it shares from here.
"""

from .availability import available_backends, check_backend
from .ort import OrtGraph, session_options, thread_pool_mode, use_per_session_threads, use_shared_threads

__all__ = ["available_backends", "check_backend", "OrtGraph", "session_options", "thread_pool_mode",
           "use_per_session_threads", "use_shared_threads"]
