"""The lean runtime (numpy + onnxruntime + tokenizers; never torch or transformers).

The embedding API is importable from here; names load on first use so that importing
`specdeploy.runtime` stays cheap.
"""

_LAZY = {
    "Service": "service", "Request": "service", "BusyError": "pool", "ExportPool": "pool",
    "AsyncRequest": "aio", "LoadedExport": "loaded_export", "Generation": "generate", "GenerationResult": "generate",
    "TokenEvent": "generate", "TokenLogprob": "logprobs", "SamplingParams": "sampling", "SpecDeployError": "errors",
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
