"""Fused drafting: two drafters' candidates merged into one draft tree per step.

Prompt lookup and suffix decoding win where text is copied, a draft model, EAGLE and Medusa
where it is not; one verify call can try both. Each step both parts propose their own tree (sized
to the whole budget); the fused drafter merges the nodes worth their verify rows into one
trie under the root of at most `nodes` candidates (below).

The parts are a model part (the draft model: a call per draft; EAGLE, Medusa: head calls every
step it drafts; lookahead: its Jacobi window's rows in the verify call) and a host part (suffix, prompt lookup: next to
free). The host part proposes first; with `lazy`, the model part sits the step out unless the
tokens per second expected with its drafts beat those without, by what it measurably added
in the steps it drafted: the accepted drafts past the host's placed nodes (a head or trie that
agrees with the copy adds nothing), against its cost: its drafting time, and the step's time at
the verify size its rows (its nodes, lookahead's window) add to the host's, over the step's time
without them. A step's time by verify size is measured (`StepCosts`: the fused steps run on this
export, per size), not priced per row: a call's cost is far from linear in its rows (SmolLM2 on
2 cores: T=1/2/3/9/15 15.8/19.2/20.2/25.4/31.5 ms), so two rows beside a one-row copy cost more
than two beside a six-row one. Beside a host proposal and alone (the host has nothing) are measured
apart: a part that does not pay alone (EAGLE or Medusa on chat) is no more drafted for want of a
copy, and one that pays more alone than beside a mostly wrong copy (the draft model on chat)
drafts in the copy's place (`model_alone_beats_both`; the copy's proposal is still measured).
A step it sits out is the host part's own step, its proposal cut as the host cuts it running alone
(`Drafter.sized`: the prefix whose expected tokens per second is best at the step times measured
here), not the merge's threshold, which is looser because it prices the model part's drafts as
paid for: on the int4 target sat-out steps verified wider calls for no more tokens than prompt lookup alone.
Such a step tells nothing new of the model part; what it is expected to add scales with the host's
miss rate now against where it was measured, so a host whose copies stop being taken brings it
back, and after a spell out it drafts two steps anyway (PROBE_AFTER: a probe, ever rarer while
probes find it does not pay), so one slow drafting step cannot leave it out. A skipped EAGLE
head catches up on the skipped steps' features the next time it drafts.
Lookahead's window (auxiliary rows after the tree, runtime/drafters/lookahead.py) rides in the
merged step, its rows taken from the node budget (verify T stays `nodes` + 1); a step it sits
out runs no window, and its window then refills from fresh outputs. Its trie holds only its
pool's n-grams here: the host part copies. Its drafts cost no model call, so a merged tree with
lookahead is cut as a host part cuts its own (best_prefix), not at the merge's threshold.
Timing decides only which drafts are tried, never which tokens are emitted.

Which nodes go in is one rule for every pair (drafters/tree_budget.py): a node is worth the
chance that the target's path runs through it, and goes in, best first, while that is at least
a verify row's cost (`row_threshold`: measured on the export, `row_cost` until then) and the
budget lasts. Each part's acceptance per sibling rank is measured in this
request on its own full proposal (the committed tokens walked down it), so a part's child is worth
its merged parent's worth times that acceptance, at most what the parent's earlier-placed children
left: beside a confident copy a head's different guess is worth only the copy's miss rate. A part
with a long confident match takes the budget, the other shrinks to what its own acceptance still
pays for, and the tree is only as large as its rows pay for. Verification is unchanged
(runtime/verify.py): the merged nodes are deterministic drafts, so greedy output equals plain
greedy decoding and seeded sampling (the fused methods' default) equals `ar`'s; the draft model
races the target's noise there, a function of the seed and the position. Under rejection sampling
(asked for) the draft model's drafts are draws, and the merged tree verifies them as the point masses
they are once drawn: exact, since they are drawn before, and apart from, the verification's own
randomness, but accepted with p(x) rather than min(1, p(x) / q(x)) (tests/test_sampling_lossless.py).

A part's config is the export's config of that method, widened to the budget where it
has a size (EAGLE-2's total_tokens, suffix's max_nodes, prompt lookup's k); a static tree
(Medusa, EAGLE-1) stays as exported. A request's overrides set the fused method's own
keys only.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..adaptive import STALL, on_by_default
from ..config import positive_int, with_overrides
from ..errors import SpecDeployError
from .acceptance import DECAY, RankAcceptance
from .base import BatchPrice, DecodeState, Drafter, Proposal
from .lookahead import LookaheadDrafter
from .prompt_lookup import PromptLookupConfig
from .step_costs import StepCosts, best_prefix
from .tree_budget import PartProposal, merge, walked

# The config key that sizes a part's proposal (candidate nodes), widened to the fused budget.
_SIZE_KEYS = {"eagle": "total_tokens", "suffix": "max_nodes", "prompt-lookup": "k"}
# A verify row's cost in steps past the first (SmolLM2 on 2 cores, T=4/9/15 1.1/1.4/1.7x T=1), prompt
# lookup's prior per row (drafters/step_costs.py), until the export's step times are measured
# (FusedDrafter.row_threshold). Here a merged node's worth must reach it: a threshold,
# looser than the tokens-per-second prefix the host drafters verify alone, which measured 2-8% slower here
# (the model part's drafts are paid for before the merge; SmolLM2, 6 prompts a set, ABBA in 2 processes).
ROW_COST = PromptLookupConfig.row_cost
# Steps the model part sits out before it drafts two steps anyway (a probe: the second is timed,
# the first pays a skipped head's catch-up), doubling while probes leave it out, back to the first
# once it pays. A step it sits out measures nothing of it: one slow drafting step (cold caches after
# an idle spell, another process's load) left the model part out for the rest of a request.
PROBE_AFTER = (8, 128)


@dataclass(frozen=True)
class FusedConfig:
    """Base of the fused methods: `parts` names the two registered methods it merges, (model, host)."""

    method: ClassVar[str]
    parts: ClassVar[tuple[str, str]]

    # candidate nodes per step, lookahead's window rows included (verify T = nodes + 1 = 15: the graph
    # prompt-lookup and suffix already use, so every export has it)
    nodes: int = 14
    prior: float = 1.0  # accepted drafts per step assumed of each part before it is measured
    # a verify row's cost in decode steps until the export's step times are measured (then theirs): a node
    # goes in while the chance the target's path runs through it is at least this (0: fill the budget, rows
    # are free, e.g. a GPU); with call_cost, the shape of a step's time by verify size until then (StepCosts)
    row_cost: float = ROW_COST
    # what a call of more than one row costs over a plain step besides its rows, in decode steps (SmolLM2
    # float32, 2 cores, past 300: T=1/2/3/9/15 calls 15.8/19.2/20.2/25.4/31.5 ms, so 0.2 and then ~0.05 a
    # row; 0: rows only)
    call_cost: float = 0.2
    decay: float = 0.7  # weight of the past in each part's running acceptance (per step it proposes)
    # the model part (EAGLE, Medusa, lookahead) is not asked to draft in a step where the host part (suffix,
    # prompt lookup) proposes and drafting with the model is not worth its time: its head calls (window rows)
    # are saved
    lazy: bool = True

    def __post_init__(self):
        positive_int(self.nodes, f"{self.method}.nodes", 2)
        if not isinstance(self.lazy, bool):
            raise SpecDeployError(f"config: {self.method}.lazy must be true or false, got {self.lazy!r}")
        for key, low, high in (("prior", 0.0, math.inf), ("decay", 0.0, 1.0), ("row_cost", 0.0, 1.0),
                               ("call_cost", 0.0, math.inf)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value < high \
                    or (key == "prior" and value <= 0):
                bound = {"prior": "a number > 0", "call_cost": "a number >= 0"}.get(key, "a number in [0, 1)")
                raise SpecDeployError(f"config: {self.method}.{key} must be {bound}, got {value!r}")

    @property
    def verify_tokens(self) -> int:
        return self.nodes + 1


@dataclass(frozen=True)
class EagleSuffixConfig(FusedConfig):
    method: ClassVar[str] = "eagle+suffix"
    parts: ClassVar[tuple[str, str]] = ("eagle", "suffix")


@dataclass(frozen=True)
class EaglePromptLookupConfig(FusedConfig):
    method: ClassVar[str] = "eagle+prompt-lookup"
    parts: ClassVar[tuple[str, str]] = ("eagle", "prompt-lookup")


@dataclass(frozen=True)
class MedusaSuffixConfig(FusedConfig):
    method: ClassVar[str] = "medusa+suffix"
    parts: ClassVar[tuple[str, str]] = ("medusa", "suffix")


@dataclass(frozen=True)
class MedusaPromptLookupConfig(FusedConfig):
    method: ClassVar[str] = "medusa+prompt-lookup"
    parts: ClassVar[tuple[str, str]] = ("medusa", "prompt-lookup")


@dataclass(frozen=True)
class LookaheadSuffixConfig(FusedConfig):
    method: ClassVar[str] = "lookahead+suffix"
    parts: ClassVar[tuple[str, str]] = ("lookahead", "suffix")


@dataclass(frozen=True)
class LookaheadPromptLookupConfig(FusedConfig):
    method: ClassVar[str] = "lookahead+prompt-lookup"
    parts: ClassVar[tuple[str, str]] = ("lookahead", "prompt-lookup")


@dataclass(frozen=True)
class DraftSuffixConfig(FusedConfig):
    method: ClassVar[str] = "draft+suffix"
    parts: ClassVar[tuple[str, str]] = ("draft", "suffix")


@dataclass(frozen=True)
class DraftPromptLookupConfig(FusedConfig):
    method: ClassVar[str] = "draft+prompt-lookup"
    parts: ClassVar[tuple[str, str]] = ("draft", "prompt-lookup")


CONFIGS = (EagleSuffixConfig, EaglePromptLookupConfig, MedusaSuffixConfig, MedusaPromptLookupConfig,
           LookaheadSuffixConfig, LookaheadPromptLookupConfig, DraftSuffixConfig, DraftPromptLookupConfig)


def part_config(export, part: str, nodes: int):
    """The export's config of `part`, its proposal widened to `nodes` candidates where it has a size.

    A part that sizes its drafts by their rows' cost (prompt lookup's call_cost, row_cost) proposes its whole
    size: trimming is the merge's (by the part's acceptance on its own proposal), while the part's
    own length rule would read the merged step's verdict, the other part's drafts counted in."""
    config = export.method_config(part)
    key = _SIZE_KEYS.get(part)
    if key is None or getattr(config, "mode", None) == "eagle1":  # a static tree keeps its size
        return config
    size = nodes
    if part == "eagle":  # at most the candidates its top_k and depth grow
        size = min(nodes, config.top_k + (config.depth - 1) * config.top_k ** 2)
    free = {"call_cost": 0.0, "row_cost": 0.0} if hasattr(config, "row_cost") else {}
    return with_overrides(config, {key: size, **free}, part)


def part_configs(export, config: FusedConfig) -> dict:
    """{part: the config its drafter is built with} over this export."""
    return {p: part_config(export, p, config.nodes) for p in config.parts}


def build(export, config: FusedConfig) -> FusedDrafter:
    from ..methods import method_spec  # the registry imports this module

    configs = part_configs(export, config)
    drafters = [method_spec(p).build(export, c) for p, c in configs.items()]
    for drafter in drafters:
        if isinstance(drafter, LookaheadDrafter):  # the host part copies: its trie holds only the pool's n-grams
            drafter.suffix_match = False
    window = window_rows(configs[config.parts[0]])
    if window >= config.nodes:
        raise SpecDeployError(f"method {config.method!r}: {config.method}.nodes ({config.nodes}) leaves no "
                              f"candidate beside the lookahead window's {window} row{'s' * (window != 1)}; raise nodes")
    learned = export.part(f"fused-learned:{config!r}", Learned)
    return FusedDrafter(config, drafters, window, learned, on_by_default())


def window_rows(config) -> int:
    """Auxiliary rows a part's proposals add to the verify call (lookahead's window, less its root cell)."""
    if getattr(config, "method", None) != "lookahead":
        return 0
    return (config.ngram - 1) * config.window - 1


def with_aux(merged: Proposal, part: Proposal) -> Proposal:
    """The merged tree with `part`'s auxiliary rows after it: they see the root and each other only."""
    if part.aux_tokens is None:
        return merged
    own, size, aux = part.tree.size, merged.tree.size, len(part.aux_tokens)
    assert part.aux_mask is not None and not part.aux_mask[:, 1:own].any()  # no aux row sees a candidate
    mask = np.zeros((aux, size + aux), dtype=bool)
    mask[:, 0] = part.aux_mask[:, 0]
    mask[:, size:] = part.aux_mask[:, own:]
    return Proposal(merged.tree, merged.tokens, None, part.aux_tokens, part.aux_positions, mask)


class Measured:
    """What requests of one sampling scheme measured of a fused method's model part by their latest step."""

    def __init__(self) -> None:
        self.added: list[float] | None = None
        self.model_rows: list[float] = []
        self.missed: list[float] = []
        # the parts' measured acceptance (per step, per sibling rank) at the latest step: `missed` was
        # measured against the host's, so a request that restarted the host's from the prior (a miss
        # rate of 0.5, against 0.3 measured on grounded text) would expect the model part to add 1.7x
        # what it did, and draft beside copies it cannot improve on (lookahead's window then takes
        # 8 of the copy's 14 nodes: 6 such steps a request on grounded prompts)
        self.acceptance: list[float] | None = None
        self.rates: list[RankAcceptance] = []
        # the model part's drafting time and where its probes stood (PROBE_AFTER): a request that
        # started unmeasured drafted its first step, and probed after 8 steps out, whatever the last
        # requests had found; on short requests where it does not pay (suffix's copies on the
        # repeated set, 30 steps a request) those were a sixth of the steps it drafted
        self.model_s: float | None = None
        # steps sat out since the last probe, the wait, the probe's steps left (one cut by a request's end goes on)
        self.probe: tuple[int, int, int] = (0, PROBE_AFTER[0], 0)


class Learned:
    """What a fused method measured of its model part's drafts by the latest step on this export (per
    loaded export, as the adaptive policy's timings): a request starts from it, its added drafts moved
    one step back toward the prior, its drafting time and its probes' wait as they were, not from the
    prior, which takes several steps to be measured down where the part does not pay. Step times by
    verify size are the export's (`StepCosts`): every request adds to them.
    The rest is kept per sampling scheme (`Measured`): the draft model agrees with the target's
    greedy token far more often than with its sample, and a seeded request that started from a greedy
    code request's measurements (the copy taking nearly everything, the model part adding little) sat
    its model part out: 1.03 tokens per call in a batched service, 2.67 at batch 1 after seeded ones."""

    def __init__(self) -> None:
        self.costs: StepCosts | None = None
        self.schemes: dict[str, Measured] = {}  # "greedy", "seeded", "rejection"


class FusedDrafter(Drafter):
    deterministic = True

    def __init__(self, config: FusedConfig, parts: list[Drafter], window: int = 0, learned: Learned | None = None,
                 timed: bool = True):
        """`timed`: steps and drafting are timed (adaptation on); else the prior shape of a step's time
        decides alone, and the model part drafts wherever that says its rows pay. Timed in a batched
        service too, unlike the host drafters' sizes (step_costs.steps_timed): the batch's policy trims
        the proposal but does not decide whether the model part drafts it, and untimed there it drafted
        whole chains the policy then cut (SmolLM2 draft+prompt-lookup, 4 clients of a batch of 8,
        loopback: 0.92x the timed drafter's tokens per second over 2 rounds)."""
        self.config, self.parts, self.timed = config, parts, timed
        # Lazy, it decides per step whether the model part's drafts pay for their time and rows, and
        # the merge places only nodes worth their rows: the step-time policy would only add plain steps
        # where the host part copies for free (repeated requests, 12 prompts x 2 passes: medusa+suffix
        # 36 and lookahead+suffix 43 plain steps, 0.93x and 0.86x suffix alone)
        self.sizes_own_rows = config.lazy
        self.window = window  # the model part's auxiliary rows per step it drafts (lookahead's window)
        # Lookahead drafts on the host, from its pool: only its rows cost, as a host part's do, so a merged tree
        # is cut where its expected tokens per second is best (best_prefix), as suffix and prompt lookup cut
        # their own, not at the merge's looser threshold, which prices a model part's drafts as paid for
        # (lookahead+suffix verified 9% more rows than suffix alone for the same tokens: 0.95-0.97x its speed)
        self.cut_like_host = isinstance(parts[0], LookaheadDrafter)
        self.learned = learned or Learned()
        self.name = config.method

    def prefilled(self, target_out) -> None:
        for part in self.parts:
            part.prefilled(target_out)

    def start(self, state: DecodeState) -> None:
        for part in self.parts:
            part.start(state)
        self.acceptance = [float(self.config.prior)] * len(self.parts)  # accepted drafts per step
        # each part's acceptance per sibling rank, on its own proposals (drafters/tree_budget.py)
        self.rates = [RankAcceptance() for _ in self.parts]
        # per step the model part drafts (running), alone [0] or beside a host proposal [1]: the accepted
        # drafts it adds past the host's placed nodes, and the verify rows it adds (its nodes, lookahead's window)
        scheme = "greedy" if state.params.greedy else "seeded" if state.noise is not None else "rejection"
        self._measured = learned = self.learned.schemes.setdefault(scheme, Measured())
        if self.learned.costs is None:
            self.learned.costs = StepCosts(self.config.call_cost, self.config.row_cost)
        prior, keep = float(self.config.prior), DECAY
        self.added = [prior] * 2
        self.model_rows = [float(self.window)] * 2
        self.missed = [1.0, 0.5]  # the host's miss rate (1 - its first draft's acceptance) in those steps
        self.host_rows = 0.0  # the host part's placed nodes per step (running)
        self.last: list[PartProposal] = []  # this step's parts and their placement (tests read it)
        self.costs = self.learned.costs
        if learned.added is not None:
            self.added = [keep * a + (1 - keep) * prior for a in learned.added]
            self.model_rows, self.missed = list(learned.model_rows), list(learned.missed)
        if learned.acceptance is not None:  # where the parts stood: this request's steps soon outweigh it
            self.acceptance, self.rates = list(learned.acceptance), [copy.deepcopy(r) for r in learned.rates]
        self._host_s, self._proposed_at, self._drafted, self._alone, self._own = 0.0, 0.0, False, False, False
        # running seconds of the model part's drafting in a step after one it drafted (a skipped EAGLE
        # head's catch-up is the price of having skipped), as the last request left them
        self.model_s = learned.model_s
        self._sat_out, self._probe_wait, self._probing = learned.probe  # steps; the wait; probe steps left

    def row_threshold(self) -> float:
        """A merged node's least worth: a verify row's cost in plain steps, the export's measured slope of a
        step's time from 2 rows to the full budget once sizes are measured (StepCosts), `row_cost` before
        (0: rows are free). A fixed 0.05 fits float32 (SmolLM2: 0.06 measured) but not a quantized target,
        whose rows cost 0.1-0.2 of its cheap step: there the merge verified wider calls for no more tokens
        than prompt lookup alone (int4 eagle+prompt-lookup, code: 15.3 ms of verify a step against 12.5)."""
        if not self.config.row_cost or not self.costs.measured:
            return self.config.row_cost
        top = self.config.nodes + 1
        return max(0.0, (self.costs.relative(top) - self.costs.relative(2)) / (top - 2))

    def _average(self, old: float | None, new: float) -> float:
        """The running drafting time: a sample over STALL x the average counts as STALL x (a stall), and one
        under 1/STALL x restarts it (the average held a stall: a request's first, cold drafting step)."""
        if old is None or new * STALL < old:
            return new
        return self.config.decay * old + (1 - self.config.decay) * min(new, STALL * old)

    def model_worth_it(self, hosted: bool = True) -> bool:
        """Whether the model part's drafts are expected to buy more tokens per second than they cost,
        beside a host proposal (`hosted`) or alone: (1 + host + added) tokens in a step of the host's
        verify size plus the model's rows, plus its drafting time, against (1 + host) in a step of the
        host's size (alone: a plain step's). `added` and the model's rows are measured in steps it
        drafted (what it adds past the host's placed nodes, not what it accepts: a head agreeing with
        the copy adds nothing); the step times by size are measured (StepCosts)."""
        host, added, without, with_model = self._step(hosted)
        costs = self.costs
        if (1 + host + added) * costs.shape(without) <= (1 + host) * costs.shape(with_model):
            return False  # not worth its rows even if drafting were free (the prior shape of a step's time)
        rates = self.tokens_per_second(hosted)
        return rates is None or rates[1] > rates[0]  # not measured yet: draft, and measure

    def _step(self, hosted: bool) -> tuple[float, float, float, float]:
        """The host's accepted drafts, what the model part would add, and the verify size without and with it."""
        without = 1 + (self.host_rows if hosted else 0.0)
        # at least one row of its own: a part whose drafts all were the host's adds nothing for its time
        return (self.acceptance[1] if hosted else 0.0, self.expected_added(hosted), without,
                without + max(self.model_rows[hosted], 1.0))

    def pays_in_batch(self, hosted: bool, price: BatchPrice) -> bool:
        """In a batch of several rows (`price`: runtime/batching/policy.py): whether the accepted drafts the
        model part is expected to add are worth, at the batch's plain seconds per token, what its drafting
        and its rows add to the call that every row waits for (without a copy, its run's own cost too):
        the policy's rule for a method that always calls its model. Priced at its own step's rate instead,
        a self-draft beside prompt lookup drafted while 2 or 4 rows waited on its calls: 0.96x plain batching
        at 4 clients, where prompt lookup alone ran 1.11x (SmolLM2, chat, code and grounded prompts)."""
        if self.model_s is None:
            return True  # not measured yet: draft, and measure
        rows = max(self.model_rows[hosted], 1.0)
        cost = self.model_s + rows * price.row_s + (0.0 if hosted else price.run_s)
        return self.expected_added(hosted) * price.token_s > cost

    def tokens_per_second(self, hosted: bool) -> tuple[float, float] | None:
        """A step's expected tokens per second without the model part's drafts and with them, beside a
        host proposal (`hosted`) or alone; None until its drafting and the step times are measured."""
        if self.model_s is None or not self.costs.measured:
            return None
        host, added, without, with_model = self._step(hosted)
        seconds = self.costs.seconds
        return (1 + host) / seconds(without), (1 + host + added) / (seconds(with_model) + self.model_s)

    def model_alone_beats_both(self) -> bool:
        """Beside a host proposal the model part drafts (model_worth_it): whether it is expected to do
        better without the host's nodes, as where it drafts alone. A copy that is mostly wrong (chat)
        costs rows, and what the model adds past it was measured lower than what it adds alone (SmolLM2's
        int4 self-draft on chat: 0.9-1.5 accepted drafts a step beside suffix's copies, 1.4-1.9 alone)."""
        hosted, alone = self.tokens_per_second(True), self.tokens_per_second(False)
        return hosted is not None and alone is not None and alone[1] > max(hosted)

    def host_misses(self, hosted: bool) -> float:
        return 1 - self.rates[1].at(0) if hosted else 1.0

    def expected_added(self, hosted: bool) -> float:
        """The accepted drafts the model part would add this step: as measured where it drafted, scaled
        by how often the host's first draft misses now against then (a host whose copies stop being
        taken brings it back; a step it sits out tells nothing new of it)."""
        return self.added[hosted] * self.host_misses(hosted) / max(self.missed[hosted], 1e-3)

    def _probe(self, rows: int = 1) -> bool:
        """Whether the model part, not worth its drafts by the estimates, drafts anyway (PROBE_AFTER): in a
        batch of `rows`, each row probes 1/rows as often, since every row waits on a probe (4 rows probing on
        a row's schedule: 34 of 165 steps drafted, 0.93-1.02x plain batching against 1.05-1.07x never drafting)."""
        if not self._probing and self._sat_out >= self._probe_wait * rows:
            self._probing, self._sat_out = 2, 0
            self._probe_wait = min(2 * self._probe_wait, PROBE_AFTER[1])
        if self._probing:
            self._probing -= 1
            return True
        self._sat_out += 1
        return False

    def propose(self, state: DecodeState) -> Proposal:
        # The host part (second: suffix, prompt lookup) first: it costs next to nothing.
        (model, host), root = self.parts, state.tokens[-1]
        t0 = time.perf_counter()
        host_proposal = host.propose(state)
        t1 = time.perf_counter()
        self._host_s = t1 - t0
        hosted = host_proposal.tree.size > 1
        price = self.batch_price
        # lazy: the model part drafts where it pays, beside the copy or (where that pays better) in its place;
        # in a batch of several rows, where it pays the batch (pays_in_batch)
        self._alone = self.config.lazy and hosted and price is None and self.model_alone_beats_both()
        worth = self.config.lazy and (self._alone or (self.model_worth_it(hosted) if price is None
                                                      else self.pays_in_batch(hosted, price)))
        if worth and not self._probing:
            self._sat_out, self._probe_wait = 0, PROBE_AFTER[0]
        self.self_priced_s = 0.0
        if self.config.lazy and not (worth or self._probe(1 if price is None else price.rows)):
            model_proposal = Proposal.root_only(root)
            own = host.sized(self.costs) if hosted else None
            if own is not None:  # the host part's step alone, as it sizes it running alone (module docstring)
                self.last = [PartProposal(model_proposal), PartProposal(host_proposal)]  # measured on the whole
                self._own, self._drafted, self._alone = True, False, False
                self._proposed_at = time.perf_counter()
                return own
        else:
            model_proposal = model.propose(state)
            if self.config.lazy:  # its drafting was weighed here (model_worth_it, pays_in_batch)
                self.self_priced_s = time.perf_counter() - t1
            if self.timed and (self._drafted or self.model_s is None):
                self.model_s = self._average(self.model_s, time.perf_counter() - t1)
        self._own = False
        self._drafted = model_proposal.tree.size > 1
        self._alone = self._alone and (self._drafted or model_proposal.aux_tokens is not None)  # else keep the copy
        placed = [PartProposal(model_proposal), PartProposal(host_proposal)]
        self.last = placed
        # the model part's window rows (lookahead) come out of the budget in a step it drafts
        budget = self.config.nodes - (0 if model_proposal.aux_tokens is None else len(model_proposal.aux_tokens))
        # a copy left out is still measured on its whole proposal (update): the target's tokens are the same
        merged = merge([placed[0], PartProposal(Proposal.root_only(root))] if self._alone else placed, self.rates,
                       budget, self.row_threshold(), root)
        aux = 0 if model_proposal.aux_tokens is None else len(model_proposal.aux_tokens)
        drafts = best_prefix(merged.worth[1:], self.costs, 1 + aux) if self.cut_like_host else None
        proposal = with_aux(merged.proposal(drafts), model_proposal)
        self._proposed_at = time.perf_counter()
        return proposal

    def update(self, state: DecodeState, proposal: Proposal, verdict, target_out) -> None:
        # Both parts read the merged step: the accepted path's rows (EAGLE's features, Medusa's
        # hidden state) and the committed tokens are what they would read of their own.
        for part in self.parts:
            part.update(state, proposal, verdict, target_out)
        if not self.last:  # a plain step (adaptive), not this drafter's
            return
        if self.timed:
            self.costs.observe(proposal.size, time.perf_counter() - self._proposed_at + self._host_s)
        committed = state.tokens[len(state.tokens) - len(verdict.path):]  # accepted drafts + the bonus
        keep = self.config.decay
        for i, placed in enumerate(self.last):
            tree = placed.proposal.tree
            if tree.size > 1:  # a part that proposed nothing is not measured this step
                got, _ = walked(tree, placed.proposal.tokens, committed)
                self.acceptance[i] = keep * self.acceptance[i] + (1 - keep) * got
                self.rates[i].observe(tree, placed.proposal.tokens, committed)
        model, host = self.last
        hosted = host.proposal.tree.size > 1 and not self._alone  # a copy left out: a step the model drafted alone
        # the step's nodes the host placed (the root's included): all of them in a step of its own
        hosts = set(range(proposal.size)) if self._own else set(host.merged.values()) if hosted else {0}
        # as verified: a batch's policy may have cut the merged tree to its first nodes (policy.truncated), and
        # the host's nodes it cut counted as rows the model part had not added (its rows went below zero)
        hosts = {node for node in hosts if node < proposal.tree.size}
        if hosted:
            self.host_rows = keep * self.host_rows + (1 - keep) * (len(hosts) - 1)
        if model.proposal.tree.size > 1 or model.proposal.aux_tokens is not None:
            # past the host's placed nodes: the accepted path's nodes after its host-placed prefix
            prefix = next((j for j, node in enumerate(verdict.path) if node not in hosts), len(verdict.path))
            # over about its last ten drafted steps (a part's acceptance's decay): what a head adds comes in
            # runs, and a few steps that add nothing must not leave it out of a request where it pays
            keep = DECAY
            self.added[hosted] = keep * self.added[hosted] + (1 - keep) * (len(verdict.path) - prefix)
            self.model_rows[hosted] = keep * self.model_rows[hosted] + (1 - keep) * (proposal.size - len(hosts))
            self.missed[hosted] = keep * self.missed[hosted] + (1 - keep) * self.host_misses(hosted)
        learned = self._measured
        learned.added, learned.model_rows, learned.missed = list(self.added), list(self.model_rows), list(self.missed)
        learned.acceptance, learned.rates = self.acceptance, self.rates  # copied by the next request's start
        learned.model_s, learned.probe = self.model_s, (self._sat_out, self._probe_wait, self._probing)
        self.last = []
