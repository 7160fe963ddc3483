"""Which draft nodes are worth their verify rows: one rule for one drafter's tree or several merged.

A node is worth the chance that the target's path runs through it: its parent's worth times its
drafter's measured chance that a child of its rank (its place among its siblings, likeliest first)
is the target's next token where the parent is (`RankAcceptance`, measured in this request on the
drafter's own proposals, as drafters/draft_length.py measures a chain's acceptance), and at most
what the parent's earlier-placed children left of it: the paths are exclusive, so beside a
confident sibling (another drafter's copy) a guess is worth only the sibling's miss rate. Nodes go
in best first while worth at least `row_cost` (a verify row's cost in decode steps) and the budget
lasts; a candidate two drafters propose is one node. Suffix decoding merges its one tree with
`row_cost` 0 and verifies the best-first prefix that maximizes tokens per second
(drafters/step_costs.py), as prompt lookup sizes its chain.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from ..tree import Tree
from .base import Proposal
from .draft_length import DECAY, PRIOR_RATE, PRIOR_RUN, PRIOR_WEIGHT

RANKS = 4  # siblings of rank 3 and later share one estimate


class RankAcceptance:
    """A drafter's chance that its child of rank r is on the target's path where the parent is.

    Counted on every node of its proposal the committed tokens walked through that has children: each
    child's rank was offered once, the one the target took (if any) hit; decayed per step as a chain's
    rates are (drafters/draft_length.py). Before any step (the prior): PRIOR_RATE^(1 + r), a chain's
    geometric guess for a sibling list whose first is likeliest; measured, a bushy tree's later ranks
    are worth what they are taken, not what the first one is.

    With `kinds` and `depths` (suffix decoding) the root's children are counted per kind of proposal
    (how long a context match it continues) and deeper nodes per depth (2, ..., `depths` and deeper),
    as a chain's are: acceptance comes in runs, so a node below a taken one is taken far more often than
    the root's (prior PRIOR_RUN x PRIOR_RATE^r there). A step decays its kind's and the deeper levels'
    counts. One level (the default) is a fused method's per-part count."""

    def __init__(self, kinds: int = 1, depths: int = 1):
        self.kinds, self.depths = kinds, depths
        first = [PRIOR_RATE ** (1 + r) for r in range(RANKS)]
        deeper = [PRIOR_RUN * PRIOR_RATE ** r for r in range(RANKS)]
        self.hits = [[p * PRIOR_WEIGHT for p in first] for _ in range(kinds)] + \
            [[p * PRIOR_WEIGHT for p in deeper] for _ in range(depths - 1)]
        self.offered = [[PRIOR_WEIGHT] * RANKS for _ in range(kinds + depths - 1)]

    def _level(self, depth: int, kind: int) -> int:
        """The counts of a node at `depth` (1: the root's children) of a proposal of `kind`."""
        return kind if depth <= 1 or self.depths == 1 else self.kinds + min(depth, self.depths) - 2

    def at(self, rank: int, depth: int = 1, kind: int = 0) -> float:
        level, r = self._level(depth, kind), min(rank, RANKS - 1)
        return self.hits[level][r] / self.offered[level][r]

    def observe(self, tree: Tree, tokens: np.ndarray, committed: Sequence[int], kind: int = 0) -> None:
        """One verified step of a proposal (`tree`, `tokens`) of `kind` and the tokens committed after its root."""
        for level in [kind] + list(range(self.kinds, self.kinds + self.depths - 1)):
            self.hits[level] = [DECAY * h for h in self.hits[level]]
            self.offered[level] = [DECAY * o for o in self.offered[level]]
        node, depth = 0, 1
        for tok in committed:
            kids = tree.children[node]
            hits, offered = self.hits[self._level(depth, kind)], self.offered[self._level(depth, kind)]
            for r in range(len(kids)):
                offered[min(r, RANKS - 1)] += 1.0
            rank = next((r for r, c in enumerate(kids) if tokens[c] == tok), -1)
            if rank < 0:
                break
            hits[min(rank, RANKS - 1)] += 1.0
            node, depth = kids[rank], depth + 1


class MergedTree:
    """One trie under the root, grown from several parts' nodes; a node two parts propose is one node."""

    def __init__(self, root: int, budget: int):
        self.parents, self.tokens, self.budget = [-1], [int(root)], budget
        self.worth = [1.0]  # per node: the chance the target's path runs through it (placed best first)
        self._child: dict[tuple[int, int], int] = {}

    @property
    def full(self) -> bool:
        return len(self.tokens) - 1 >= self.budget

    def find(self, parent: int, token: int) -> int | None:
        """The merged node of `token` under merged node `parent`, if there is one."""
        return self._child.get((parent, token))

    def add(self, parent: int, token: int) -> int | None:
        """The merged node of `token` under merged node `parent` (made if new and the budget allows)."""
        node = self._child.get((parent, token))
        if node is None and not self.full:
            node = self._child[(parent, token)] = len(self.tokens)
            self.parents.append(parent)
            self.tokens.append(token)
        return node

    def proposal(self, drafts: int | None = None) -> Proposal:
        """The tree, or its first `drafts` nodes placed (best first, each after its parent: still a tree)."""
        n = len(self.tokens) - 1 if drafts is None else min(drafts, len(self.tokens) - 1)
        parents = self.parents[: n + 1]
        chain = parents == list(range(-1, n))
        tokens = np.array(self.tokens[: n + 1], dtype=np.int64)
        return Proposal(Tree.chain(n) if chain else Tree(tuple(parents)), tokens)


class PartProposal:
    """One part's proposal this step (of `kind`: RankAcceptance) and where its placed nodes went in the merged tree."""

    def __init__(self, proposal: Proposal, kind: int = 0):
        self.proposal, self.kind = proposal, kind
        self.merged: dict[int, int] = {0: 0}


def merge(parts: list[PartProposal], rates: list[RankAcceptance], budget: int, row_cost: float,
          root: int) -> MergedTree:
    """The parts' nodes worth a verify row, best first, in one trie of at most `budget` candidates.

    A node's worth is the chance the target's path runs through it: its merged parent's worth times
    its part's measured acceptance at its rank among its siblings, at most what the
    parent's earlier-placed children left (the paths are exclusive). A node both parts propose is one
    node (its worth the larger). Every node comes after its parent (a child is worth no more)."""
    merged = MergedTree(root, budget)
    worth, left = merged.worth, [1.0]  # per merged node: its worth, and the worth its children may still take
    heap: list[tuple[float, int, int, int]] = []  # (-worth, part, node, parent's merged node)

    def offer(i: int, node: int) -> None:
        tree, at, kind = parts[i].proposal.tree, parts[i].merged[node], parts[i].kind
        for rank, child in enumerate(tree.children[node]):
            heapq.heappush(heap, (-worth[at] * rates[i].at(rank, int(tree.depth[child]), kind), i, child, at))

    for i in range(len(parts)):
        offer(i, 0)
    while heap:
        w, i, node, parent = heapq.heappop(heap)
        token = int(parts[i].proposal.tokens[node])
        known = merged.find(parent, token)
        if known is None:
            if left[parent] < -w:  # siblings placed since it was offered took part of its parent's worth
                heapq.heappush(heap, (-left[parent], i, node, parent))
                continue
            w = -w
            if w < row_cost or merged.full:
                continue  # not worth a row, or the budget is full (a node both propose is still free)
            known = merged.add(parent, token)
            assert known is not None
            worth.append(w)
            left.append(w)
            left[parent] -= w
        elif -w > worth[known]:  # proposed by both: the larger worth, within what its parent has
            gain = min(-w, worth[known] + left[parent]) - worth[known]
            worth[known] += gain
            left[known] += gain
            left[parent] -= gain
        parts[i].merged[node] = known
        offer(i, node)
    return merged


def walked(tree: Tree, tokens: np.ndarray, committed: Sequence[int]) -> tuple[int, bool]:
    """How many of the committed tokens (after the root) the tree proposes as a path from its root, and
    whether it proposed something there that the target rejected (the walk's last node has children)."""
    node, n = 0, 0
    for tok in committed:
        child = next((c for c in tree.children[node] if tokens[c] == tok), -1)
        if child < 0:
            break
        node, n = child, n + 1
    return n, bool(tree.children[node])
