"""What every drafter hands the verify loop, and the state it sees."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..decoder import StepOutput
from ..sampling import PositionNoise, SamplingParams
from ..tree import Tree
from ..verify import Verdict


@dataclass
class Proposal:
    tree: Tree
    tokens: np.ndarray  # [tree.size] int64; tokens[0] is the root (last committed token)
    draft_probs: np.ndarray | None = None  # [tree.size, vocab]: q each node was sampled from; None = deterministic
    # Auxiliary tokens scored in the same target call, after the tree nodes (lookahead's
    # Jacobi window). They are never candidates and their KV is never committed; the
    # drafter reads their logits (rows tree.size.. of the step output) in update().
    aux_tokens: np.ndarray | None = None  # [a] int64
    aux_positions: np.ndarray | None = None  # [a] offsets from the root's position (like tree.depth)
    aux_mask: np.ndarray | None = None  # [a, tree.size + a] bool: aux row sees column

    @staticmethod
    def root_only(root: int) -> "Proposal":
        return Proposal(Tree.chain(0), np.array([root], dtype=np.int64))

    @property
    def size(self) -> int:
        """Tokens in the target call: tree nodes plus auxiliary tokens."""
        return self.tree.size + (0 if self.aux_tokens is None else len(self.aux_tokens))

    def reordered(self, order) -> "Proposal":
        """The same candidates with tree node order[r] as node r (aux rows unchanged, after the tree)."""
        idx = np.asarray(order, dtype=np.int64)
        aux_mask = self.aux_mask
        if aux_mask is not None:
            aux_mask = np.concatenate([aux_mask[:, idx], aux_mask[:, self.tree.size:]], axis=1)
        return Proposal(self.tree.reordered(order), self.tokens[idx],
                        None if self.draft_probs is None else self.draft_probs[idx],
                        self.aux_tokens, self.aux_positions, aux_mask)

    def packed(self, start: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, positions, mask) of the one target call; the root sits at position `start`.

        Tree rows see only tree nodes (their ancestors), never aux tokens, so the
        verified logits are exactly those of the tree alone.
        """
        positions = start + self.tree.depth
        if self.aux_tokens is None:
            return self.tokens, positions, self.tree.mask
        n, s = self.size, self.tree.size
        mask = np.zeros((n, n), dtype=bool)
        mask[:s, :s] = self.tree.mask
        mask[s:] = self.aux_mask
        return (np.concatenate([self.tokens, self.aux_tokens]),
                np.concatenate([positions, start + np.asarray(self.aux_positions, dtype=np.int64)]), mask)


@dataclass(frozen=True)
class BatchPrice:
    """What a row's drafting costs in a batch of several rows (runtime/batching/policy.py), in seconds
    of the batch's call: every row waits while one drafts, so a token it adds is worth the batch's
    plain seconds per token, not its own step's."""

    rows: int  # the rows sharing the call (n): a probe of the model part holds every one of them up
    token_s: float  # seconds per token the batch makes decoding plainly: call(n) / n
    row_s: float  # seconds a verify row adds to the call
    run_s: float  # what a row's step costs more as a run of its own (a speculative step) than as a decode row


@dataclass
class DecodeState:
    tokens: list[int]  # prompt + everything committed; tokens[-1] is the root
    params: SamplingParams
    rng: np.random.Generator  # rejection sampling's sequential stream
    stats: dict = field(default_factory=dict)
    noise: PositionNoise | None = None  # seeded sampling (when sampling): noise per sequence index
    # the request's penalties (runtime/penalties.py): logits, the tokens drafted past the root -> the logits
    # the target will choose from there; a model drafter drafts from them too, or it keeps proposing what
    # the penalty just turned away (None: no penalties)
    penalize: Callable[[np.ndarray, list[int]], np.ndarray] | None = None


class Drafter:
    """A method differs only in its drafter: propose a tree, learn what was accepted."""

    name = "ar"
    deterministic = True  # proposals carry no draft_probs
    # A request's sampling scheme when it names none and gives no seed (a seed means seeded: generate.py).
    # Seeded accepts a deterministic draft exactly as often as rejection sampling does, and is seed-exact.
    default_sampling = "seeded"
    # Sizes each proposal by what its verify rows cost (drafters/step_costs.py) and drafts on the host for free:
    # the step-time policy (runtime/adaptive.py) has nothing to add, and on a shared CPU it turned
    # timing noise into plain steps (SmolLM2, 6 prompts a set, interleaved, load 3-5: prompt lookup
    # on code 1.76x ar with it, 1.89x without; suffix 1.96x vs 2.20x; no set slower without it).
    sizes_own_rows = False
    # Its proposal costs one model call per draft and sizes itself (a draft model's stop rule), rather
    # than a fixed price per step: a batch's policy prices a draft at the measured time of one and
    # decides only whether the step drafts (runtime/batching/policy.py).
    cost_per_draft = False
    # the latest proposal's calls that each made one draft after its first (seconds, calls): what a
    # draft costs. The first also feeds what the model has not seen (after plain steps, many tokens).
    draft_calls: tuple[float, int] = (0.0, 0)
    # and its first call when that fed more than the root and the last draft (seconds, tokens): the
    # catch-up on tokens committed in plain steps, which a probe after many of them pays first
    catchup: tuple[float, int] = (0.0, 0)
    # Set by a batched service's row before each proposal while other rows share its calls (None at batch 1
    # and for a row alone): a drafter that decides itself whether to call a model (fused) weighs it there.
    batch_price: BatchPrice | None = None
    # seconds of the latest proposal spent on model calls the drafter decided on by its own pricing (a fused
    # drafter's model part): a batch's policy, which prices the rest of a proposal, must not charge them again
    self_priced_s: float = 0.0

    def prefilled(self, target_out: StepOutput) -> None:
        """One chunk of the prompt's target prefill (before start()); EAGLE keeps its features."""

    def start(self, state: DecodeState) -> None:
        """A new request begins (state.tokens is the prompt)."""

    def propose(self, state: DecodeState) -> Proposal:
        return Proposal.root_only(state.tokens[-1])

    def update(self, state: DecodeState, proposal: Proposal, verdict: Verdict, target_out: StepOutput) -> None:
        """Called after the accepted tokens are appended to state.tokens."""

    def sized(self, costs) -> Proposal | None:
        """A host drafter's (prompt lookup, suffix) latest whole proposal cut as it cuts it running alone:
        the prefix of its candidates whose expected tokens per second is best at a step's time by verify
        size `costs` (drafters/step_costs.py). None: this drafter does not size its own proposals."""
        return None
