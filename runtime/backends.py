"""Graph sessions. ONNX Runtime here; TensorRT lives in runtime/trt_backend.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import SpecDeployError

ORT_PROVIDERS = {
    "ort-cpu": ["CPUExecutionProvider"],
    "ort-cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "ort-trt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
}


def available_backends() -> list[str]:
    import onnxruntime as ort

    have = set(ort.get_available_providers())
    out = [name for name, prov in ORT_PROVIDERS.items() if prov[0] in have]
    try:
        from . import trt_backend

        if trt_backend.is_available():
            out.append("trt")
    except ImportError:
        pass
    return out


def best_backend() -> str:
    have = available_backends()
    for name in ("trt", "ort-trt", "ort-cuda", "ort-cpu"):
        if name in have:
            return name
    raise SpecDeployError("no usable backend: onnxruntime has no CPU provider?")


def check_backend(name: str | None) -> str:
    if name in (None, "auto"):
        return best_backend()
    known = list(ORT_PROVIDERS) + ["trt"]
    if name not in known:
        raise SpecDeployError(f"unknown backend {name!r} (choose from {', '.join(known)})")
    have = available_backends()
    if name not in have:
        raise SpecDeployError(f"backend {name!r} is not available here: {_why_unavailable(name)} "
                              f"(available: {', '.join(have) or 'none'})")
    return name


def _why_unavailable(name: str) -> str:
    if name == "trt":
        from .trt_backend import unavailable_reason

        return unavailable_reason() or "TensorRT check failed"
    provider = ORT_PROVIDERS[name][0]
    hint = "install onnxruntime-gpu" if name == "ort-cuda" else "install an onnxruntime build with TensorRT"
    return f"onnxruntime has no {provider} ({hint})"


class OrtGraph:
    """One ONNX graph in one ORT session; inputs wrap numpy memory without copying."""

    def __init__(self, path: Path, backend: str = "ort-cpu", threads: int | None = None):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            opts.intra_op_num_threads = threads
        opts.log_severity_level = 3
        # Each static-T graph has its own session and thread pool; spinning pools
        # fight each other (and the draft's) for the cores between calls, which
        # measured ~2x slower decode on 2 cores. Idle threads should sleep.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
        try:
            # Under "trt", graphs that have no engine (drafter heads) run on ORT's CUDA provider.
            providers = ORT_PROVIDERS["ort-cuda"] if backend == "trt" else ORT_PROVIDERS[backend]
            self.session = ort.InferenceSession(str(path), opts, providers=providers)
        except Exception as exc:  # corrupt or truncated graph / external data
            raise SpecDeployError(f"could not load graph {path}: {str(exc).splitlines()[0][:300]}") from None
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.input_names = {i.name for i in self.session.get_inputs()}

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self.output_names, self.session.run(self.output_names, feeds)))
