"""What every drafter hands the verify loop, and the state it sees."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..decoder import StepOutput
from ..sampling import SamplingParams
from ..tree import Tree
from ..verify import Verdict


@dataclass
class Proposal:
    tree: Tree
    tokens: np.ndarray  # [tree.size] int64; tokens[0] is the root (last committed token)
    draft_probs: np.ndarray | None = None  # [tree.size, vocab]: q each node was sampled from; None = deterministic

    @staticmethod
    def root_only(root: int) -> "Proposal":
        return Proposal(Tree.chain(0), np.array([root], dtype=np.int64))


@dataclass
class DecodeState:
    tokens: list[int]  # prompt + everything committed; tokens[-1] is the root
    params: SamplingParams
    rng: np.random.Generator
    stats: dict = field(default_factory=dict)


class Drafter:
    """A method differs only in its drafter: propose a tree, learn what was accepted."""

    name = "ar"
    deterministic = True  # proposals carry no draft_probs

    def start(self, state: DecodeState) -> None:
        """A new request begins (state.tokens is the prompt)."""

    def propose(self, state: DecodeState) -> Proposal:
        return Proposal.root_only(state.tokens[-1])

    def update(self, state: DecodeState, proposal: Proposal, verdict: Verdict, target_out: StepOutput) -> None:
        """Called after the accepted tokens are appended to state.tokens."""
