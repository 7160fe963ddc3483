"""The EAGLE head at run time: its static-T draft graphs plus its own KV cache.

Graph I/O (`kind: eagle_draft`, runtime/graph_contract.eagle_draft_io; static T,
dynamic past P and mask width S):
in  input_ids [1,T] int64, features [1,T,F] float32 (F = the target feature width for
    catch-up graphs, the head's hidden size for expansion graphs; equal for EAGLE-1/2),
    position_ids [1,T], tree_mask [1,T,S] bool (row i vs the last S keys: earlier
    draft rows + the T new ones; all keys before them are visible), past_key.{i} /
    past_value.{i} [1,P,kv_heads,head_dim]
out topk_logprobs [1,T,K] float32, topk_ids [1,T,K] int64 (target vocabulary ids),
    hidden [1,T,H] float32 (the next features), present_key.{i} / present_value.{i}.

Draft rows are committed past the accepted ones while a tree grows, then dropped
with `rewind(committed)`: the next catch-up overwrites them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backends.availability import available_backends
from ..backends.ort import ORT_PROVIDERS, InPlaceGraph, OrtGraph
from ..decoder import StaticCall, StaticDecoder, smallest_fit
from ..errors import SpecDeployError
from ..graph_contract import (
    EAGLE,
    EAGLE_DRAFT,
    FEATURES,
    FUSED,
    HIDDEN,
    PAST_LENGTH,
    PORTABLE,
    TOPK_IDS,
    TOPK_LOGPROBS,
    present_names,
)
from ..kv_cache import KVCache
from ..manifest import Manifest


@dataclass
class HeadOutput:
    logprobs: np.ndarray  # [n, K] descending
    ids: np.ndarray  # [n, K] target token ids
    hidden: np.ndarray  # [n, H]
    presents: list[np.ndarray]


class EagleHeadRunner(StaticDecoder):
    """`fused`: run the head's fused graphs (ORT CPU), which write its KV cache in place.

    graph_for(n) and `sizes` are the expansion graphs' (features of the head's hidden size);
    graph_for(n, width) those reading `width`-wide features (EAGLE-3 catch-up)."""

    def __init__(self, manifest: Manifest, backend: str = "ort-cpu", threads: int | None = None,
                 fused: bool = False):
        if EAGLE not in manifest.models:
            raise SpecDeployError("method 'eagle' needs an EAGLE head: export with --eagle DIR")
        self.spec = spec = manifest.models[EAGLE]
        self.version = int(spec.extra.get("eagle_version", 1))
        self.feature_dim = int(spec.extra["feature_dim"])
        self.top_k = int(spec.extra["top_k"])
        if backend not in ORT_PROVIDERS:  # TensorRT engines cover the target; the small head runs on ORT
            backend = "ort-cuda" if "ort-cuda" in available_backends() else "ort-cpu"
        self.fused = fused and backend == "ort-cpu" and bool(manifest.graphs_of(EAGLE_DRAFT, EAGLE, FUSED))
        cache = KVCache(spec, manifest.max_context, manifest.dtype, in_place=self.fused)
        buffers = cache.buffers() if self.fused else None
        self.graphs: dict[int, dict[int, OrtGraph | InPlaceGraph]] = {}  # feature width -> T -> graph
        for g in manifest.graphs_of(EAGLE_DRAFT, EAGLE, FUSED if self.fused else PORTABLE):
            path = manifest.graph_path(g)
            assert g.features is not None  # every EAGLE draft graph records its feature width
            self.graphs.setdefault(g.features, {})[g.tokens] = (  # fused: one session per width, a binding per T
                InPlaceGraph(path, threads, buffers, g.tokens) if buffers is not None
                else OrtGraph(path, backend, threads))
        for width in {self.feature_dim, spec.hidden_size}:
            if width not in self.graphs:
                raise SpecDeployError(f"export has no EAGLE draft graph reading {width}-wide features (re-export)")
        self.sizes_by_width = {w: sorted(gs) for w, gs in self.graphs.items()}
        super().__init__(cache, self.sizes_by_width[spec.hidden_size], manifest.max_context, "EAGLE draft")
        self.inputs = {(w, t): StaticCall(t) for w, sizes in self.sizes_by_width.items() for t in sizes}
        self.presents = present_names(spec.num_layers)

    def graph_for(self, n: int, width: int | None = None) -> int:
        return smallest_fit(self.sizes if width is None else self.sizes_by_width[width], n, self.what)

    def forward(self, tokens, features: np.ndarray, positions, mask: np.ndarray) -> HeadOutput:
        """n rows after the cached past; `mask` is [n, D + n]: the last D cached rows (earlier
        draft levels) and the n new rows. Nothing is committed."""
        n, width = len(tokens), features.shape[-1]
        t = self.graph_for(n, width)
        self._check_room(t)
        feeds = dict(self.inputs[width, t].fill(tokens, positions, mask, self.cache.length,
                                                **{FEATURES: np.asarray(features, np.float32)}))
        if self.fused:
            feeds[PAST_LENGTH] = self.cache.length
        else:
            feeds.update(self.cache.past_feeds())
        out = self._timed(self.graphs[width][t].run, feeds)
        if self.fused:  # bound output arrays are reused by the next call: copy the real rows
            return HeadOutput(out[TOPK_LOGPROBS][0, :n].copy(), out[TOPK_IDS][0, :n].copy(),
                              out[HIDDEN][0, :n].copy(), [])
        return HeadOutput(out[TOPK_LOGPROBS][0, :n], out[TOPK_IDS][0, :n], out[HIDDEN][0, :n],
                          [out[name] for name in self.presents])

    def commit(self, out: HeadOutput, rows) -> None:
        self.cache.commit(out.presents, rows)
