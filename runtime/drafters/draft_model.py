"""A separate model drafts up to k tokens autoregressively (its own graphs and KV cache).

The draft is a small model or the target itself with quantized weights (`export --draft self`:
an int4 copy agrees with its float32 target on 80-90% of greedy tokens on SmolLM2-135M). A
self-draft's cache holds the target's KV of every committed token (copied from the target's
cache, the prompt's at the start, each step's accepted tokens' after it): it never prefills the
prompt nor catches up on plain steps' tokens, and it drafts on the target's own rows.
It stops drafting once the chance that every draft so far is accepted falls below
`stop_below`: a draft whose predecessors are probably wrong costs a draft call and a verify
row for nothing. Each draft's chance is the measured acceptance of drafts picked with its
probability (drafters/acceptance.py: ConfidenceAcceptance; greedy, the instance's table, sampled,
the request's own), not the probability itself: a draft's probability says how sure the draft
is, not how often the target agrees. Taken raw (their product), SmolLM2-135M's int8 self-draft, which agrees with
its float32 target on 97-99% of greedy tokens, took 3.7 tokens a target call on chat; measured,
7.6. Replayed on teacher-forced drafts of the target's own answers to the kit's prompts
(train/, not the bench's) with call costs measured on a 2-core Xeon (a draft call 0.35x a float32
step at int8, 0.26x at int4): 1.86x / 1.90x the plain step rate on chat
/ code for the int8 self-draft against 1.65x / 1.74x with the raw product at 0.4; the int4 one
1.61x / 1.86x, as before (the raw product at 0.4: 1.60x / 1.82x). The stop depends only on the
draft's own outputs and earlier steps' committed tokens, so the output stays lossless: greedy
equals `ar`, and sampling still follows the target.

Greedy, a drafted position where the draft hesitates also verifies its runner-up, as a leaf
beside the draft (a tree, no extra draft call): where the target's token is the draft's
second choice, the step takes it instead of stopping there. A leaf goes in, likeliest first
within the k nodes, while the chance that the target's path reaches its position (the
drafts' chances before it) times the runner-up's probability is at least `runner_up`.
Sampling keeps the chain: its drafts are draws, verified by rejection; so does the draft of
a quantized target, which is verified along a tree's leading chain only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..config import positive_int
from ..decoder import Decoder
from ..errors import SpecDeployError
from ..kv_cache import RowCopy
from ..sampling import race, sample
from ..tree import Tree
from .acceptance import ConfidenceAcceptance
from .base import DecodeState, Drafter, Proposal


@dataclass(frozen=True)
class DraftConfig:
    method: ClassVar[str] = "draft"

    k: int = 8  # tokens the draft model proposes per step; measured on held-out prompts (not the
    #             bench's): k=8 +24-29% over k=4, k=14 only a few % more
    # export: the draft's LM head keeps the N most frequent target tokens (draft_vocab.json beside
    # the draft; 0: all). Only the candidates change: verification is the target's.
    draft_vocab: int = 0
    # drafting stops once the measured chance that every draft so far is taken is below this (module
    # docstring; 0: always k drafts). 0.6-0.7 led the replays of the kit's prompts for both self-drafts
    # (int8: 0.2-0.8 within 4%; int4: 0.4 lost 0-5%, 0.2 lost 4-15%)
    stop_below: float = 0.6
    # greedy: a drafted position's runner-up is verified as a leaf beside it where its chance of being the
    # target's token there is at least this (module docstring; 0: a chain only)
    runner_up: float = 0.1

    def __post_init__(self):
        positive_int(self.k, "draft.k")
        for key in ("stop_below", "runner_up"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise SpecDeployError(f"config: draft.{key} must be a number in [0, 1), got {value!r}")
        if self.draft_vocab != 0:
            positive_int(self.draft_vocab, "draft.draft_vocab (0: the full vocabulary)")

    @property
    def verify_tokens(self) -> int:
        return self.k + 1


def build(export, config: DraftConfig) -> DraftModelDrafter:
    if "draft" not in export.manifest.models:
        raise SpecDeployError("method 'draft' needs a draft model: export with --draft DIR")
    ids = export.part("draft_vocab", lambda: draft_vocab_ids(export.manifest))
    target, draft = export.decoder("target"), export.decoder("draft")
    seed = target if drafts_for_itself(export.manifest) and all(
        callable(getattr(d.cache, "head_major", None)) for d in (target, draft)) else None
    from ..generate import exact_rows_only  # the generator imports the drafters

    # A quantized target is verified along a tree's leading chain only: a leaf there is no more than the
    # bonus token it would be anyway, so its row would buy nothing.
    runner_up = 0.0 if exact_rows_only(export) else config.runner_up
    # greedy, the drafts' measured acceptance is this instance's (a pool instance's or batch row's, as every
    # export part): each request it serves adds to it
    acceptance = None
    if config.stop_below:
        acceptance = lambda: export.part("draft-acceptance:greedy", ConfidenceAcceptance)  # noqa: E731
    return DraftModelDrafter(draft, config.k, export.prefill_chunk, ids,
                             export.manifest.models["draft"].vocab_size, config.stop_below, seed, runner_up, acceptance)


def drafts_for_itself(manifest) -> bool:
    """Whether the draft is the target's own model (`export --draft self`, its weights quantized): exported
    from the same directory, with the same KV geometry."""
    target, draft = manifest.models["target"], manifest.models["draft"]
    return bool(target.source) and draft.source == target.source and all(
        getattr(target, k) == getattr(draft, k) for k in ("num_layers", "num_kv_heads", "head_dim"))


def draft_vocab_ids(manifest) -> np.ndarray | None:
    """The target id of each column of the draft's logits (models.draft.draft_vocab_file, written
    where the export restricted its LM head), or None: the columns are the vocabulary."""
    record = manifest.models["draft"]
    rel = record.extra.get("draft_vocab_file")
    if rel is None:
        return None
    path = manifest.root / rel  # inside root and checksummed: load_manifest checked it
    try:
        ids = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise SpecDeployError(f"{path} is not a draft vocabulary (re-export it): {exc}") from None
    if ids.ndim != 1 or ids.dtype.kind not in "iu" or len(ids) != record.extra.get("draft_vocab_size") \
            or len(np.unique(ids)) != len(ids) or ids.min() < 0 or ids.max() >= record.vocab_size:
        raise SpecDeployError(f"{path}: expected draft_vocab_size distinct token ids in [0, {record.vocab_size}) "
                              "(re-export it)")
    return ids.astype(np.int64)


class DraftModelDrafter(Drafter):
    name = "draft"
    deterministic = False
    # Racing the target's noise (seeded) agrees less often than rejection sampling's min(1, p/q)
    # accepts: on the micro export 3.73 and 3.56 vs 4.18 and 4.24 tokens per target call at T=0.7, 1.0
    # (README: "Seed-exact sampling"): its scheme for a request without a seed. A seed asks for a replayable
    # answer, so a seeded request runs seeded (runtime/generate.py) and gives ar's tokens.
    default_sampling = "rejection"
    cost_per_draft = True

    def __init__(self, decoder: Decoder, k: int, prefill_chunk: int, vocab_ids: np.ndarray | None = None,
                 vocab_size: int = 0, stop_below: float = 0.0, seed_from: Decoder | None = None,
                 runner_up: float = 0.0, acceptance=None):
        """`acceptance()`: the ConfidenceAcceptance that prices the greedy stop rule, shared by the requests the
        instance serves; a sampled request prices it by a table of its own (`_table`). None: each draft's own
        probability does."""
        self.decoder, self.k, self.stop_below, self.runner_up = decoder, k, stop_below, runner_up
        self.acceptance = acceptance
        self._sampled: ConfidenceAcceptance | None = None  # this sampled request's table
        self._measured: tuple | None = None  # this step's (acceptance table, the drafts' probabilities, drafts)
        self.chunk = decoder.prefill_limit(prefill_chunk)  # its longer prefill calls where it runs them
        # vocab_ids: the draft's logits score only these target ids (a draft vocabulary); its
        # distributions are zero elsewhere, over the full `vocab_size`
        self.vocab_ids, self.vocab_size = vocab_ids, vocab_size
        # A self-draft's cache holds its target's KV of every committed token (the prompt's at start,
        # the rest when it drafts: _seed), not its own; drafts only guess, the target verifies.
        # Its own int4 prefill cost as much as the float32 target's and doubled the method's time to
        # first token (SmolLM2, 540-token prompt: 1,015 vs 474 ms for ar); and drafting on the
        # target's rows agrees more (8 prompts x 96 tokens: 2.73 vs 2.35 tokens per call on chat,
        # 3.36 vs 2.80 on code, 4.11 vs 3.76 on grounded). The copy is O(tokens committed since).
        self.seed_from = seed_from
        self._copy = None if seed_from is None else RowCopy(seed_from.cache, decoder.cache)
        self._seeded = 0  # rows of the draft's cache that are the target's
        # this step's drafts fed to the draft's cache (all but the last), from sequence index _first
        self._fed: list[int] | None = None
        self._first = 0
        self._second = (0, 0.0)  # greedy, runner_up: the last pick's runner-up (target id, probability)

    def start(self, state: DecodeState) -> None:
        self.decoder.reset()
        self._fed = self._measured = self._sampled = None  # no step of an earlier request is still to be observed
        self._seeded = 0
        # The prompt's rows now, beside the prefill, not in the first proposal: a fused method times its
        # model part's drafting there, and a long prompt's copy would price its drafts too high.
        self._seed(state)

    def _pick(self, logits: np.ndarray, state: DecodeState, index: int, probs: list,
              drafted: list[int]) -> tuple[int, float]:
        """The draft token for sequence index `index` and its probability under the draft. Seeded:
        race q with the target's noise for that index, so the draft agrees with the target's own
        draw as often as their distributions allow under this coupling. Rejection: draw from q and
        keep q for verification. Greedy: the argmax and its softmax probability. Under penalties the
        draft's logits are penalized as the target's will be there (`drafted`: this step's drafts so
        far): an unpenalized self-draft kept proposing the repeats a penalty turns away (SmolLM2 chat,
        repetition_penalty 1.1: 2.3-4.1 tokens a call against 5.0-6.1 without, slower than `ar`)."""
        ids = self.vocab_ids
        if state.penalize is not None and ids is None:  # a draft vocabulary's columns are not the target's ids
            logits = state.penalize(logits, drafted)
        if state.params.greedy:
            best = int(np.argmax(logits))
            if not (self.stop_below or self.runner_up):
                return (best if ids is None else int(ids[best])), 1.0
            scaled = np.exp(logits - logits[best])
            total = float(scaled.sum())
            if self.runner_up:
                scaled[best] = -1.0
                second = int(np.argmax(scaled))
                self._second = (second if ids is None else int(ids[second])), float(scaled[second]) / total
            return (best if ids is None else int(ids[best])), 1.0 / total
        q = state.params.probs(logits)
        if state.noise is not None:
            if ids is None:
                drawn = state.noise.sample(q, index)
                return drawn, float(q[drawn])
            # the race over the full vocabulary with q zero outside the draft vocabulary
            column = race(q, state.noise.exponentials(index, self.vocab_size)[ids])
            return int(ids[column]), float(q[column])
        probs.append(q)
        drawn = sample(q, state.rng)
        return (drawn if ids is None else int(ids[drawn])), float(q[drawn])

    def _table(self, state: DecodeState) -> ConfidenceAcceptance | None:
        """What prices this step's stop rule. Greedy, the instance's table: the tokens are `ar`'s whatever the
        chains. Sampled, the request's own, learned over its steps: rejection sampling's draws follow the
        chains, and a seed replays its tokens only while its chains do not depend on earlier requests
        (README, "Seed-exact sampling")."""
        if self.acceptance is None:
            return None
        if state.params.greedy:
            return self.acceptance()
        if self._sampled is None:
            self._sampled = ConfidenceAcceptance()
        return self._sampled

    def propose(self, state: DecodeState) -> Proposal:
        # Invariant: the draft cache holds committed tokens; feed whatever it lacks (the root,
        # plus the last draft token when every draft was accepted: the T=2 graph, where a
        # padded prompt-chunk call cost 2-6x more). Prefill never pads past the context end.
        self._seed(state)
        cache = self.decoder.cache
        pending = state.tokens[cache.length :]
        room = cache.max_context - cache.length - len(pending)
        k = min(self.k, room)
        self.draft_calls, self.catchup = (0.0, 0), (0.0, 0)  # this proposal's, none yet
        if k <= 0:
            return Proposal.root_only(state.tokens[-1])
        start = time.perf_counter()
        out = self.decoder.prefill(pending, self.chunk)
        assert out is not None  # pending always holds the root at least
        self.catchup = (time.perf_counter() - start, len(pending)) if len(pending) > 2 else (0.0, 0)
        start = time.perf_counter()
        probs: list = [None]  # rejection sampling: the q each draft was drawn from
        first = len(state.tokens)  # drafts[i] is the token for sequence index first + i
        leaves = self.runner_up > 0 and state.params.greedy
        # greedy: (worth, index i, token): the runner-up beside drafts[i], worth the chance it is the target's
        candidates: list[tuple[float, int, int]] = []
        self._second = (0, 0.0)
        table = self._table(state)
        token, p = self._pick(out.logits[-1], state, first, probs, [])
        drafts, picked_probs = [token], [p]
        chance = p if table is None else table.chance(p)
        if leaves:
            candidates.append((self._second[1], 0, self._second[0]))
        for i in range(1, k):
            if chance < self.stop_below:
                break
            pos = cache.length
            out = self.decoder.forward(np.array(drafts[-1:]), np.array([pos]), np.ones((1, 1), bool))
            self.decoder.commit(out, slice(0, 1))
            token, p = self._pick(out.logits[-1], state, first + i, probs, drafts)
            drafts.append(token)
            picked_probs.append(p)
            if leaves:
                candidates.append((chance * self._second[1], i, self._second[0]))
            chance *= p if table is None else table.chance(p)
        self.draft_calls = (time.perf_counter() - start, len(drafts) - 1)
        self._first, self._fed = first, drafts[:-1]
        self._measured = None if table is None else (table, picked_probs, drafts)
        # the leaves worth a row, likeliest first, within the k nodes; each beside its draft (parent: the node before)
        picked = sorted(c for c in candidates if c[0] >= self.runner_up)[::-1][: k - len(drafts)] if leaves else []
        if picked:
            parents = (-1, *range(len(drafts)), *(i for _, i, _ in picked))
            tokens = np.array([state.tokens[-1], *drafts, *(t for _, _, t in picked)], dtype=np.int64)
            return Proposal(Tree(parents), tokens)
        k = len(drafts)
        tokens = np.array([state.tokens[-1], *drafts], dtype=np.int64)
        draft_probs = None
        if len(probs) > 1:  # rejection sampling: q over the full vocabulary (zero outside a draft vocabulary)
            if self.vocab_ids is None:
                draft_probs = np.zeros((k + 1, len(probs[1])))
                draft_probs[1:] = probs[1:]
            else:
                draft_probs = np.zeros((k + 1, self.vocab_size))
                draft_probs[1:, self.vocab_ids] = probs[1:]
        return Proposal(Tree.chain(k), tokens, draft_probs)

    def update(self, state, proposal, verdict, target_out) -> None:
        # Everything but the new root is committed; rejected drafts are simply forgotten, and so is every
        # row after the first fed draft the committed tokens left (a runner-up leaf taken in its place).
        keep = len(state.tokens) - 1
        if self._measured is not None:  # the drafts against the target's tokens, as far as they were committed
            table, probs, drafts = self._measured
            table.observe(probs, drafts, state.tokens[self._first:])
            self._measured = None
        if self._fed is not None:  # not after a plain step (adaptive) or a root-only one
            new = state.tokens[self._first:]
            same = next((i for i, (a, b) in enumerate(zip(new, self._fed)) if a != b), min(len(new), len(self._fed)))
            keep = min(keep, self._first + same)
        self.decoder.cache.truncate(keep)
        self._fed = None

    def _seed(self, state: DecodeState) -> None:
        """A self-draft's cache takes the target's rows of the tokens committed since it last drafted,
        in one copy when it drafts next: a row the batch keeps plain copies nothing (1,148 plain steps
        of 4 batched draft+suffix rows spent 146 us each copying a row: 5% of the batch's time)."""
        if self._copy is not None:
            n = min(self._copy.src.length, len(state.tokens) - 1)
            self._copy(n, min(self._seeded, self.decoder.cache.length))
            self._seeded = n
