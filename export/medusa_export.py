"""`--medusa DIR` (+ `--tree NAME|FILE`): the Medusa heads graph beside the target's graphs.

Graph `medusa_heads` (kind medusa_heads, runtime/graph_contract.MEDUSA_HEADS_IO, static shapes):
  in  `hidden`        float32 [1, H]  the target's final hidden state (after the final norm)
  out `topk_ids`      int64   [num_heads, K]  each head's K best tokens, best first
  out `topk_logprobs` float32 [num_heads, K]  their log-probabilities
K is the tree's largest rank + 1 (or methods.medusa.top_k). The target's verify graph
is sized to the tree (MedusaConfig.verify_tokens); the manifest's methods.medusa keeps
the tree's paths, so the runtime needs nothing else.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..runtime.drafters.medusa import MedusaConfig
from ..runtime.errors import SpecDeployError
from ..runtime.graph_contract import (
    HIDDEN,
    MEDUSA_HEADS,
    MEDUSA_HEADS_GRAPH,
    MEDUSA_HEADS_IO,
    PORTABLE,
    TARGET,
    GraphRecord,
    graph_file,
    weights_file,
)
from .draft_vocab import read_draft_vocab
from .medusa_heads import MedusaHeads, load_heads
from .method_export import MethodExport
from .onnx_writer import SharedWeights, export_module
from .reference import save_reference, torch_reference

INPUTS, OUTPUTS = list(MEDUSA_HEADS_IO.inputs), list(MEDUSA_HEADS_IO.outputs)


class MedusaHeadsModule(nn.Module):
    """hidden [1, H] -> (topk_ids, topk_logprobs) [num_heads, K]: the graph's PyTorch side.

    With `vocab_subset` each head's LM head keeps only those tokens' rows (the draft
    vocabulary): candidates and their log-probabilities are among them, ids mapped back.
    """

    def __init__(self, heads: MedusaHeads, num_heads: int, top_k: int, vocab_subset: list[int] | None = None):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(*head[:-1]) for head in heads.heads[:num_heads])
        rows = None if vocab_subset is None else torch.as_tensor(vocab_subset, dtype=torch.int64)
        weights = [head[-1].weight if rows is None else head[-1].weight[rows] for head in heads.heads[:num_heads]]
        self.lm_heads = nn.ParameterList(nn.Parameter(w.detach().clone(), requires_grad=False) for w in weights)
        self.register_buffer("vocab_subset", rows)
        self.top_k = top_k

    def forward(self, hidden):
        logits = torch.cat([nn.functional.linear(block(hidden), w) for block, w in zip(self.blocks, self.lm_heads)], 0)
        values, ids = torch.topk(torch.log_softmax(logits.float(), -1), self.top_k, dim=-1)
        if self.vocab_subset is not None:
            ids = self.vocab_subset[ids]
        return ids, values


class MedusaHeadsExporter(MethodExport):
    """`--medusa DIR`: heads loaded and checked against the target before any graph is written."""

    def __init__(self, heads_dir: Path):
        super().__init__(heads_dir)
        self.heads_dir = self.source
        self.heads: MedusaHeads | None = None

    def check(self, target_cfg: dict, config: MedusaConfig, progress) -> MedusaConfig:
        progress(f"loading Medusa heads from {self.heads_dir}")
        self.heads = load_heads(self.heads_dir, target_cfg["hidden_size"], target_cfg["vocab_size"])
        vocab = self.heads.vocab_size
        choices = min(config.draft_vocab, vocab) if config.draft_vocab else vocab
        if config.top_k > choices:  # a tree's rank past the tokens a head chooses among (an internal error later)
            raise SpecDeployError(f"medusa tree {config.tree_paths.name!r} needs top-{config.top_k} candidates per "
                                  f"head, but its heads choose among {choices} tokens: use a tree whose ranks "
                                  f"are below {choices}")
        if config.heads <= self.heads.num_heads:
            return config
        # Use the heads there are when the tree allows it (config says "at most").
        depth = config.tree_paths.depth
        if depth > self.heads.num_heads:
            raise SpecDeployError(f"medusa tree {config.tree_paths.name!r} is {depth} levels deep but "
                                  f"{self.heads_dir} has {self.heads.num_heads} heads")
        return replace(config, heads=self.heads.num_heads)

    def __call__(self, ctx: dict) -> None:
        config: MedusaConfig = ctx["methods"]["medusa"]
        start = time.perf_counter()
        subset = read_draft_vocab(self.heads_dir, config.draft_vocab, self.heads.vocab_size, "medusa",
                                  ctx["progress"])
        wrapper = MedusaHeadsModule(self.heads, config.heads, config.top_k, subset).eval()
        hidden = self.heads.hidden_size
        out = ctx["out"]
        name = MEDUSA_HEADS_GRAPH
        sample = np.random.default_rng(0).standard_normal((1, hidden)).astype(np.float32)
        export_module(wrapper, [torch.from_numpy(sample)], out / graph_file(name), INPUTS, OUTPUTS,
                      {}, SharedWeights(out, weights_file("medusa"), ctx.get("target_weights", {}).get(PORTABLE, ())))
        ref = {HIDDEN: np.random.default_rng(1).standard_normal((1, hidden)).astype(np.float32)}
        save_reference(out, name, ref, torch_reference(wrapper, ref, INPUTS, OUTPUTS))
        ctx["graphs"][name] = GraphRecord.new(name, TARGET, MEDUSA_HEADS, 1, extra={
            "num_heads": config.heads, "top_k": config.top_k, "num_layers": self.heads.num_layers,
            "source": self.heads.source, "draft_vocab": len(subset) if subset else self.heads.vocab_size})
        ctx["progress"](f"  exported {graph_file(name)} ({config.heads} heads, top-{config.top_k}, tree of "
                        f"{config.verify_tokens} tokens) in {time.perf_counter() - start:.1f}s")

