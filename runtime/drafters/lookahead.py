"""Lookahead decoding (Fu et al., 2024) on the host: a Jacobi window feeds an n-gram pool.

Every step is ONE target call of a static size T = (N-1) * (W+G), two branches packed:

- verification branch (the tree nodes): up to G candidates of N-1 tokens, merged into
  a trie under the root and verified by runtime/verify.py like any deterministic draft
  (greedy exact, sampling lossless). First the continuation of the longest (2+ token)
  earlier match of the context's suffix (prompt lookup: more precise than a 1-token
  key), then the pool's n-grams whose first token is the root, most recent first;
- lookahead branch (auxiliary tokens, never candidates, KV never committed): a 2D
  window of N-1 levels x W columns. Cell (l, i) sits at position root + i + l and
  sees cells (0, 0..i) and (1..l, i): a causal run of consecutive positions, so its
  logits are those of decoding that run. Cell (0, 0) is the root itself. Level N-2
  is the newest Jacobi iterate; its outputs are the next one, and each column then
  reads as an n-gram (cells (0..N-2, i), output i), added to the pool under cell (0, i).

After s tokens are committed the window slides by s (level l <- level l+1, the last
level <- the new outputs, both shifted left by s-1); emptied cells get random tokens
of the context. The pool is seeded with the prompt's n-grams (prompt lookup) and
takes every n-gram of the committed text as it grows.

After a plain step (the adaptive policy's, runtime/adaptive.py, or the context end's) the
window is stale: its levels hold no recent iterate, so its outputs are harvested only N-2
steps later. The policy's probe, the next step that drafts, is then the candidates alone
(up to G x (N-1) rows, none when the pool has nothing for the root): the window's rows could
add nothing to it. A probe that wins brings the window back the step after. (SmolLM2, chat:
probes with the window cost 1.86x a plain step for 1.28 tokens, 4.4% of the decode time.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..config import positive_int
from ..tree import Tree
from .base import DecodeState, Drafter, Proposal
from .ngram_pool import NGramPool
from .prompt_lookup import find_continuation

SUFFIX_MAX = 4  # longest context suffix matched for the prompt-lookup candidate


@dataclass(frozen=True)
class LookaheadConfig:
    """Jacobi window + n-gram pool; verify T = (ngram - 1) * (window + guesses).

    The defaults are CPU-sized: T = 4, one window column of two cells and one 2-token candidate. A
    row is not free on a CPU (SmolLM2-135M float32, 2 cores: T=15 costs ~1.8x a T=1 step), and the
    paper's wide windows are for GPUs, where a few hundred rows cost about one. Measured with the
    adaptive policy on, against `ar` in one process (2-core AVX2, held-out prompts: code and grounded
    prompts past the bench's first 4, free-form chat, repeated prompts 7-12; 96 tokens, 64 repeated;
    two interleaved rounds): (W, N, G) = (3, 4, 2), the old T = 15, 1.09-1.15x / 1.03x / 0.96-0.97x /
    0.93x; (1, 3, 1) 1.53-1.61x / 1.35x / 1.04-1.05x / 1.05-1.08x; (1, 4, 1) 1.58-1.59x / 1.31x /
    1.03-1.04x / 1.02-1.05x; (2, 3, 1) 1.41-1.47x / 1.23x / 1.01-1.02x / 1.01-1.04x. Widen W and G
    where rows are cheap (a GPU: the paper's 7B settings are W=15, N=5, G=15)."""

    method: ClassVar[str] = "lookahead"

    window: int = 1  # W: Jacobi window columns (n-grams harvested per step)
    ngram: int = 3  # N: n-gram size; the window has N-1 levels, candidates are N-1 tokens
    guesses: int = 1  # G: n-grams kept per first token (LRU) and verified per step

    def __post_init__(self):
        positive_int(self.window, "lookahead.window")
        positive_int(self.ngram, "lookahead.ngram", 2)
        positive_int(self.guesses, "lookahead.guesses")

    @property
    def verify_tokens(self) -> int:
        return (self.ngram - 1) * (self.window + self.guesses)


def build(export, config: LookaheadConfig) -> LookaheadDrafter:
    return LookaheadDrafter(config.window, config.ngram, config.guesses)


def window_layout(window: int, ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """(visible, offsets) of the flattened window, cell (l, i) at index l * window + i.

    visible[r, c]: cell r sees cell c; offsets[r]: r's position relative to the root.
    """
    level = np.repeat(np.arange(ngram - 1), window)
    col = np.tile(np.arange(window), ngram - 1)
    rl, ri, cl, ci = level[:, None], col[:, None], level[None], col[None]
    visible = ((cl == 0) & (ci <= ri)) | ((cl >= 1) & (cl <= rl) & (ci == ri))
    return visible, (level + col).astype(np.int64)


def trie(root: int, continuations: Sequence[Sequence[int]]) -> tuple[Tree, np.ndarray]:
    """The candidates as one tree under the root, shared prefixes merged."""
    parents, tokens = [-1], [int(root)]
    index: dict[tuple[int, int], int] = {}
    for cont in continuations:
        node = 0
        for tok in cont:
            child = index.get((node, tok))
            if child is None:
                child = index[(node, tok)] = len(tokens)
                parents.append(node)
                tokens.append(int(tok))
            node = child
    return Tree(tuple(parents)), np.array(tokens, dtype=np.int64)


class LookaheadDrafter(Drafter):
    name = "lookahead"

    def __init__(self, window: int, ngram: int, guesses: int, seed: int = 0, suffix_match: bool = True):
        self.w, self.n, self.g, self.seed, self.suffix_match = window, ngram, guesses, seed, suffix_match
        visible, offsets = window_layout(window, ngram)
        # The root (cell 0) is tree node 0; the other cells follow the tree nodes.
        self._aux_visible, self._aux_offsets = visible[1:, 1:], offsets[1:]
        self._last_level = (ngram - 2) * window + np.arange(window)  # flat cells whose outputs are new guesses

    def start(self, state: DecodeState) -> None:
        self.rng = np.random.default_rng(self.seed)  # window fill only; state.rng stays the sampler's
        self.pool = NGramPool(self.n - 1, self.g)
        self.pool.add_ngrams(state.tokens)  # prompt lookup seeds the pool
        self.grid = self._fill(state.tokens, (self.n - 1, self.w))
        self.steps = 0
        self.stale = False  # the last step was plain: propose the candidates alone (module docstring)

    def _fill(self, context: Sequence[int], shape) -> np.ndarray:
        """Random tokens of the context: cheap guesses that are at least plausible tokens."""
        picks = self.rng.integers(0, len(context), size=shape)
        return np.array([context[i] for i in picks.flat], dtype=np.int64).reshape(shape)

    def propose(self, state: DecodeState) -> Proposal:
        root = state.tokens[-1]
        self.grid[0, 0] = root
        cands = self.pool.get(root)
        if self.suffix_match:
            # prompt lookup with a 2+ token suffix: more precise than the pool's 1-token key
            found = find_continuation(np.asarray(state.tokens, dtype=np.int64), self.n - 1, SUFFIX_MAX, 2)
            if len(found) == self.n - 1:
                match = tuple(int(t) for t in found)
                cands = [match] + [c for c in cands if c != match]
        tree, tokens = trie(root, cands[: self.g])
        if self.stale:
            return Proposal(tree, tokens)
        s = tree.size
        mask = np.zeros((len(self._aux_offsets), s + len(self._aux_offsets)), dtype=bool)
        mask[:, 0] = True  # every cell sees the root; candidate nodes stay invisible
        mask[:, s:] = self._aux_visible
        return Proposal(tree, tokens, None, self.grid.reshape(-1)[1:].copy(), self._aux_offsets, mask)

    def update(self, state: DecodeState, proposal: Proposal, verdict, target_out) -> None:
        shift = len(verdict.path)  # tokens committed this step (accepted drafts + the bonus)
        if proposal.aux_tokens is not None:
            rows = np.where(self._last_level == 0, 0, proposal.tree.size + self._last_level - 1)
            guesses = target_out.logits[rows].argmax(-1)
            # Harvest once levels 1..N-2 hold model outputs, not the random initial fill.
            if self.steps >= self.n - 2:
                for column in np.vstack([self.grid, guesses[None]]).T.tolist():
                    self.pool.add(column[0], column[1:])
        else:  # a plain step (adaptive fallback, the context end) or a probe: no new iterate
            guesses = self.grid[-1]
            self.steps = -1  # the levels go stale: harvest again once fresh outputs fill them
        # the root alone was verified: a plain step, or a probe that found no candidate
        self.stale = proposal.aux_tokens is None and proposal.tree.size == 1
        self.steps += 1
        newer = np.vstack([self.grid[1:], guesses[None]])
        keep = max(0, self.w - (shift - 1))
        self.grid = np.empty_like(newer)
        self.grid[:, :keep] = newer[:, shift - 1 :]
        if keep < self.w:
            self.grid[:, keep:] = self._fill(state.tokens, (self.n - 1, self.w - keep))
        # n-grams ending in the committed tokens: most recent, so proposed first
        self.pool.add_ngrams(state.tokens, len(state.tokens) - shift - self.n + 1)
