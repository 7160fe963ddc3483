"""EAGLE drafting: a one-layer head extrapolates the target's features, proposing a token tree.

Pairing (upstream's): head row j reads (token at position j+1, target feature of
position j) at position j and predicts the feature of position j+1, whose logits
rank the tokens of position j+2. The head's KV cache holds one row per committed
pair; after each verification the accepted path's target features go through the
head (catch-up) and are committed by absolute position. The last catch-up row
gives the root's children (depth 1); each deeper level is one head call on the
nodes being expanded, fed their parent's predicted feature, attending to their
ancestors' rows (kept in the cache past the committed length and dropped after).

- eagle2 (dynamic tree, EAGLE-2): expand the `top_k` best nodes of each level by
  cumulative log-probability for `depth` levels, then keep exactly `total_tokens`
  nodes by cumulative log-probability (a parent never scores below its child, so
  the kept set is a tree); the verify call's shape stays static.
- eagle1 (static tree, EAGLE-1): a fixed tree of top-k ranks (`tree`, a name in
  configs/trees/); each level expands the nodes that have children.

Drafts are deterministic top-k candidates, so sampling stays lossless through the
verifier's deterministic-draft rule (runtime/verify.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from ..config import positive_int
from ..errors import SpecDeployError
from ..graph_contract import PORTABLE
from ..tree import Tree
from ..tree_files import TreePaths, config_tree, frozen_paths
from .base import DecodeState, Drafter, Proposal
from .eagle_head import EagleHeadRunner

MODES = ("eagle2", "eagle1")


# ---------------------------------------------------------------- config


@dataclass(frozen=True)
class EagleConfig:
    """Needs an EAGLE head: `specdeploy export --eagle DIR`. Verify T = total_tokens + 1 (eagle2)
    or the static tree's nodes + 1 (eagle1)."""

    method: ClassVar[str] = "eagle"

    mode: str = "eagle2"  # eagle2: dynamic tree per step; eagle1: the static `tree`
    top_k: int = 2  # candidates per expanded node; nodes expanded per level (eagle2)
    depth: int = 6  # draft tree levels (head calls per step); upstream's depth + 1
    # eagle2 nodes kept per step; CPU-sized: every head call reads the head's weights once, so few
    # narrow levels win here
    total_tokens: int = 8
    # eagle2: draft only nodes the head gives at least this path probability, and stop growing
    # once no frontier node reaches it (fewer head calls, a smaller verify call); 0: always
    # total_tokens nodes over depth levels. SmolLM2-135M's head (held-out top-1 0.42), chat/code,
    # 3 prompts x 48 tokens, load ~12: 0.2 at 1.11x/1.14x ar, 0.1 1.10x/1.10x, 0.05 1.08x/0.99x,
    # 0 0.99x/0.94x; the toy family's head is under-confident (0.2 cut its acceptance from >2 to 1.5),
    # so 0 here and 0.1 for trained real-model heads (configs/trained-drafters.yaml). In a fused
    # method it also sizes EAGLE's share of the tree (total_tokens widened to the budget)
    min_prob: float = 0.0
    # draft among the head's N most frequent tokens (its draft_vocab.json; 0: all); the LM head is
    # most of a draft level's cost, verification is unchanged
    draft_vocab: int = 1024
    # eagle1's tree: configs/trees/NAME.json, a .json file or inline paths; None: eagle2 only.
    # `specdeploy tune-tree OUT --method eagle` fits one
    tree: str | tuple | None = "eagle1_mc_sim_7b_63"
    tree_paths: TreePaths | None = field(default=None, metadata={"derived": True})  # `tree` resolved

    def __post_init__(self):
        if self.mode not in MODES:
            raise SpecDeployError(f"config: eagle.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        top_k = positive_int(self.top_k, "eagle.top_k")
        depth = positive_int(self.depth, "eagle.depth")
        total = positive_int(self.total_tokens, "eagle.total_tokens")
        most = top_k + (depth - 1) * top_k * top_k
        if total > most:
            raise SpecDeployError(f"config: eagle.total_tokens {total} exceeds the {most} candidates that top_k "
                                  f"{top_k} and depth {depth} produce")
        if isinstance(self.min_prob, bool) or not isinstance(self.min_prob, (int, float)) or \
                not 0 <= self.min_prob < 1:
            raise SpecDeployError(f"config: eagle.min_prob must be a number in [0, 1), got {self.min_prob!r}")
        if top_k > 64:
            raise SpecDeployError(f"config: eagle.top_k must be <= 64, got {top_k}")
        if self.draft_vocab != 0:
            positive_int(self.draft_vocab, "eagle.draft_vocab (0: the full vocabulary)")
        if self.tree is None:
            if self.mode == "eagle1":
                raise SpecDeployError("config: eagle.mode eagle1 needs eagle.tree (a name in configs/trees/, a .json "
                                      "file or a list of paths)")
            object.__setattr__(self, "tree_paths", None)
            return
        label, paths = config_tree(self.tree, self.tree_paths, "eagle.tree")
        Tree.from_paths(paths, max_rank=64)
        resolved = TreePaths(label, frozen_paths(paths))
        object.__setattr__(self, "tree", self.tree if isinstance(self.tree, str) else resolved.paths)
        object.__setattr__(self, "tree_paths", resolved)

    def static_tree(self) -> Tree | None:
        return self.tree_paths.tree() if self.tree_paths else None

    @property
    def verify_tokens(self) -> int:
        if self.mode == "eagle1":
            assert self.tree_paths is not None  # eagle1 always resolves its tree in __post_init__
            return len(self.tree_paths.paths) + 1
        return self.total_tokens + 1


def build(export, config: EagleConfig) -> EagleDrafter:
    head = export.part("eagle", lambda: EagleHeadRunner(export.manifest, export.backend, export.threads,
                                                        fused=export.flavor != PORTABLE))
    return EagleDrafter(head, config)


def _expand_sizes(tree: Tree) -> set[int]:
    """Per level of a static tree, how many nodes have children (one head call each)."""
    counts: dict[int, int] = {}
    for node in range(1, tree.size):
        if tree.children[node]:
            counts[int(tree.depth[node])] = counts.get(int(tree.depth[node]), 0) + 1
    return set(counts.values())


def graph_plan(config: EagleConfig, prefill_chunk: int) -> dict:
    """Static shapes of the head's graphs for this config (both modes, so either runs).

    catchup: one row (a step that accepted no draft, and what still fits in the context's last
    positions), accepted-path sizes (depth + 1 at most) and the prompt chunk;
    expand: nodes expanded per level; top_k: candidates each graph returns per row.
    """
    catchup, expand, top_k = {1, config.depth + 1, prefill_chunk}, {config.top_k}, config.top_k
    tree = config.static_tree()
    if tree is not None:
        catchup.add(int(tree.depth.max()) + 1)
        expand |= _expand_sizes(tree)
        top_k = max(top_k, max(tree.ranks) + 1)
    return {"catchup": sorted(catchup), "expand": sorted(expand), "top_k": top_k}


# ---------------------------------------------------------------- drafter


class _Pool:
    """Draft nodes grown level by level (token, parent (-1: the root), cumulative log-prob,
    depth), and the expanded ones: their rows in the head's draft region and, per row,
    the rows it attends to (its expanded ancestors and itself)."""

    def __init__(self, capacity: int, max_rows: int):
        self.token = np.zeros(capacity, np.int64)
        self.parent = np.full(capacity, -1, np.int64)
        self.score = np.zeros(capacity)
        self.depth = np.zeros(capacity, np.int64)
        self.row = np.full(capacity, -1, np.int64)
        self.sees = np.zeros((max_rows, max_rows), bool)
        self.n = self.rows = 0

    def add(self, tokens, parents, scores, depth: int) -> np.ndarray:
        idx = np.arange(self.n, self.n + len(tokens))
        self.token[idx], self.parent[idx], self.score[idx], self.depth[idx] = tokens, parents, scores, depth
        self.n += len(tokens)
        return idx

    def mask(self, nodes: np.ndarray) -> np.ndarray:
        """[n, D + n]: each node sees its expanded ancestors' rows and itself."""
        d, n = self.rows, len(nodes)
        m = np.zeros((n, d + n), bool)
        parents = self.parent[nodes]
        has = parents >= 0
        m[has, :d] = self.sees[self.row[parents[has]], :d]
        m[np.arange(n), d + np.arange(n)] = True
        return m

    def expanded(self, nodes: np.ndarray, mask: np.ndarray) -> None:
        d, n = self.rows, len(nodes)
        self.row[nodes] = d + np.arange(n)
        self.sees[d : d + n, : d + n] = mask
        self.rows += n


class _StaticLevel:
    """One head call of a static tree: the nodes it expands and where their children come from."""

    def __init__(self, tree: Tree, level: int, rows: dict[int, int]):
        self.nodes = np.array([n for n in range(1, tree.size) if tree.depth[n] == level and tree.children[n]])
        d = len(rows)
        self.mask = np.zeros((len(self.nodes), d + len(self.nodes)), bool)
        for i, node in enumerate(self.nodes):
            for anc in tree.path_to(int(node))[1:-1]:
                self.mask[i, rows[anc]] = True
            self.mask[i, d + i] = True
        rows.update({int(node): d + i for i, node in enumerate(self.nodes)})
        kids = [(c, i) for i, node in enumerate(self.nodes) for c in tree.children[node]]
        self.children = np.array([c for c, _ in kids], np.int64)
        self.source = np.array([i for _, i in kids], np.int64)  # which row of this call
        self.ranks = np.array([tree.ranks[c] for c, _ in kids], np.int64)


class EagleDrafter(Drafter):
    name = "eagle"
    deterministic = True

    def __init__(self, head: EagleHeadRunner, config: EagleConfig):
        self.head = head
        self.mode, self.top_k, self.depth, self.total = config.mode, config.top_k, config.depth, config.total_tokens
        self.min_score = np.log(config.min_prob) if config.min_prob > 0 else -np.inf  # cumulative log-prob
        self.tree = config.static_tree() if self.mode == "eagle1" else None
        self.levels: list[_StaticLevel] = []  # eagle1: one head call per level, masks precomputed
        if self.tree is not None:
            rows: dict[int, int] = {}
            for level in range(1, int(self.tree.depth.max())):
                lv = _StaticLevel(self.tree, level, rows)
                if len(lv.nodes):
                    self.levels.append(lv)
        need_k = self.top_k if self.tree is None else max(self.tree.ranks) + 1
        if need_k > head.top_k:
            raise SpecDeployError(f"method 'eagle' needs the head's top {need_k} candidates; this export's graphs "
                                  f"return {head.top_k} (re-export with this config)")
        self.feature_key = "features" if head.version == 3 else "hidden"
        self.feats: list[np.ndarray] = []  # target features not yet fed to the head, in position order

    # -- target features in ---------------------------------------------------
    def prefilled(self, out) -> None:
        self.feats.append(self._features(out, slice(None)))

    def _features(self, out, rows) -> np.ndarray:
        f = getattr(out, self.feature_key)
        if f is None:
            raise SpecDeployError("the EAGLE-3 head needs the target's layer features; this export's target graphs "
                                  "do not output them (re-export with --eagle)")
        return f[rows]

    def start(self, state: DecodeState) -> None:
        self.head.reset()

    def update(self, state, proposal, verdict, target_out) -> None:
        self.feats.append(self._features(target_out, verdict.path))

    # -- drafting ----------------------------------------------------------------
    def catch_up(self, state: DecodeState):
        """Feed pending (token, feature) pairs; returns the last row's output, or None (nothing
        pending, or no head graph fits the context's last positions: no draft this step)."""
        head = self.head
        feats = np.concatenate(self.feats) if self.feats else np.zeros((0, head.feature_dim), np.float32)
        self.feats = []
        start = head.cache.length
        tokens = np.asarray(state.tokens[start + 1 : start + 1 + len(feats)], dtype=np.int64)
        if len(tokens) != len(feats) or start + len(feats) != len(state.tokens) - 1:
            raise SpecDeployError("EAGLE drafter lost track of the target features (internal error)")
        sizes, last, s = head.sizes_by_width[head.feature_dim], None, 0
        while s < len(tokens):
            call = head.fit(len(tokens) - s, sizes)  # near the context end: smaller graphs, fewer rows
            if call is None:  # not even the smallest fits: the rest stays pending, nothing is drafted
                self.feats = [feats[s:]]
                return None
            n, pos = call[0], head.cache.length
            last = head.forward(tokens[s : s + n], feats[s : s + n], np.arange(pos, pos + n),
                                np.tril(np.ones((n, n), bool)))
            head.commit(last, slice(0, n))
            s += n
        return last

    def propose(self, state: DecodeState) -> Proposal:
        return self.draft(state, self.catch_up(state))

    def draft(self, state: DecodeState, out) -> Proposal:
        """The tree grown from the catch-up's last row (`out`; None: nothing to draft from)."""
        head = self.head
        root = state.tokens[-1]
        if out is None:
            return Proposal.root_only(root)
        committed = head.cache.length
        try:
            if self.tree is None:
                return self._grow_dynamic(root, out, committed)
            return self._grow_static(root, out, committed)
        finally:
            head.rewind(committed)  # draft rows are dropped; the next catch-up overwrites them

    def _room(self, committed: int, rows: int) -> bool:
        return committed + rows <= self.head.max_context

    def _expand(self, pool: _Pool, nodes: np.ndarray, feats: np.ndarray, committed: int):
        """One head call on `nodes`; their rows stay in the cache for deeper levels."""
        mask = pool.mask(nodes)
        out = self.head.forward(pool.token[nodes], feats, committed + pool.depth[nodes] - 1, mask)
        pool.expanded(nodes, mask)
        self.head.commit(out, slice(0, len(nodes)))
        return out

    def _grow_dynamic(self, root: int, first, committed: int) -> Proposal:
        k, width = self.top_k, self.head.spec.hidden_size
        pool = _Pool(k + (self.depth - 1) * k * k, max((self.depth - 1) * k, 1))
        frontier = pool.add(first.ids[-1, :k], -1, np.minimum(first.logprobs[-1, :k], 0.0), 1)
        feats = np.repeat(first.hidden[-1:], k, axis=0)
        for level in range(2, self.depth + 1):
            if pool.score[frontier].max() < self.min_score:
                break  # every deeper node would score lower still: none would be kept
            if not self._room(committed + pool.rows, self.head.graph_for(k, width)):
                break
            out = self._expand(pool, frontier, feats, committed)
            scores = pool.score[frontier][:, None] + np.minimum(out.logprobs[:, :k], 0.0)
            children = pool.add(out.ids[:, :k].ravel(), np.repeat(frontier, k), scores.ravel(), level)
            # The best k of this level are expanded next, each fed its parent's predicted feature.
            best = np.argsort(-scores.ravel(), kind="stable")[:k]
            frontier, feats = children[best], out.hidden[best // k]
        # Keep the total_tokens best; ties go to the shallower (earlier) node, so a parent
        # (never scored below its child) is always kept before it: the kept set is a tree.
        n = pool.n
        order = np.lexsort((np.arange(n), pool.depth[:n], -pool.score[:n]))[: self.total]
        order = order[pool.score[order] >= self.min_score]  # a prefix of the order: still a tree
        if not len(order):
            return Proposal.root_only(root)
        keep = order[np.lexsort((order, pool.depth[order]))]  # parents before children
        index = np.zeros(n, np.int64)
        index[keep] = np.arange(1, len(keep) + 1)
        parents = np.where(pool.parent[keep] >= 0, index[pool.parent[keep]], 0)
        tokens = np.concatenate([[root], pool.token[keep]]).astype(np.int64)
        return Proposal(Tree((-1, *parents.tolist())), tokens)

    def _grow_static(self, root: int, first, committed: int) -> Proposal:
        tree, width = self.tree, self.head.spec.hidden_size
        assert tree is not None  # only eagle1 grows a static tree
        rows = sum(len(lv.nodes) for lv in self.levels)
        if not self._room(committed + rows, max((self.head.graph_for(len(lv.nodes), width) for lv in self.levels),
                                                default=0)):
            return Proposal.root_only(root)
        tokens = np.empty(tree.size, np.int64)
        tokens[0] = root
        level1 = np.array(tree.children[0], np.int64)
        tokens[level1] = first.ids[-1, np.asarray(tree.ranks)[level1]]
        feat_in = np.empty((tree.size, first.hidden.shape[1]), np.float32)  # each node's parent's predicted feature
        feat_in[level1] = first.hidden[-1]
        for depth, lv in enumerate(self.levels, start=1):
            out = self.head.forward(tokens[lv.nodes], feat_in[lv.nodes], np.full(len(lv.nodes), committed + depth - 1),
                                    lv.mask)
            self.head.commit(out, slice(0, len(lv.nodes)))
            tokens[lv.children] = out.ids[lv.source, lv.ranks]
            feat_in[lv.children] = out.hidden[lv.source]
        return Proposal(tree, tokens)
