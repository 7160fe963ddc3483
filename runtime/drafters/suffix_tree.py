"""Suffix decoding's index: a depth-limited suffix trie with occurrence counts over growing
token sequences, and a bounded cache of them (pure Python, no model).

Every substring of at most `depth` tokens of a stored sequence is a path from the root; a
node's count is how many times its string occurs. Stored node by node that is `depth`
nodes per token, so a path that only one occurrence follows is not: the last shared node
keeps a *tail*, a pointer (sequence, position) into the tokens themselves, standing for a
chain of count-1 nodes. A second occurrence entering a tail splits off one node at a time.
Text that does not repeat costs a few nodes per token, text that does at most `depth`.

Appending a token moves the locations of the sequence's last `depth` suffixes one token
down (kept per growing sequence): O(depth) amortized, never a rebuild. Removing a sequence
walks its suffixes once and decrements their counts.

A location is (node, d, k): `k` tokens into the tail of `node`, which sits at depth `d`.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class _Node:
    __slots__ = ("count", "kids", "tail_pos", "tail_seq")

    def __init__(self, count: int = 0, tail_seq: int | None = None, tail_pos: int = 0):
        self.count = count  # occurrences of the root-to-node string
        self.kids: dict[int, _Node] | None = None  # token -> child; None while there is none
        # Tail: one more occurrence continues as seqs[tail_seq][tail_pos:] (count 1 per level).
        # A node with a tail has no kids.
        self.tail_seq = tail_seq
        self.tail_pos = tail_pos


@dataclass(frozen=True)
class Draft:
    """A proposal: candidate nodes best-first, each after its parent (index -1 is the root)."""

    match: int  # length of the context suffix the tree continues
    parents: tuple[int, ...]
    tokens: tuple[int, ...]
    probs: tuple[float, ...]  # path probability of each node (empirical, from the counts)

    @property
    def score(self) -> float:
        """Expected accepted tokens if the target followed the counts."""
        return sum(self.probs)


class SuffixTree:
    def __init__(self, depth: int):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.depth = depth
        self.root = _Node()
        self.seqs: dict[int, list[int]] = {}
        # Growing sequences' suffixes still shorter than `depth`, as (start, node, d, k):
        # those at a shared node are visited on every append; those inside their own tail
        # (most of them, in text that does not repeat) are parked in slot start % depth,
        # k implied by the length, until another occurrence splits that tail.
        self._active: dict[int, list[tuple[int, _Node, int, int]]] = {}
        self._parked: dict[int, list[tuple[int, _Node, int] | None]] = {}
        # the sequence being appended to, its new list
        self._moving: tuple[int, list[tuple[int, _Node, int, int]]] | None = None
        self.nodes = 1

    # -- building -------------------------------------------------------------------
    def extend(self, seq: int, tokens: Sequence[int]) -> None:
        """Append tokens to sequence `seq` (a new id starts a sequence)."""
        S = self.seqs.setdefault(seq, [])
        self._active.setdefault(seq, [])
        slots = self._parked.setdefault(seq, [None] * self.depth)
        for t in tokens:
            self._append(seq, S, slots, int(t))

    def close(self, seq: int) -> None:
        """`seq` will not grow again: forget its suffix locations (its counts stay)."""
        self._active.pop(seq, None)
        self._parked.pop(seq, None)

    def _append(self, seq: int, S: list[int], slots: list, t: int) -> None:
        n, D = len(S), self.depth
        S.append(t)
        active = self._active[seq]
        active.append((n, self.root, 0, 0))  # the new one-token suffix starts at the root
        moved: list[tuple[int, _Node, int, int]] = []
        self._moving = (seq, moved)
        for j, node, d, k in active:
            own = node.tail_seq == seq and node.tail_pos == j + d
            while k and not own:  # another occurrence split our tail since: walk down its new nodes
                assert node.kids is not None  # k > 0: the tail was split, so the node has kids
                node, d, k = node.kids[S[j + d]], d + 1, k - 1
                own = node.tail_seq == seq and node.tail_pos == j + d
            if own:  # our own tail: t is already its next token
                k += 1
            else:
                if node.tail_seq is not None:
                    self._split(node, d)
                kids = node.kids
                if kids is None:
                    kids = node.kids = {}
                child = kids.get(t)
                if child is None:  # a new path: its tail is ours
                    child = kids[t] = _Node(1, seq if d + 1 < D else None, n + 1)
                    self.nodes += 1
                    own = d + 1 < D
                else:
                    child.count += 1
                node, d = child, d + 1
            if d + k < D:
                if own:
                    slots[j % D] = (j, node, d)
                else:
                    moved.append((j, node, d, k))
        self._moving = None
        self._active[seq] = moved

    def _split(self, node: _Node, d: int) -> None:
        """Materialize the first level of `node`'s tail (the occurrence it stands for)."""
        s, p = node.tail_seq, node.tail_pos
        assert s is not None  # only a node with a tail is split
        node.tail_seq = None
        S = self.seqs[s]
        if p < len(S):
            node.kids = {S[p]: _Node(1, s if d + 2 <= self.depth else None, p + 1)}
            self.nodes += 1
        # The occurrence's suffix, if parked, is visited again from now on.
        slots, j, D = self._parked.get(s), p - d, self.depth
        entry = slots[j % D] if slots is not None else None
        if slots is not None and entry is not None and entry[0] == j and entry[1] is node and len(S) - j < D:
            slots[j % D] = None
            moving = self._moving
            (moving[1] if moving is not None and moving[0] == s else self._active[s]).append(
                (j, node, d, len(S) - j - d))

    def remove(self, seq: int) -> None:
        """Forget a sequence: every count it added is taken back, nodes left at zero freed."""
        S = self.seqs.pop(seq, None)
        self.close(seq)
        if S is None:
            return
        D, n = self.depth, len(S)
        for j in range(n):
            node, end = self.root, min(j + D, n)
            for i in range(j, end):
                if node.tail_seq == seq and node.tail_pos == i:  # the rest of this suffix is that tail
                    node.tail_seq = None
                    break
                kids = node.kids
                assert kids is not None  # this suffix's counts were added along existing kids
                child = kids[S[i]]
                child.count -= 1
                if not child.count:  # only this suffix went on from here: the walk frees the rest
                    del kids[S[i]]
                    if not node.kids:
                        node.kids = None
                    self.nodes -= 1
                node = child
            else:
                if node.tail_seq == seq and node.tail_pos == end:  # an empty tail at the end
                    node.tail_seq = None

    # -- reading ----------------------------------------------------------------------
    def _step(self, loc, t: int):
        """The location one token `t` further down, or None."""
        node, d, k = loc
        if d + k >= self.depth:
            return None
        if k or node.tail_seq is not None:
            S, i = self.seqs[node.tail_seq], node.tail_pos + k
            return (node, d, k + 1) if i < len(S) and S[i] == t else None
        child = node.kids.get(t) if node.kids else None
        return None if child is None else (child, d + 1, 0)

    def children(self, loc) -> list[tuple[int, int, tuple]]:
        """(count, token, location) of every continuation seen after `loc`."""
        node, d, k = loc
        if d + k >= self.depth:
            return []
        if k or node.tail_seq is not None:
            S, i = self.seqs[node.tail_seq], node.tail_pos + k
            return [(1, S[i], (node, d, k + 1))] if i < len(S) else []
        if not node.kids:
            return []
        return [(c.count, t, (c, d + 1, 0)) for t, c in node.kids.items()]

    def count(self, tokens: Sequence[int]) -> int:
        """Occurrences of `tokens` (at most `depth` long) in the stored sequences."""
        loc = (self.root, 0, 0)
        for t in tokens:
            loc = self._step(loc, int(t))
            if loc is None:
                return 0
        node, _, k = loc
        return 1 if k else node.count

    def longest_match(self, context: Sequence[int], max_len: int) -> tuple[int, tuple | None]:
        """(m, location) of the longest suffix of `context`, at most `max_len` tokens, that
        occurs somewhere followed by a token (the context's own end does not count); (0, None)."""
        for m in range(min(max_len, len(context), self.depth - 1), 0, -1):
            loc = (self.root, 0, 0)
            for t in context[len(context) - m:]:
                loc = self._step(loc, t)
                if loc is None:
                    break
            if loc is not None and self.children(loc):
                return m, loc
        return 0, None

    def draft(self, context: Sequence[int], max_len: int, max_nodes: int, min_prob: float) -> Draft | None:
        """The most likely continuations of the context's longest matching suffix as a tree:
        best-first by path probability (each step's counts over its siblings'), at most
        `max_nodes` nodes, none below `min_prob`."""
        m, loc = self.longest_match(context, max_len)
        if not m:
            return None
        parents: list[int] = []
        tokens: list[int] = []
        probs: list[float] = []
        heap: list[tuple[float, int, int, int, Any]] = []  # (-path prob, tie, parent index, token, location)
        tie = 0

        def push(parent: int, prob: float, at) -> None:
            nonlocal tie
            kids = self.children(at)
            total = sum(c for c, _, _ in kids)
            if len(kids) > max_nodes:  # only the likeliest max_nodes siblings can ever be taken
                kids = heapq.nlargest(max_nodes, kids, key=lambda kid: kid[0])
            for c, t, where in kids:
                p = prob * c / total
                if p >= min_prob:
                    heapq.heappush(heap, (-p, tie, parent, t, where))
                    tie += 1

        push(-1, 1.0, loc)
        while heap and len(tokens) < max_nodes:
            neg, _, parent, t, where = heapq.heappop(heap)
            parents.append(parent)
            tokens.append(t)
            probs.append(-neg)
            push(len(tokens) - 1, -neg, where)
        return Draft(m, tuple(parents), tuple(tokens), tuple(probs))


class SuffixCache:
    """Earlier requests' outputs in one SuffixTree, at most `max_tokens` tokens: the oldest
    sequence is evicted first (FIFO). Not thread-safe: one owner (one loaded export, which
    serves one request at a time)."""

    def __init__(self, depth: int, max_tokens: int):
        self.tree = SuffixTree(depth)
        self.max_tokens = max_tokens
        self.tokens = 0
        self._lengths: dict[int, int] = {}  # live sequences, oldest first
        self._next = 0
        self._current: int | None = None

    def begin(self) -> int:
        """A new sequence (one request's output); the previous one stops growing."""
        if self._current is not None:
            self.tree.close(self._current)
        seq, self._next = self._next, self._next + 1
        self._lengths[seq] = 0
        self._current = seq
        return seq

    def extend(self, seq: int, tokens: Sequence[int]) -> None:
        """Append to `seq`, evicting the oldest others to stay within max_tokens. Only the
        newest sequence grows: one that another has followed, or that fills the whole
        cache, takes no more tokens."""
        if seq != self._current:
            return
        while self.tokens + len(tokens) > self.max_tokens:
            old = next((s for s in self._lengths if s != seq), None)  # the oldest other
            if old is None:
                break
            self.tree.remove(old)
            self.tokens -= self._lengths.pop(old)
        tokens = list(tokens)[: max(0, self.max_tokens - self.tokens)]
        if tokens:
            self.tree.extend(seq, tokens)
            self.tokens += len(tokens)
            self._lengths[seq] += len(tokens)

    def clear(self) -> None:
        """Forget every earlier output (between requests: a running request's sequence ends too)."""
        self.tree = SuffixTree(self.tree.depth)
        self.tokens, self._lengths, self._current = 0, {}, None  # sequence ids keep counting: none is reused

    def __len__(self) -> int:
        return len(self._lengths)
