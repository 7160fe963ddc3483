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

import numpy as np

from ..config import positive_int
from ..errors import SpecDeployError
from ..tree import Tree
from ..tree_files import resolve_tree
from .base import DecodeState, Drafter, Proposal
from .eagle_head import EagleHeadRunner

MODES = ("eagle2", "eagle1")
KEYS = {"mode", "top_k", "depth", "total_tokens", "tree", "tree_paths", "draft_vocab"}


# ---------------------------------------------------------------- config


def validate(params: dict) -> dict:
    unknown = set(params) - KEYS
    if unknown:
        raise SpecDeployError(f"config: unknown eagle settings {sorted(unknown)} (known: {sorted(KEYS - {'tree_paths'})})")
    mode = params.get("mode", "eagle2")
    if mode not in MODES:
        raise SpecDeployError(f"config: eagle.mode must be one of {', '.join(MODES)}, got {mode!r}")
    top_k = positive_int(params.get("top_k", 4), "eagle.top_k")
    depth = positive_int(params.get("depth", 5), "eagle.depth")
    total = positive_int(params.get("total_tokens", 16), "eagle.total_tokens")
    most = top_k + (depth - 1) * top_k * top_k
    if total > most:
        raise SpecDeployError(f"config: eagle.total_tokens {total} exceeds the {most} candidates that top_k {top_k} "
                              f"and depth {depth} produce")
    if top_k > 64:
        raise SpecDeployError(f"config: eagle.top_k must be <= 64, got {top_k}")
    draft_vocab = params.get("draft_vocab", 0)
    if draft_vocab != 0:
        positive_int(draft_vocab, "eagle.draft_vocab (0: the full vocabulary)")
    out = {"mode": mode, "top_k": top_k, "depth": depth, "total_tokens": total, "draft_vocab": draft_vocab}
    spec = params.get("tree")
    if spec is None and mode == "eagle1":
        raise SpecDeployError("config: eagle.mode eagle1 needs eagle.tree (a name in configs/trees/, a .json file "
                              "or a list of paths)")
    if spec is not None:
        # The manifest carries the resolved paths, so the runtime needs no tree files.
        cached = params.get("tree_paths")
        if isinstance(cached, dict) and cached.get("name") == (spec if isinstance(spec, str) else "inline"):
            label, paths = cached["name"], cached["paths"]
        else:
            label, paths = resolve_tree(spec, "eagle.tree")
        Tree.from_paths(paths, max_rank=64)
        out["tree"] = spec if isinstance(spec, str) else [list(p) for p in paths]
        out["tree_paths"] = {"name": label, "paths": [list(p) for p in paths]}
    return out


def shown(params: dict) -> dict:
    """The settings as the user wrote them (the resolved tree paths left out), for messages."""
    return {k: v for k, v in params.items() if k != "tree_paths"}


def static_tree(params: dict) -> Tree | None:
    tp = params.get("tree_paths")
    return Tree.from_paths(tp["paths"]) if tp else None


def verify_tokens(params: dict) -> int:
    p = validate(params)
    return static_tree(p).size if p["mode"] == "eagle1" else p["total_tokens"] + 1


def _expand_sizes(tree: Tree) -> set[int]:
    """Per level of a static tree, how many nodes have children (one head call each)."""
    counts: dict[int, int] = {}
    for node in range(1, tree.size):
        if tree.children[node]:
            counts[int(tree.depth[node])] = counts.get(int(tree.depth[node]), 0) + 1
    return set(counts.values())


def graph_plan(params: dict, prefill_chunk: int) -> dict:
    """Static shapes of the head's graphs for this config (both modes, so either runs).

    catchup: accepted-path sizes (depth + 1 at most) and the prompt chunk;
    expand: nodes expanded per level; top_k: candidates each graph returns per row.
    """
    p = validate(params)
    catchup, expand, top_k = {p["depth"] + 1, prefill_chunk}, {p["top_k"]}, p["top_k"]
    tree = static_tree(p)
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

    def __init__(self, head: EagleHeadRunner, params: dict):
        self.head = head
        self.mode, self.top_k, self.depth, self.total = params["mode"], params["top_k"], params["depth"], params["total_tokens"]
        self.tree = static_tree(params) if self.mode == "eagle1" else None
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
        self.teacher: list[int] | None = None  # tree tuning: the whole greedy output, known in advance
        configured = static_tree(params)
        self.calibration_depth = max(self.depth, int(configured.depth.max()) if configured is not None else 0)
        self.record: list[tuple[int, ...]] = []  # tree tuning: ranks of the true tokens per step

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
        self.head.cache.length = 0

    def update(self, state, proposal, verdict, target_out) -> None:
        self.feats.append(self._features(target_out, verdict.path))

    # -- drafting ----------------------------------------------------------------
    def _catch_up(self, state: DecodeState):
        """Feed pending (token, feature) pairs; returns the last row's output, or None."""
        head = self.head
        feats = np.concatenate(self.feats) if self.feats else np.zeros((0, head.feature_dim), np.float32)
        self.feats = []
        start = head.cache.length
        tokens = np.asarray(state.tokens[start + 1 : start + 1 + len(feats)], dtype=np.int64)
        if len(tokens) != len(feats) or start + len(feats) != len(state.tokens) - 1:
            raise SpecDeployError("EAGLE drafter lost track of the target features (internal error)")
        last = None
        step = head.max_tokens(head.feature_dim)
        for s in range(0, len(tokens), step):
            n = min(step, len(tokens) - s)
            pos = head.cache.length
            last = head.forward(tokens[s : s + n], feats[s : s + n], np.arange(pos, pos + n),
                                np.tril(np.ones((n, n), bool)))
            head.commit(last, slice(0, n))
        return last

    def propose(self, state: DecodeState) -> Proposal:
        head = self.head
        out = self._catch_up(state)
        root = state.tokens[-1]
        if out is None:
            return Proposal.root_only(root)
        committed = head.cache.length
        if self.teacher is not None:
            self._record_ranks(state, out, committed)
        try:
            if self.tree is None:
                return self._grow_dynamic(root, out, committed)
            return self._grow_static(root, out, committed)
        finally:
            head.cache.length = committed  # draft rows are dropped; the next catch-up overwrites them

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
            if not self._room(committed + pool.rows, self.head.graph_for(width, k)):
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
        keep = order[np.lexsort((order, pool.depth[order]))]  # parents before children
        index = np.zeros(n, np.int64)
        index[keep] = np.arange(1, len(keep) + 1)
        parents = np.where(pool.parent[keep] >= 0, index[pool.parent[keep]], 0)
        tokens = np.concatenate([[root], pool.token[keep]]).astype(np.int64)
        return Proposal(Tree((-1, *parents.tolist())), tokens)

    def _grow_static(self, root: int, first, committed: int) -> Proposal:
        tree, width = self.tree, self.head.spec.hidden_size
        rows = sum(len(lv.nodes) for lv in self.levels)
        if not self._room(committed + rows, max((self.head.graph_for(width, len(lv.nodes)) for lv in self.levels),
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

    # -- tree tuning -------------------------------------------------------------
    def _record_ranks(self, state: DecodeState, first, committed: int) -> None:
        """Ranks of the true next tokens in the head's top-k, drafting along the true path."""
        depths = self.calibration_depth
        start = len(state.tokens)
        truth = self.teacher[start : start + depths]
        if len(truth) < depths:
            return
        pool, ranks = _Pool(depths, depths), []
        ids, feat, parent = first.ids[-1], first.hidden[-1:], -1
        try:
            for depth, token in enumerate(truth, start=1):
                hit = np.flatnonzero(ids == token)
                if not len(hit):
                    break
                ranks.append(int(hit[0]))
                if depth == depths or not self._room(committed + pool.rows, 1):
                    break
                node = pool.add([token], parent, 0.0, depth)
                out = self._expand(pool, node, feat, committed)
                ids, feat, parent = out.ids[0], out.hidden[:1], int(node[0])
        finally:
            self.head.cache.length = committed
        self.record.append(tuple(ranks))



def collect_calibration(export, prompts: list[list[int]], max_new_tokens: int):
    """Greedy runs recording, per step, the ranks of the target's actual next tokens in the
    head's top-k along the true path (tree tuning's input for a static EAGLE-1 tree)."""
    from ..generate import Generation
    from ..tree_tuning import AcceptanceStats, Calibration

    params = export.method_params("eagle")
    stats, matched, steps, side_s = None, [], 0, 0.0
    for ids in prompts:
        # The export's own mode drafts; the ranks are recorded along the true path either way.
        plain = Generation(export, ids, method="eagle", max_new_tokens=max_new_tokens, ignore_eos=True)
        plain.result()  # the target's greedy output, and the drafting cost per step
        steps += plain.stats["target_calls"]
        side_s += plain.stats["draft_s"] + plain.stats["host_s"]
        gen = Generation(export, ids, method="eagle", max_new_tokens=max_new_tokens, ignore_eos=True)
        gen.drafter.teacher = plain.state.tokens
        gen.result()
        drafter = gen.drafter
        if stats is None:
            stats = AcceptanceStats.empty(drafter.calibration_depth, drafter.head.top_k)
        for ranks in drafter.record:
            for d, r in enumerate(ranks):
                stats.trials[d] += 1
                stats.hits[d, r] += 1
            if len(ranks) < drafter.calibration_depth:
                stats.trials[len(ranks)] += 1  # tried, and the true token was not among the top-k
            matched.append(ranks)
    current = params["tree_paths"]["paths"] if params.get("tree_paths") else []
    return Calibration(stats, matched, side_s / max(steps, 1), current)
