"""Which draft nodes are worth their verify rows: one rule for one drafter's tree or several merged.

A node is worth the chance that the target's path runs through it: its parent's worth times its
drafter's measured chance that a child of its rank (its place among its siblings, likeliest first)
is the target's next token where the parent is (`RankAcceptance`, drafters/acceptance.py, measured
in this request on the drafter's own proposals), and at most what the parent's earlier-placed
children left of it: the paths are exclusive, so beside a
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
from .acceptance import RankAcceptance
from .base import Proposal


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
