"""The EAGLE head at run time: its static-T draft graphs plus its own KV cache.

Graph I/O (`kind: eagle_draft`, static T, dynamic past P and mask width S):
in  input_ids [1,T] int64, features [1,T,F] float32 (F = the target feature width for
    catch-up graphs, the head's hidden size for expansion graphs; equal for EAGLE-1/2),
    position_ids [1,T], tree_mask [1,T,S] bool (row i vs the last S keys: earlier
    draft rows + the T new ones; all keys before them are visible), past_key.{i} /
    past_value.{i} [1,P,kv_heads,head_dim]
out topk_logprobs [1,T,K] float32, topk_ids [1,T,K] int64 (target vocabulary ids),
    hidden [1,T,H] float32 (the next features), present_key.{i} / present_value.{i}.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

import numpy as np

from ..backends import ORT_PROVIDERS, InPlaceGraph, OrtGraph, available_backends
from ..errors import SpecDeployError
from ..kv_cache import KVCache
from ..manifest import Manifest


@dataclass
class HeadOutput:
    logprobs: np.ndarray  # [n, K] descending
    ids: np.ndarray  # [n, K] target token ids
    hidden: np.ndarray  # [n, H]
    presents: list[np.ndarray]


class EagleHeadRunner:
    """`fused`: run the head's fused graphs (ORT CPU), which write its KV cache in place."""

    def __init__(self, manifest: Manifest, backend: str = "ort-cpu", threads: int | None = None,
                 fused: bool = False):
        if "eagle" not in manifest.models:
            raise SpecDeployError("method 'eagle' needs an EAGLE head: export with --eagle DIR")
        self.spec = spec = manifest.models["eagle"]
        self.version = int(spec.extra.get("eagle_version", 1))
        self.feature_dim = int(spec.extra["feature_dim"])
        self.top_k = int(spec.extra["top_k"])
        self.max_context = manifest.max_context
        if backend not in ORT_PROVIDERS:  # TensorRT engines cover the target; the small head runs on ORT
            backend = "ort-cuda" if "ort-cuda" in available_backends() else "ort-cpu"
        flavor = "fused" if fused and backend == "ort-cpu" else "portable"
        self.fused = flavor == "fused" and any(g.model == "eagle" and g.flavor == "fused"
                                               for g in manifest.graphs.values())
        if not self.fused:
            flavor = "portable"
        self.cache = KVCache(spec, manifest.max_context, manifest.dtype, in_place=self.fused)
        buffers = {f"past_{kind}.{layer}": bufs[layer] for kind, bufs in (("key", self.cache.keys),
                   ("value", self.cache.values)) for layer in range(spec.num_layers)}
        self.graphs: dict[int, dict[int, OrtGraph | InPlaceGraph]] = {}  # feature width -> T -> graph
        for g in manifest.graphs.values():
            if g.model == "eagle" and g.kind == "eagle_draft" and g.flavor == flavor:
                width = int(g.extra["features"])
                path = manifest.graph_path(g)
                self.graphs.setdefault(width, {})[g.tokens] = (
                    InPlaceGraph(path, threads, buffers) if self.fused else OrtGraph(path, backend, threads))
        for width in {self.feature_dim, spec.hidden_size}:
            if width not in self.graphs:
                raise SpecDeployError(f"export has no EAGLE draft graph reading {width}-wide features (re-export)")
        self.sizes = {w: sorted(gs) for w, gs in self.graphs.items()}
        self.calls, self.seconds = 0, 0.0

    def graph_for(self, width: int, n: int) -> int:
        sizes = self.sizes[width]
        i = bisect.bisect_left(sizes, n)
        if i == len(sizes):
            raise SpecDeployError(f"no EAGLE draft graph holds {n} tokens (exported sizes: {sizes})")
        return sizes[i]

    def max_tokens(self, width: int) -> int:
        return self.sizes[width][-1]

    def forward(self, tokens, features: np.ndarray, positions, mask: np.ndarray) -> HeadOutput:
        """n rows after the cached past; `mask` is [n, D + n]: the last D cached rows (earlier
        draft levels) and the n new rows. Nothing is committed."""
        n, width = len(tokens), features.shape[-1]
        t = self.graph_for(width, n)
        d = mask.shape[1] - n
        if self.cache.length + t > self.max_context:
            raise SpecDeployError(f"EAGLE head context full: {self.cache.length} + {t} > {self.max_context}")
        ids = np.zeros((1, t), np.int64)
        ids[0, :n] = tokens
        feats = np.zeros((1, t, width), np.float32)
        feats[0, :n] = features
        pos = np.empty((1, t), np.int64)
        pos[0, :n] = positions
        pos[0, n:] = pos[0, n - 1]
        full = np.zeros((1, t, d + t), bool)
        full[0, :n, : d + n] = mask
        full[0, np.arange(n, t), d + np.arange(n, t)] = True  # padding rows see only themselves
        feeds = {"input_ids": ids, "features": feats, "position_ids": pos, "tree_mask": full}
        if self.fused:
            feeds["past_length"] = self.cache.length
        else:
            for layer in range(self.spec.num_layers):
                feeds[f"past_key.{layer}"], feeds[f"past_value.{layer}"] = self.cache.past(layer)
        start = time.perf_counter()
        out = self.graphs[width][t].run(feeds)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        if self.fused:  # bound output arrays are reused by the next call: copy the real rows
            return HeadOutput(out["topk_logprobs"][0, :n].copy(), out["topk_ids"][0, :n].copy(),
                              out["hidden"][0, :n].copy(), [])
        presents = [out[f"present_{kind}.{layer}"] for layer in range(self.spec.num_layers)
                    for kind in ("key", "value")]
        return HeadOutput(out["topk_logprobs"][0, :n], out["topk_ids"][0, :n], out["hidden"][0, :n], presents)

    def commit(self, out: HeadOutput, rows) -> None:
        self.cache.commit(out.presents, rows)
