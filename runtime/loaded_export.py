"""An export directory loaded for running: manifest, tokenizer and lazily opened decoders.

One instance serves one request at a time (its KV caches are per instance);
runtime/pool.py hands out instances to concurrent requests. What does not change per
request is loaded once: `sibling()` instances share the manifest, tokenizer and method
configs, and every instance of the process shares ONNX Runtime sessions
(backends/sessions.py), so a pool holds each model's weights once.

Graphs open when needed: a decoder opens its smallest T's graph (the decode step) when
created and any other T's on its first step at that T, a drafter its own graphs when
built. `warm_up(method)` opens what a method can call ahead of its first request (a
service does it at load).
"""

from __future__ import annotations

from pathlib import Path

from .backends.availability import available_backends, check_backend
from .config import ExportConfig, with_overrides
from .decoder import Decoder
from .errors import SpecDeployError
from .graph_contract import FUSED, PORTABLE, TARGET
from .manifest import load_manifest
from .methods import AUTO, REGISTRY, build_drafter, method_spec, resolve_method, validate_methods
from .tokenizer import TextTokenizer

FLAVOR_CHOICES = ("auto", FUSED, PORTABLE)


def with_fused_methods(methods: dict) -> dict:
    """`methods` plus, at their defaults, the fused methods (drafters/fused.py) whose two parts it
    has: an export from before they existed lacks only their own keys (a fused config reads its
    parts' exported configs)."""
    fused = {name: spec.config() for name, spec in REGISTRY.items() if name not in methods
             and getattr(spec.config, "parts", None) and all(part in methods for part in spec.config.parts)}
    return {**methods, **fused}


class LoadedExport:
    """`flavor` picks the decoder graphs ONNX Runtime's CPU backend runs: "auto" takes the
    fused ones where the export has them, "portable" the standard-op ones (what TensorRT uses)."""

    times_steps = True  # a step's verify call is this instance's own: drafters time it by size (step_costs.py)

    def __init__(self, path: str | Path, backend: str | None = None, threads: int | None = None,
                 verify_checksums: bool = True, flavor: str = "auto"):
        if flavor not in FLAVOR_CHOICES:
            raise SpecDeployError(f"unknown flavor {flavor!r} (choose from {', '.join(FLAVOR_CHOICES)})")
        self.flavor = flavor
        self.manifest = load_manifest(path, verify_checksums=verify_checksums)
        # Digests load_manifest checked against the files: engine staleness checks reuse them.
        self._verified_digests = self.manifest.files if verify_checksums else None
        self.backend = check_backend(backend)
        if backend in (None, "auto") and self.backend == "trt":
            from .backends.engine_records import engines_listed

            if not engines_listed(self.manifest):  # auto never picks engines that were not built
                self.backend = next(b for b in ("ort-trt", "ort-cuda", "ort-cpu") if b in available_backends())
        self.threads = threads
        self.tokenizer = TextTokenizer(self.manifest.root / self.manifest.tokenizer.get("dir", "tokenizer"))
        manifest_path = str(self.manifest.root / "manifest.json")
        self.methods = with_fused_methods(validate_methods(self.manifest.methods, manifest_path))
        self.prefill_chunk = int(self.manifest.raw.get("prefill_chunk", ExportConfig.prefill_chunk))
        self._decoders: dict[str, Decoder] = {}
        self._parts: dict[str, object] = {}
        target = self.manifest.models.get(TARGET)
        if target is None:
            raise SpecDeployError("manifest has no target model")
        if self.tokenizer.vocab_size > target.vocab_size:
            raise SpecDeployError(
                f"vocabulary mismatch: tokenizer has {self.tokenizer.vocab_size} tokens, "
                f"target vocab is {target.vocab_size}"
            )

    def sibling(self) -> "LoadedExport":
        """Another instance of the same export for a concurrent request: its own decoders and
        KV caches, the loaded manifest, tokenizer and configs shared (sessions are anyway)."""
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        twin._decoders, twin._parts = {}, {}
        return twin

    def warm_up(self, method: str) -> None:
        """Open now every graph `method` can call: the graphs of the decoders it runs (any
        size can serve a prefill chunk or a short proposal) and its drafter's own; run the
        decoders' small call sizes once (backends/ort_decoder.py, warm_call_sizes)."""
        config = self.method_config(method)
        build_drafter(self, config)  # opens the drafter's graphs (heads) and decoders (draft)
        for decoder in self._decoders.values():
            if hasattr(decoder, "open"):  # TensorRT decoders load every engine up front
                decoder.open()
            if hasattr(decoder, "warm_call_sizes"):  # ORT: each small call size's first run, now
                decoder.warm_call_sizes()

    def decoder(self, model: str) -> Decoder:
        if model not in self._decoders:
            self._decoders[model] = self._open_decoder(model)
        return self._decoders[model]

    def part(self, key: str, opener):
        """Other per-export graph sets (an EAGLE head and its cache), opened once on first use."""
        if key not in self._parts:
            self._parts[key] = opener()
        return self._parts[key]

    def _open_decoder(self, model: str):
        """GPU backends keep the KV cache on the device (backends/trt.py, backends/ort_bound.py)."""
        if self.backend == "trt":
            from .backends.trt import TrtDecoder

            return TrtDecoder(self.manifest, model, trusted_digests=self._verified_digests)
        if self.backend in ("ort-cuda", "ort-trt"):
            from .backends.ort_bound import OrtBoundDecoder, iobinding_unavailable_reason

            if iobinding_unavailable_reason(self.backend) is None:
                return OrtBoundDecoder(self.manifest, model, self.backend, self.threads)
        from .backends.ort_decoder import OrtDecoder

        has_fused = bool(self.manifest.decoder_graphs(model, FUSED))
        if self.flavor == FUSED and (self.backend != "ort-cpu" or not has_fused):
            raise SpecDeployError(f"fused graphs need --backend ort-cpu and an export that has them "
                                  f"(backend {self.backend}; {model} has {'some' if has_fused else 'none'})")
        fused = self.backend == "ort-cpu" and has_fused and self.flavor != PORTABLE
        return OrtDecoder(self.manifest, model, self.backend, self.threads, fused=fused)

    def method_config(self, method: str, overrides: dict | None = None):
        """The exported config of `method` (validated when the manifest loaded), or a new one
        with a request's `overrides` applied (validated then). `auto`: the export's recommended method's."""
        method = resolve_method(method, self)
        if method not in REGISTRY:  # name what this export can run, `auto` included, not every known method
            raise SpecDeployError(f"unknown method {method!r} (this export has: {', '.join([AUTO, *self.methods])})")
        spec = method_spec(method)
        if method not in self.methods:
            needs = f"; it needs `specdeploy export --{spec.export_input} DIR`" if spec.export_input else ""
            raise SpecDeployError(f"method {method!r} was not exported (exported: {', '.join(self.methods)}){needs}")
        config = self.methods[method]
        return with_overrides(config, overrides, method) if overrides else config

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self.manifest.eos_token_ids)
