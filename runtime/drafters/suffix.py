"""Suffix decoding (ArcticInference; Oliaro et al., 2024) on the host.

Two suffix trees (runtime/drafters/suffix_tree.py) count what followed every substring:
one over this request's prompt, built when it starts; one over the outputs of this and
earlier requests, kept across requests (with no cache, the output joins the prompt's).
Each step the longest context suffix (at most `max_match` tokens) found in a tree is
continued by a tree of its likeliest continuations, best-first by empirical path
probability, within `max_nodes`. Of the two trees' proposals
the one continuing the longer match wins (then the higher expected acceptance). Of that
tree only the best nodes are verified, as many as maximize the expected tokens per second
(drafters/step_costs.py: a step's measured time by verify size; a node's worth is its chance of
being on the target's path, drafters/tree_budget.py, from the acceptance measured in this request,
drafters/acceptance.py: the root's children per match length, deeper nodes per depth, since
acceptance comes in runs): a frequent continuation that this answer does not follow costs rows,
not only misses. Drafts are deterministic and sized by verified steps and their times only,
verified like prompt lookup's (greedy exact, sampling lossless).

The cross-request cache lives on the loaded export (`LoadedExport.part`): one per export
instance, so one per `Service` with the default pool of one (a pool of N holds N, each
learning from the requests it served). It is never shared between services, and never
between tenants unless they share a service: run one service per tenant when earlier
outputs must not shape (or be inferred from the speed of) another tenant's answers. It
holds at most `cache_tokens` tokens (the oldest request's output evicted first; memory
at most about `cache_tokens x (max_match + max_nodes)` trie nodes, far fewer on text that
does not repeat) and is emptied only with the process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..config import positive_int
from ..errors import SpecDeployError
from ..tree import Tree
from .acceptance import DEPTHS, RankAcceptance
from .base import DecodeState, Drafter, Proposal
from .step_costs import StepTimer, best_prefix, cost_fields, sized_by_steps
from .suffix_tree import SuffixCache, SuffixTree
from .tree_budget import PartProposal, merge


@dataclass(frozen=True)
class SuffixConfig:
    method: ClassVar[str] = "suffix"

    max_nodes: int = 14  # candidate tokens per step; verify T = max_nodes + 1 = 15, the graph prompt-lookup
    #                      already uses (any proposal is padded to it, so a full budget is free)
    max_match: int = 8  # longest context suffix looked up; trees hold max_match + max_nodes tokens deep
    min_prob: float = 0.1  # candidates whose empirical path probability is lower are not proposed
    cache_tokens: int = 32768  # earlier requests' output tokens kept per export instance (0: none)
    # the prior shape of a step's time by verify size until sizes are measured (prompt lookup's,
    # drafters/step_costs.py): the tree's best nodes are verified while they raise the expected tokens
    # per second. Both 0: the whole tree (rows are free, e.g. a GPU)
    call_cost: float = 0.2
    row_cost: float = 0.05

    def __post_init__(self):
        positive_int(self.max_nodes, "suffix.max_nodes")
        positive_int(self.max_match, "suffix.max_match")
        positive_int(self.cache_tokens, "suffix.cache_tokens", 0)
        if isinstance(self.min_prob, bool) or not isinstance(self.min_prob, (int, float)) \
                or not 0.0 <= self.min_prob <= 1.0:
            raise SpecDeployError(f"config: suffix.min_prob must be a number in [0, 1], got {self.min_prob!r}")
        cost_fields(self, "suffix")

    @property
    def depth(self) -> int:
        return self.max_match + self.max_nodes

    @property
    def verify_tokens(self) -> int:
        return self.max_nodes + 1


# The root's children's acceptance is counted per length of the context match the tree continues (1, 2, 3,
# 4 and longer): a longer match's continuation is taken far more often.
MATCH_KINDS = 4


def shared_cache(export, config: SuffixConfig) -> SuffixCache | None:
    """The export instance's cross-request cache for this config (None: cache_tokens is 0). Keyed by
    its shape: a request overriding it gets its own."""
    if not config.cache_tokens:
        return None
    return export.part(f"suffix-cache:{config.depth}:{config.cache_tokens}",
                       lambda: SuffixCache(config.depth, config.cache_tokens))


def build(export, config: SuffixConfig) -> SuffixDrafter:
    return SuffixDrafter(config, shared_cache(export, config), sized_by_steps(export, config))


class SuffixDrafter(Drafter):
    name = "suffix"
    sizes_own_rows = True  # only nodes worth their rows are verified (tree_budget)

    def __init__(self, config: SuffixConfig, cache: SuffixCache | None = None, timer: StepTimer | None = None):
        """`timer` None: the whole tree is verified (rows are free)."""
        self.config, self.cache, self.timer = config, cache, timer

    def start(self, state: DecodeState) -> None:
        # measured on its whole trees, the root's children per match length, deeper nodes per depth (acceptance.py)
        self.rate = RankAcceptance(MATCH_KINDS, DEPTHS)
        self.kind = 0  # this step's proposal's: its match length's
        self.proposed: Proposal | None = None  # this step's whole tree, before the rows' cost trimmed it
        self.local = SuffixTree(self.config.depth)
        self.local.extend(0, state.tokens)
        self.seq = None
        if self.cache is not None:  # the output goes to the cache only: indexed once, not twice
            self.local.close(0)
            self.seq = self.cache.begin()

    def propose(self, state: DecodeState) -> Proposal:
        if self.timer is not None:
            self.timer.proposing()
        c, context = self.config, state.tokens
        best = None
        for tree in (self.local, self.cache.tree) if self.cache is not None else (self.local,):
            draft = tree.draft(context, c.max_match, c.max_nodes, c.min_prob)
            if draft is not None and (best is None or (draft.match, draft.score) > (best.match, best.score)):
                best = draft
        if best is None:
            self.proposed = None
            return Proposal.root_only(context[-1])
        n = len(best.tokens)
        chain = best.parents == tuple(range(-1, n - 1))  # the shared, precomputed chain tree
        self.proposed = Proposal(Tree.chain(n) if chain else Tree((-1,) + tuple(p + 1 for p in best.parents)),
                                 np.array((context[-1],) + best.tokens, dtype=np.int64))
        self.kind = min(best.match, MATCH_KINDS) - 1
        if self.timer is None:
            return self.proposed
        return self._cut(self.proposed, self.timer.costs)

    def sized(self, costs) -> Proposal | None:
        return None if self.proposed is None else self._cut(self.proposed, costs)

    def _cut(self, whole: Proposal, costs) -> Proposal:
        """`whole`'s nodes best first, as many as pay for their rows at `costs`."""
        root = int(whole.tokens[0])
        ranked = merge([PartProposal(whole, self.kind)], [self.rate], self.config.max_nodes, 0.0, root)
        return ranked.proposal(best_prefix(ranked.worth[1:], costs))

    def update(self, state: DecodeState, proposal: Proposal, verdict, target_out) -> None:
        if self.timer is not None:
            self.timer.verified(proposal.size)
        new = state.tokens[len(state.tokens) - len(verdict.path):]  # accepted drafts + the bonus token
        if self.proposed is not None:  # acceptance on the whole tree (what a larger share would have had)
            self.rate.observe(self.proposed.tree, self.proposed.tokens, new, self.kind)
            self.proposed = None  # a step this drafter did not propose (a batch's plain one) measures nothing
        if self.cache is not None and self.seq is not None:
            self.cache.extend(self.seq, new)
        else:
            self.local.extend(0, new)
