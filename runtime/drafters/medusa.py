"""Medusa (Medusa-1 heads on a frozen target): a static tree filled from the heads' top-k.

The heads read the target's final hidden state of the last accepted node (the
position that produced the root) and rank candidates for the next `heads` tokens:
head d-1 for depth d. As in FasterDecoding/Medusa, a node's token depends only on
its depth and rank (per-depth candidates, independent of the parent), so filling
the tree is one gather. The generator prefills prompt[:-1] and the root is the last
prompt token, so the first step has no hidden state yet: it is a plain step, and
its hidden state starts the drafting.

Drafts are deterministic top-k candidates: greedy verification is exact and
sampling stays lossless through the verifier's deterministic-draft rule.
"""

from __future__ import annotations

import numpy as np

from ..backends import OrtGraph
from ..config import positive_int
from ..errors import SpecDeployError
from ..tree import Tree
from ..tree_files import resolve_tree
from .base import DecodeState, Drafter, Proposal

KEYS = {"heads", "tree", "top_k", "tree_paths", "draft_vocab"}
GRAPH_KIND = "medusa_heads"


def validate(params: dict) -> dict:
    """{heads, tree, top_k, tree_paths}; tree_paths carries the resolved paths (the manifest keeps them)."""
    unknown = set(params) - KEYS
    if unknown:
        raise SpecDeployError(f"config: unknown medusa settings {sorted(unknown)} (known: heads, tree, top_k, "
                              "draft_vocab)")
    heads = positive_int(params.get("heads", 4), "medusa.heads")
    spec = params.get("tree", "medusa_cpu_8")
    cached = params.get("tree_paths")
    if isinstance(spec, str) and isinstance(cached, dict) and cached.get("name") == spec:
        label, paths = spec, cached["paths"]
    else:
        label, paths = resolve_tree(spec, "medusa.tree")
    try:
        Tree.from_paths(paths, max_depth=heads)
    except SpecDeployError as exc:
        raise SpecDeployError(f"config: medusa.tree {label!r} ({len(paths) if isinstance(paths, list) else '?'} paths, "
                              f"{heads} heads): {exc}") from None
    need = max(max(p) for p in paths) + 1
    top_k = params.get("top_k")
    top_k = need if top_k is None else positive_int(top_k, "medusa.top_k")
    if top_k < need:
        raise SpecDeployError(f"config: medusa.tree {label!r} uses rank {need - 1}, so it needs top_k >= {need}, "
                              f"but medusa.top_k is {top_k} (an export's heads graph returns exactly top_k "
                              "candidates per head: re-export with this tree)")
    draft_vocab = params.get("draft_vocab", 0)
    if draft_vocab != 0:
        positive_int(draft_vocab, "medusa.draft_vocab (0: the full vocabulary)")
        if draft_vocab < top_k:
            raise SpecDeployError(f"config: medusa.draft_vocab {draft_vocab} is smaller than top_k {top_k}")
    return {"heads": heads, "tree": spec if isinstance(spec, str) else [list(p) for p in paths], "top_k": top_k,
            "draft_vocab": draft_vocab, "tree_paths": {"name": label, "paths": [list(p) for p in paths]}}


def shown(params: dict) -> dict:
    """The settings as the user wrote them (resolved paths left out), for messages."""
    return {k: v for k, v in params.items() if k != "tree_paths"}


def static_tree(params: dict) -> Tree:
    return Tree.from_paths(params["tree_paths"]["paths"])


def verify_tokens(params: dict) -> int:
    return static_tree(validate(params)).size


class MedusaHeadsGraph:
    """The exported heads graph: hidden [1, H] -> topk_ids / topk_logprobs [num_heads, top_k]."""

    def __init__(self, export):
        found = [g for g in export.manifest.graphs.values() if g.kind == GRAPH_KIND]
        if not found:
            raise SpecDeployError("method 'medusa' needs Medusa heads: export with --medusa DIR")
        spec = found[0]
        self.num_heads = int(spec.extra.get("num_heads", 0))
        self.top_k = int(spec.extra.get("top_k", 0))
        self.graph = OrtGraph(export.manifest.graph_path(spec), export.backend, export.threads)

    def __call__(self, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out = self.graph.run({"hidden": np.ascontiguousarray(hidden, dtype=np.float32).reshape(1, -1)})
        return out["topk_ids"], out["topk_logprobs"]


class MedusaDrafter(Drafter):
    name = "medusa"

    def __init__(self, heads: MedusaHeadsGraph, params: dict):
        self.heads = heads
        self.tree = static_tree(params)
        depth = int(self.tree.depth.max())
        if depth > heads.num_heads or params["top_k"] > heads.top_k:
            raise SpecDeployError(
                f"medusa tree {params['tree_paths']['name']!r} needs {depth} heads and top-{params['top_k']} "
                f"candidates; this export's heads graph has {heads.num_heads} heads and top-{heads.top_k} "
                "(re-export with this tree)")
        # Node i's token is candidate ranks[i] of head depth[i] - 1.
        self.node_head = self.tree.depth[1:] - 1
        self.node_rank = np.asarray(self.tree.ranks[1:], dtype=np.int64)
        self.hidden: np.ndarray | None = None
        self.record: list | None = None  # tree tuning: (sequence index, candidates) per accepted node

    def start(self, state: DecodeState) -> None:
        self.hidden = None

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
        if self.record is not None:
            # Every accepted node's hidden state is that sequence position's: record what the
            # heads would propose there (tree tuning compares it with what followed).
            first = len(state.tokens) - len(verdict.path) - 1  # sequence index of the root
            for j, node in enumerate(verdict.path):
                ids, _ = self.heads(target_out.hidden[node])
                self.record.append((first + j, ids.copy()))


def collect_calibration(export, prompts: list[list[int]], max_new_tokens: int):
    """Greedy runs of the export's own Medusa method, recording at every committed position
    which rank of each head held the target's actual token (tree tuning's input)."""
    from ..generate import Generation
    from ..tree_tuning import AcceptanceStats, Calibration

    params = export.method_params("medusa")
    heads = export.part("medusa", lambda: MedusaHeadsGraph(export))
    stats = AcceptanceStats.empty(heads.num_heads, heads.top_k)
    matched, steps, side_s = [], 0, 0.0
    for ids in prompts:
        gen = Generation(export, ids, method="medusa", max_new_tokens=max_new_tokens, ignore_eos=True)
        gen.drafter.record = []
        gen.result()
        tokens = gen.state.tokens
        for index, cand in gen.drafter.record:
            if index + heads.num_heads + 1 >= len(tokens):
                continue  # not every depth observable near the end
            ranks: list[int] = []
            for d in range(heads.num_heads):
                stats.trials[d] += 1
                hit = np.flatnonzero(cand[d] == tokens[index + d + 2])
                if not len(hit):
                    break
                stats.hits[d, hit[0]] += 1
                ranks.append(int(hit[0]))
            matched.append(tuple(ranks))
        # Side costs from a plain run (recording runs the heads once per accepted node).
        plain = Generation(export, ids, method="medusa", max_new_tokens=max_new_tokens, ignore_eos=True)
        plain.result()
        steps += plain.stats["target_calls"]
        side_s += plain.stats["draft_s"] + plain.stats["host_s"]
    return Calibration(stats, matched, side_s / max(steps, 1), params["tree_paths"]["paths"])
