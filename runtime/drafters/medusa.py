"""Medusa (Medusa-1 heads on a frozen target): a static tree filled from the heads' top-k.

The heads read the target's final hidden state of the last accepted node (the
position that produced the root) and rank candidates for the next `heads` tokens:
head d-1 for depth d. As in FasterDecoding/Medusa, a node's token depends only on
its depth and rank (per-depth candidates, independent of the parent), so filling
the tree is one gather. The generator prefills prompt[:-1] and the root is the last
prompt token, so the prefill's last row is the position that produced the root: its
hidden state drafts the first step (a one-token prompt has no prefill, and its
first step is a plain one).

Drafts are deterministic top-k candidates: greedy verification is exact and
sampling stays lossless through the verifier's deterministic-draft rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from ..backends.ort import OrtGraph
from ..config import positive_int
from ..errors import SpecDeployError
from ..graph_contract import HIDDEN, MEDUSA_HEADS, TOPK_IDS, TOPK_LOGPROBS
from ..tree import Tree
from ..tree_files import TreePaths, config_tree, frozen_paths
from .base import DecodeState, Drafter, Proposal


@dataclass(frozen=True)
class MedusaConfig:
    """Needs Medusa heads: `specdeploy export --medusa DIR [--tree NAME|FILE]`; verify T = the tree's nodes + 1."""

    method: ClassVar[str] = "medusa"

    heads: int = 4  # heads used (at most); the tree's depth may not exceed it
    # configs/trees/NAME.json, a .json file, or inline paths; cpu_8 measured fastest of the named
    # trees on the default family (2-core CPU); `specdeploy tune-tree` fits one to your export and backend
    tree: str | tuple = "medusa_cpu_8"
    top_k: int | None = None  # candidates each head returns; None: the tree's largest rank + 1
    # heads' LM heads keep the N most frequent tokens (their draft_vocab.json; 0: all): 4 full LM heads
    # are ~4/5 of a Medusa step's draft cost on a CPU; verification unchanged
    draft_vocab: int = 1024
    tree_paths: TreePaths | None = field(default=None, metadata={"derived": True})  # `tree` resolved

    def __post_init__(self):
        heads = positive_int(self.heads, "medusa.heads")
        label, paths = config_tree(self.tree, self.tree_paths, "medusa.tree")
        try:
            Tree.from_paths(paths, max_depth=heads)
        except SpecDeployError as exc:
            raise SpecDeployError(f"config: medusa.tree {label!r} ({len(paths) if isinstance(paths, list) else '?'} "
                                  f"paths, {heads} heads): {exc}") from None
        need = max(max(p) for p in paths) + 1
        top_k = need if self.top_k is None else positive_int(self.top_k, "medusa.top_k")
        if top_k < need:
            raise SpecDeployError(f"config: medusa.tree {label!r} uses rank {need - 1}, so it needs top_k >= {need}, "
                                  f"but medusa.top_k is {top_k} (an export's heads graph returns exactly top_k "
                                  "candidates per head: re-export with this tree)")
        if self.draft_vocab != 0:
            positive_int(self.draft_vocab, "medusa.draft_vocab (0: the full vocabulary)")
            if self.draft_vocab < top_k:
                raise SpecDeployError(f"config: medusa.draft_vocab {self.draft_vocab} is smaller than top_k {top_k}")
        resolved = TreePaths(label, frozen_paths(paths))
        object.__setattr__(self, "tree", self.tree if isinstance(self.tree, str) else resolved.paths)
        object.__setattr__(self, "top_k", top_k)
        object.__setattr__(self, "tree_paths", resolved)

    @property
    def resolved(self) -> TreePaths:
        """The tree `__post_init__` resolved (always set once the config exists)."""
        assert self.tree_paths is not None
        return self.tree_paths

    @property
    def verify_tokens(self) -> int:
        return len(self.resolved.paths) + 1


def build(export, config: MedusaConfig) -> MedusaDrafter:
    heads = export.part("medusa", lambda: MedusaHeadsGraph(export))
    return MedusaDrafter(heads, config)


class MedusaHeadsGraph:
    """The exported heads graph: hidden [1, H] -> topk_ids / topk_logprobs [num_heads, top_k]."""

    def __init__(self, export):
        found = export.manifest.graphs_of(MEDUSA_HEADS)
        if not found:
            raise SpecDeployError("method 'medusa' needs Medusa heads: export with --medusa DIR")
        spec = found[0]
        self.num_heads = int(spec.extra.get("num_heads", 0))
        self.top_k = int(spec.extra.get("top_k", 0))
        self.graph = OrtGraph(export.manifest.graph_path(spec), export.backend, export.threads)

    def __call__(self, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out = self.graph.run({HIDDEN: np.ascontiguousarray(hidden, dtype=np.float32).reshape(1, -1)})
        return out[TOPK_IDS], out[TOPK_LOGPROBS]


class MedusaDrafter(Drafter):
    name = "medusa"

    def __init__(self, heads: MedusaHeadsGraph, config: MedusaConfig):
        self.heads = heads
        self.tree = config.resolved.tree()
        depth = int(self.tree.depth.max())
        if depth > heads.num_heads or config.top_k > heads.top_k:
            raise SpecDeployError(
                f"medusa tree {config.resolved.name!r} needs {depth} heads and top-{config.top_k} "
                f"candidates; this export's heads graph has {heads.num_heads} heads and top-{heads.top_k} "
                "(re-export with this tree)")
        # Node i's token is candidate ranks[i] of head depth[i] - 1.
        self.node_head = self.tree.depth[1:] - 1
        self.node_rank = np.asarray(self.tree.ranks[1:], dtype=np.int64)
        self.hidden: np.ndarray | None = None

    def prefilled(self, target_out) -> None:
        # The last chunk's last row (prompt[-2]) produced the root; a drafter lives one request.
        self.hidden = np.array(target_out.hidden[-1], dtype=np.float32)

    def propose(self, state: DecodeState) -> Proposal:
        root = state.tokens[-1]
        if self.hidden is None:
            return Proposal.root_only(root)
        ids, _ = self.heads(self.hidden)
        tokens = np.empty(self.tree.size, dtype=np.int64)
        tokens[0] = root
        tokens[1:] = ids[self.node_head, self.node_rank]
        return Proposal(self.tree, tokens)

    def update(self, state, proposal, verdict, target_out) -> None:
        # The last accepted node produced the new root: its hidden state drafts the next tree.
        self.hidden = np.array(target_out.hidden[verdict.path[-1]], dtype=np.float32)
