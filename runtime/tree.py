"""The one draft-tree representation shared by every method.

Node 0 is the root: the last committed token, not yet in the target's KV cache.
Nodes 1..n are candidates; `parents[i] < i`. A chain (draft model, prompt lookup)
is a tree whose parents are 0, 1, 2, ...  Built once per static tree (Medusa,
EAGLE-1) from the published list-of-paths format, or per step for dynamic trees.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache

import numpy as np

from .errors import SpecDeployError


def _is_rank(r) -> bool:
    """A top-k rank: an int, and not a bool (True is an int)."""
    return isinstance(r, int) and not isinstance(r, bool)


@dataclass(frozen=True)
class Tree:
    parents: tuple[int, ...]  # parents[0] == -1
    ranks: tuple[int, ...] = field(default=())  # top-k rank of each node under its parent (static trees)

    def __post_init__(self):
        if not self.parents or self.parents[0] != -1:
            raise SpecDeployError("tree: node 0 must be the root (parent -1)")
        for i, p in enumerate(self.parents[1:], start=1):
            if not 0 <= p < i:
                raise SpecDeployError(f"tree: node {i} has parent {p}; parents must precede their children")

    @property
    def size(self) -> int:
        """Nodes including the root: the token count of the verify call."""
        return len(self.parents)

    @cached_property
    def depth(self) -> np.ndarray:
        d = np.zeros(self.size, dtype=np.int64)
        for i in range(1, self.size):
            d[i] = d[self.parents[i]] + 1
        return d

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        kids: list[list[int]] = [[] for _ in range(self.size)]
        for i in range(1, self.size):
            kids[self.parents[i]].append(i)
        return tuple(tuple(k) for k in kids)

    @cached_property
    def mask(self) -> np.ndarray:
        """[size, size] bool: row i sees its ancestors and itself."""
        m = np.zeros((self.size, self.size), dtype=bool)
        for i in range(self.size):
            m[i, i] = True
            if i:
                m[i] |= m[self.parents[i]]
        return m

    @cached_property
    def chain_rows(self) -> int:
        """Nodes 0..k-1 form the tree's leading chain (parents[i] == i - 1): their rows see their
        ancestors as one contiguous run from the root, exactly as in sequential decoding."""
        k = 1
        while k < self.size and self.parents[k] == k - 1:
            k += 1
        return k

    @cached_property
    def preorder(self) -> tuple[int, ...]:
        """Node ids in depth-first order, children in id order: the first-listed (drafters list
        their likeliest first) child of each node on the leading chain follows it directly."""
        order, stack = [], [0]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(reversed(self.children[node]))
        return tuple(order)

    def reordered(self, order) -> "Tree":
        """The same tree with node order[r] as node r (order: a preorder, so parents precede)."""
        where = {node: r for r, node in enumerate(order)}
        ranks = tuple(self.ranks[n] for n in order) if self.ranks else ()
        return Tree(parents=tuple(-1 if n == 0 else where[self.parents[n]] for n in order), ranks=ranks)

    def path_to(self, node: int) -> list[int]:
        path = []
        while node != -1:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    @cached_property
    def leaf_paths(self) -> list[list[int]]:
        """Retrieve indices: one root-to-leaf path of node ids per leaf."""
        return [self.path_to(i) for i in range(self.size) if not self.children[i]]

    @staticmethod
    @lru_cache(maxsize=256)
    def chain(n: int) -> "Tree":
        """A chain of n candidates after the root; shared instances (trees are immutable), so
        their depth / children / mask are computed once, not on every decode step."""
        return Tree(parents=tuple(range(-1, n)), ranks=(0,) * (n + 1))

    @staticmethod
    def from_paths(paths: list[list[int]], max_rank: int | None = None, max_depth: int | None = None,
                   max_size: int | None = None) -> "Tree":
        """Medusa's `medusa_choices` format: each path lists top-k ranks per depth.

        Validated: every path's prefix is also a path (prefix-closed), ranks are
        non-negative (and < max_rank when given), no duplicates; when given, depth
        <= max_depth (e.g. Medusa heads) and nodes incl. the root <= max_size (graph T).
        """
        if not isinstance(paths, list) or not paths:
            raise SpecDeployError("tree: expected a non-empty list of paths (lists of top-k ranks)")
        seen: set[tuple[int, ...]] = set()
        for path in paths:
            if not isinstance(path, (list, tuple)) or not path or not all(_is_rank(r) for r in path):
                raise SpecDeployError(f"tree: path {path!r} is not a non-empty list of integer ranks")
            if any(r < 0 or (max_rank is not None and r >= max_rank) for r in path):
                raise SpecDeployError(f"tree: path {list(path)} has a rank outside [0, {max_rank})")
            if max_depth is not None and len(path) > max_depth:
                raise SpecDeployError(f"tree: path {list(path)} is deeper than the {max_depth} levels available")
            if tuple(path) in seen:
                raise SpecDeployError(f"tree: path {list(path)} is listed twice")
            seen.add(tuple(path))
        for node in seen:
            if len(node) > 1 and node[:-1] not in seen:
                raise SpecDeployError(
                    f"tree: path {list(node)} has no parent path {list(node[:-1])} (not prefix-closed)")
        if max_size is not None and len(seen) + 1 > max_size:
            raise SpecDeployError(
                f"tree: {len(seen) + 1} nodes (with the root) exceed the verify graph's {max_size} tokens")
        # Breadth-first, then by ranks: parents always precede children.
        ordered = sorted(seen, key=lambda p: (len(p), p))
        index: dict[tuple[int, ...], int] = {(): 0}
        parents, ranks = [-1], [0]
        for node in ordered:
            index[node] = len(parents)
            parents.append(index[node[:-1]])
            ranks.append(node[-1])
        return Tree(parents=tuple(parents), ranks=tuple(ranks))

    def padded_mask(self, total: int) -> np.ndarray:
        """Mask for a static graph of `total` tokens; padding rows see only themselves."""
        if total < self.size:
            raise SpecDeployError(f"tree of {self.size} tokens does not fit a graph of {total} tokens")
        m = np.eye(total, dtype=bool)
        m[: self.size, : self.size] = self.mask
        return m
