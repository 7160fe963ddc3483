"""EAGLE head -> static-T `eagle_draft` graphs with their own KV cache (I/O: runtime/drafters/eagle_head.py).

Hooked into export_all as the eagle MethodSpec's export step; the target's verify graph
size comes from EagleConfig.verify_tokens, and EAGLE-3 makes the target graphs output
the three feature layers (`target_feature_layers`).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..runtime.drafters.eagle import graph_plan
from ..runtime.errors import SpecDeployError
from ..runtime.graph_contract import (
    EAGLE,
    EAGLE_DRAFT,
    FEATURES,
    FUSED,
    INPUT_IDS,
    KV_KINDS,
    PORTABLE,
    POSITION_IDS,
    TREE_MASK,
    GraphRecord,
    ModelRecord,
    eagle_draft_io,
    eagle_graph_name,
    graph_file,
    is_past,
    past_name,
    weights_file,
)
from .draft_vocab import DRAFT_VOCAB_FILE, read_draft_vocab
from .eagle_fused import build_fused_eagle_head
from .eagle_heads import EagleHead, eagle3_feature_layers, load_eagle_head, read_head_config
from .fused_graph import write_fused
from .hf_loading import fused_unsupported
from .method_export import MethodExport
from .onnx_writer import SharedWeights, export_module
from .reference import random_tree_mask, save_reference, torch_reference


class EagleDraftGraph(nn.Module):
    """forward(input_ids, features, position_ids, tree_mask, *past) -> topk_logprobs, topk_ids, hidden, *presents."""

    def __init__(self, head: EagleHead, top_k: int):
        super().__init__()
        self.head, self.top_k = head, top_k
        self.dtype = head.fc.weight.dtype

    def forward(self, input_ids, features, position_ids, tree_mask, *past):
        h, presents = self.head.step(input_ids, features.to(self.dtype), position_ids, tree_mask, past)
        logp = torch.log_softmax(self.head.logits(h).float(), dim=-1)
        values, idx = torch.topk(logp, self.top_k, dim=-1)
        return (values, self.head.to_target_ids(idx), h.float(), *presents)


def head_record(head: EagleHead, top_k: int, feature_layers) -> ModelRecord:
    extra = {"eagle_version": head.version, "draft_vocab_size": head.draft_vocab, "feature_dim": head.feature_dim,
             "top_k": top_k}
    if feature_layers:
        extra["target_feature_layers"] = list(feature_layers)
    return ModelRecord(name=EAGLE, num_layers=head.num_layers, num_heads=head.num_heads,
                       num_kv_heads=head.num_kv_heads, head_dim=head.head_dim, hidden_size=head.hidden_size,
                       vocab_size=head.target_vocab, architecture=f"EAGLE{head.version}Head", model_type="eagle",
                       source=getattr(head, "source", ""), extra=extra)


def sample_feeds(t: int, width: int, past: int, draft_rows: int, head: EagleHead, seed: int) -> dict:
    """Plausible inputs: features of unit scale, a random tree over draft rows + new rows."""
    rng = np.random.default_rng(seed)
    np_dtype = torch.empty((), dtype=head.fc.weight.dtype).numpy().dtype
    s = draft_rows + t
    mask = np.zeros((1, t, s), bool)
    mask[0, :, :draft_rows] = rng.random((t, draft_rows)) < 0.5
    mask[0, :, draft_rows:] = random_tree_mask(t, rng)
    feeds = {
        INPUT_IDS: rng.integers(0, head.target_vocab, (1, t), dtype=np.int64),
        FEATURES: rng.standard_normal((1, t, width)).astype(np.float32),
        POSITION_IDS: (past + np.arange(t, dtype=np.int64))[None],
        TREE_MASK: mask,
    }
    for i in range(head.num_layers):
        for kind in KV_KINDS:
            shape = (1, past, head.num_kv_heads, head.head_dim)
            feeds[past_name(i, kind)] = rng.standard_normal(shape).astype(np_dtype)
    return feeds


def export_head_graphs(head: EagleHead, plan: dict, out: Path, max_context: int, progress,
                       fused: bool = False, target_weights: dict | None = None) -> dict[str, GraphRecord]:
    """One graph per (feature width, T), and its fused twin when `fused`; returns their manifest records.
    `target_weights`: {flavor: the target's weight files that flavor's graphs may reference} (the
    head's embedding is the target's: stored once)."""
    wrapper = EagleDraftGraph(head, plan["top_k"]).eval()
    reuse = target_weights or {}
    weights = SharedWeights(out, weights_file(EAGLE), reuse.get(PORTABLE, ()))
    fused_weights = SharedWeights(out, weights_file(EAGLE, FUSED), (weights, *reuse.get(FUSED, ()))) if fused else None
    io = eagle_draft_io(head.num_layers)
    inputs, outputs = list(io.inputs), list(io.outputs)
    dynamic = {n: {1: "past_len"} for n in inputs if is_past(n)}
    dynamic[TREE_MASK] = {2: "mask_len"}
    wanted = {(head.feature_dim, t) for t in plan["catchup"]} | {(head.hidden_size, t) for t in plan["expand"]}
    graphs = {}
    for width, t in sorted(wanted):
        name = eagle_graph_name(t, width, head.hidden_size)
        start = time.perf_counter()
        feeds = sample_feeds(t, width, 5, 2, head, seed=t)
        args = [torch.from_numpy(feeds[n]) for n in inputs]
        export_module(wrapper, args, out / graph_file(name), inputs, outputs, dynamic, weights)
        ref = sample_feeds(t, width, min(29, max_context - t - 3), 3, head, seed=2000 + t)
        ref_out = torch_reference(wrapper, ref, inputs, outputs)
        save_reference(out, name, ref, ref_out)
        graphs[name] = GraphRecord.new(name, EAGLE, EAGLE_DRAFT, t, features=width)
        progress(f"  exported {graph_file(name)} (T={t}, features {width}) in {time.perf_counter() - start:.1f}s")
        if fused:
            fname = eagle_graph_name(t, width, head.hidden_size, FUSED)
            model = build_fused_eagle_head(head, t, width, plan["top_k"], max_context)
            write_fused(model, out, fname, fused_weights, ref, ref_out, t)
            graphs[fname] = GraphRecord.new(fname, EAGLE, EAGLE_DRAFT, t, flavor=FUSED, features=width)
    return graphs


class EagleHeadExporter(MethodExport):
    """`--eagle DIR`: loaded and checked before the target is exported (EAGLE-3 changes the
    target graphs: they output three layers' features), its graphs exported after."""

    def __init__(self, head_dir: Path):
        super().__init__(head_dir)
        self.head_dir = self.source
        self.head: EagleHead | None = None
        self.feature_layers: tuple[int, ...] = ()

    def check(self, target_cfg: dict, config, progress):
        # a missing or mismatched head is reported before the target loads; its weights need the target
        read_head_config(self.head_dir, target_cfg["vocab_size"])
        return config

    def prepare(self, target_model, progress) -> tuple[int, ...]:
        progress(f"loading EAGLE head from {self.head_dir}")
        self.head = load_eagle_head(self.head_dir, target_model, target_model.dtype)
        if self.head.version == 3:
            self.feature_layers = eagle3_feature_layers(target_model.config.num_hidden_layers, self.head.aux_layer_ids)
        return self.feature_layers

    def __call__(self, ctx: dict) -> None:
        head = self.head
        self._draft_vocab(ctx["methods"]["eagle"].draft_vocab, ctx["progress"])
        plan = graph_plan(ctx["methods"]["eagle"], ctx["cfg"].prefill_chunk)
        if plan["top_k"] > head.draft_vocab:
            raise SpecDeployError(f"eagle.top_k {plan['top_k']} exceeds the head's vocabulary of {head.draft_vocab}")
        ctx["models"][EAGLE] = head_record(head, plan["top_k"], self.feature_layers)
        unfused = fused_unsupported(head.cfg)
        fused = ctx.get("fused", False) and head.fc.weight.dtype == torch.float32 and unfused is None
        if ctx.get("fused", False) and unfused:
            ctx["progress"](f"  eagle: no fused graphs for {unfused}; ONNX Runtime will run the portable graphs")
        ctx["graphs"].update(export_head_graphs(head, plan, ctx["out"], ctx["cfg"].max_context, ctx["progress"],
                                                fused, ctx.get("target_weights")))

    def _draft_vocab(self, size: int, progress) -> None:
        """eagle.draft_vocab N: draft among the head's N most frequent target tokens, when it says which."""
        head = self.head
        if head.version != 1:  # EAGLE-3 heads bring their own draft vocabulary (d2t)
            return
        ids = read_draft_vocab(self.head_dir, size, head.target_vocab, "eagle", progress)
        if ids is None:
            return
        head.restrict_vocab(ids)
        progress(f"  EAGLE drafts among the {head.draft_vocab} most frequent tokens ({DRAFT_VOCAB_FILE})")
