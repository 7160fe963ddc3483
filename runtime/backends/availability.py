"""Which backends this machine can run, and one clear error for a backend it cannot."""

from __future__ import annotations

from ..errors import SpecDeployError
from .ort import ORT_PROVIDERS

BACKENDS = (*ORT_PROVIDERS, "trt")
PREFERENCE = ("trt", "ort-trt", "ort-cuda", "ort-cpu")  # what "auto" picks, best first


def available_backends() -> list[str]:
    import onnxruntime as ort

    have = set(ort.get_available_providers())
    out = [name for name, prov in ORT_PROVIDERS.items() if prov[0] in have]
    try:
        from . import trt

        if trt.is_available():
            out.append("trt")
    except ImportError:
        pass
    return out


def best_backend() -> str:
    have = available_backends()
    for name in PREFERENCE:
        if name in have:
            return name
    raise SpecDeployError("no usable backend: onnxruntime has no CPU provider?")


def check_backend(name: str | None) -> str:
    if name in (None, "auto"):
        return best_backend()
    if name not in BACKENDS:
        raise SpecDeployError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
    have = available_backends()
    if name not in have:
        raise SpecDeployError(f"backend {name!r} is not available here: {_why_unavailable(name)} "
                              f"(available: {', '.join(have) or 'none'})")
    return name


def _why_unavailable(name: str) -> str:
    if name == "trt":
        from .trt import unavailable_reason

        return unavailable_reason() or "TensorRT check failed"
    provider = ORT_PROVIDERS[name][0]
    hint = "install onnxruntime-gpu" if name == "ort-cuda" else "install an onnxruntime build with TensorRT"
    return f"onnxruntime has no {provider} ({hint})"
