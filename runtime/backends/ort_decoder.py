"""One model (target or draft): its static-T decoder graphs plus its KV cache."""

from __future__ import annotations

import bisect
import functools
import time
from dataclasses import dataclass

import numpy as np

from .backends import InPlaceGraph, OrtGraph
from .errors import SpecDeployError
from .kv_cache import KVCache
from .manifest import Manifest


@functools.lru_cache(maxsize=64)
def _eye(t: int) -> np.ndarray:
    return np.eye(t, dtype=bool)


@dataclass
class StepOutput:
    logits: np.ndarray  # [n, vocab] float32, real (unpadded) tokens only
    hidden: np.ndarray  # [n, hidden] float32
    presents: list[np.ndarray]  # per layer key, value: [1, T, kv_heads, head_dim]; empty for fused graphs
    features: np.ndarray | None = None


class Decoder:
    """`fused` runs the export's fused graphs (ORT CPU only), which update the KV cache in place."""

    def __init__(self, manifest: Manifest, model: str, backend: str = "ort-cpu", threads: int | None = None,
                 fused: bool = False):
        self.spec = manifest.models[model]
        self.max_context = manifest.max_context
        self.fused = fused
        graphs = manifest.decoder_graphs(model, "fused" if fused else "portable")
        if not graphs:
            raise SpecDeployError(f"export has no {'fused ' if fused else ''}decoder graphs for model '{model}'")
        self.cache = KVCache(self.spec, manifest.max_context, manifest.dtype, in_place=fused)
        if fused:
            buffers = {f"past_{kind}.{layer}": bufs[layer] for kind, bufs in (("key", self.cache.keys),
                       ("value", self.cache.values)) for layer in range(self.spec.num_layers)}
            self.graphs = {t: InPlaceGraph(manifest.graph_path(g), threads, buffers) for t, g in sorted(graphs.items())}
        else:
            self.graphs = {t: OrtGraph(manifest.graph_path(g), backend, threads) for t, g in sorted(graphs.items())}
        self.sizes = sorted(self.graphs)
        self.calls = 0
        self.seconds = 0.0

    def graph_for(self, n: int) -> int:
        """The smallest static token count that holds n tokens."""
        i = bisect.bisect_left(self.sizes, n)
        if i == len(self.sizes):
            raise SpecDeployError(f"no graph holds {n} tokens (exported sizes: {self.sizes})")
        return self.sizes[i]

    def forward(self, tokens: np.ndarray, positions: np.ndarray, mask: np.ndarray) -> StepOutput:
        """Score n new tokens after the cached past; nothing is committed yet.

        `mask` is [n, n] (row sees column); the call is padded to the graph's static T.
        """
        n = len(tokens)
        t = self.graph_for(n)
        if self.cache.length + t > self.max_context:
            raise SpecDeployError(
                f"context full: {self.cache.length} cached + {t} new tokens exceed max_context {self.max_context}"
            )
        graph = self.graphs[t]
        feeds = graph.inputs if self.fused else {
            "input_ids": np.zeros((1, t), np.int64), "position_ids": np.empty((1, t), np.int64),
            "tree_mask": np.empty((1, t, t), bool)}
        feeds["input_ids"][0, :n] = tokens
        feeds["input_ids"][0, n:] = 0
        pos = feeds["position_ids"][0]
        pos[:n] = positions
        pos[n:] = positions[-1] if n else self.cache.length
        full = feeds["tree_mask"][0]
        full[:n, :n] = mask
        if n < t:  # padding rows see only themselves
            full[:n, n:] = False
            full[n:] = _eye(t)[n:]
        if self.fused:
            feeds["past_length"][0] = self.cache.length
        else:
            for layer in range(self.spec.num_layers):
                feeds[f"past_key.{layer}"], feeds[f"past_value.{layer}"] = self.cache.past(layer)
        start = time.perf_counter()
        out = graph.run() if self.fused else graph.run(feeds)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        if self.fused:  # the outputs are the graph's bound arrays, reused next call: copy the real rows
            presents = []
            out = {k: v[0, :n].copy() for k, v in out.items()}
        else:
            presents = [out[f"present_{kind}.{layer}"] for layer in range(self.spec.num_layers)
                        for kind in ("key", "value")]
            out = {k: v[0, :n] for k, v in out.items() if not k.startswith("present_")}
        return StepOutput(out["logits"], out["hidden"], presents, out.get("features"))

    def commit(self, step: StepOutput, rows) -> None:
        self.cache.commit(step.presents, rows)

    def prefill(self, tokens: list[int] | np.ndarray, chunk: int, on_chunk=None) -> StepOutput | None:
        """Process and commit tokens causally in chunks of the prefill graph's size.

        `on_chunk(step)` sees every chunk's output (EAGLE reads the prompt's features).
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        last = None
        for s in range(0, len(tokens), chunk):
            piece = tokens[s : s + chunk]
            start = self.cache.length
            n = len(piece)
            last = self.forward(piece, np.arange(start, start + n), np.tril(np.ones((n, n), dtype=bool)))
            self.commit(last, slice(0, n))
            if on_chunk is not None:
                on_chunk(last)
        return last

    def reset(self) -> None:
        self.cache.length = 0
