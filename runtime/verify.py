"""The one verification module: accept a path of a draft tree, losslessly.

Greedy: follow children whose token is the target's argmax; the bonus token is
the argmax at the last accepted node. Token-identical to plain greedy decoding.

Seeded sampling (the default): the same walk, with the target's own sample in place
of the argmax: at node n, the token the target draws for sequence index
root + depth(n) + 1 from its distribution there and that index's noise
(sampling.PositionNoise). Token-identical to plain seeded sampling (`ar`), hence
exactly the target's distribution. A deterministic draft x is accepted with
probability p(x), siblings with p(x1) + p(x2) + ..., as under rejection sampling; a
draft model that races the same noise (drafters/draft_model.py) agrees less often
than rejection sampling's min(1, p/q) would accept (README: "Seed-exact sampling").

Rejection sampling (recursive, over siblings), so the emitted tokens are
distributed exactly as the target's own sampling distribution:
- sampled drafts (a child drawn from a draft distribution q): accept x with
  min(1, p(x)/q(x)); on rejection p <- norm(max(0, p - q)).
- deterministic drafts (top-k heads, n-grams, lookahead: q is a point mass):
  accept x with p(x); on rejection p(x) <- 0 and renormalize.
When every child is rejected, or the node is a leaf, the next token is drawn
from the current (residual) p: the bonus token.

`penalize(row, path)`: the logits a node's choice is made from, given the tokens accepted on
the way to it (runtime/penalties.py: repetition, frequency and presence penalties); None: the
target's own. Every walk below reads a node only once its path is accepted, so that path is
the row's whole context past the committed tokens.

`exact_rows` k: only rows 0..k-1 (the tree's leading chain) are trusted to equal
sequential decoding bit for bit. A row whose ancestors are not one contiguous run
from the root is computed with a different summation order (masked columns between
them): ulps in float32, whole logits once activations are quantized to int8. An
accepted child outside the chain is emitted as the next token (its parent's row,
which chose it, is exact) but not followed, so every emitted token comes from an
exact row; the distribution of each token is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .sampling import PositionNoise, SamplingParams, sample
from .tree import Tree


@dataclass
class Verdict:
    path: list[int]  # accepted node ids, starting with the root (0)
    next_token: int  # bonus / corrected token: the next root

    @property
    def accepted_drafts(self) -> int:
        return len(self.path) - 1


Penalize = Callable[[np.ndarray, list[int]], np.ndarray]


def _rows(logits: np.ndarray, tokens: np.ndarray, penalize: Penalize | None):
    """node, path -> the logits that node's choice is made from (module docstring: `penalize`)."""
    if penalize is None:
        return lambda node, path: logits[node]
    return lambda node, path: penalize(logits[node], [int(tokens[c]) for c in path[1:]])


def _follow(tree: Tree, tokens: np.ndarray, target_token, exact_rows: int | None) -> Verdict:
    """Accept the child whose token is the target's own choice at its parent, while there is one
    (and its row is exact: see the module docstring). `target_token(node, path)`."""
    node, path = 0, [0]
    last = tree.size if exact_rows is None else exact_rows
    while True:
        want = target_token(node, path)
        nxt = next((c for c in tree.children[node] if tokens[c] == want), None)
        if nxt is None or nxt >= last:
            return Verdict(path, want)
        node = nxt
        path.append(node)


def verify_greedy(tree: Tree, tokens: np.ndarray, logits: np.ndarray, exact_rows: int | None = None,
                  penalize: Penalize | None = None) -> Verdict:
    row = _rows(logits, tokens, penalize)
    return _follow(tree, tokens, lambda node, path: int(np.argmax(row(node, path))), exact_rows)


def verify_seeded(tree: Tree, tokens: np.ndarray, logits: np.ndarray, params: SamplingParams,
                  noise: PositionNoise, root: int, exact_rows: int | None = None,
                  penalize: Penalize | None = None) -> Verdict:
    """`root`: the root's absolute sequence index (the committed length minus one)."""
    noise.release(root + 1)  # committed indices: drafts and verification only read later ones
    depth, row = tree.depth, _rows(logits, tokens, penalize)
    return _follow(tree, tokens,
                   lambda node, path: noise.sample(params.probs(row(node, path)), root + 1 + int(depth[node])),
                   exact_rows)


def verify_sampling(
    tree: Tree,
    tokens: np.ndarray,
    logits: np.ndarray,
    params: SamplingParams,
    rng: np.random.Generator,
    draft_probs: np.ndarray | None = None,
    exact_rows: int | None = None,
    penalize: Penalize | None = None,
) -> Verdict:
    """`draft_probs[c]` is the distribution child c's token was drawn from (None: deterministic drafts)."""
    node, path = 0, [0]
    last = tree.size if exact_rows is None else exact_rows
    row = _rows(logits, tokens, penalize)
    while True:
        p = params.probs(row(node, path))
        advanced = False
        for child in tree.children[node]:
            x = int(tokens[child])
            if draft_probs is None:
                accept = rng.random() < p[x]
            else:
                q = draft_probs[child]
                accept = q[x] > 0 and rng.random() < min(1.0, p[x] / q[x])
            if accept:
                if child >= last:  # drawn exactly from this node's p; its own row is not exact
                    return Verdict(path, x)
                node, advanced = child, True
                path.append(node)
                break
            if draft_probs is None:
                p[x] = 0.0
            else:
                p = np.maximum(p - draft_probs[child], 0.0)
            total = p.sum()
            if total <= 0:  # p was covered by q exactly; cannot happen with a real rejection
                p = params.probs(row(node, path))
                break
            p /= total
        if not advanced:
            return Verdict(path, sample(p, rng))


def verify(tree, tokens, logits, params: SamplingParams, rng, draft_probs=None,
           noise: PositionNoise | None = None, root: int = 0, exact_rows: int | None = None,
           penalize: Penalize | None = None) -> Verdict:
    """Greedy, else seeded when given the request's noise (draft_probs unused), else rejection sampling."""
    if params.greedy:
        return verify_greedy(tree, tokens, logits, exact_rows, penalize)
    if noise is not None:
        return verify_seeded(tree, tokens, logits, params, noise, root, exact_rows, penalize)
    return verify_sampling(tree, tokens, logits, params, rng, draft_probs, exact_rows, penalize)
