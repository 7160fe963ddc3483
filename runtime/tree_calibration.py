"""Tree tuning's calibration hooks (MethodSpec.calibrate): greedy runs that observe a
production drafter from outside and record, against the target's actual tokens, which
top-k ranks of the drafter's candidates held them. runtime/tree_tuning.py fits a tree
to the result; the drafters know nothing of either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .drafters.base import DecodeState, Drafter, Proposal
from .tree_tuning import AcceptanceStats, Calibration

if TYPE_CHECKING:  # the drafters' modules reach this one through the method registry
    from .drafters.eagle import EagleDrafter
    from .drafters.medusa import MedusaDrafter


class ObservedDrafter(Drafter):
    """Forwards every hook to the wrapped drafter; subclasses record around the calls."""

    def __init__(self, inner: Drafter):
        self.inner = inner
        self.name, self.deterministic = inner.name, inner.deterministic

    def prefilled(self, target_out) -> None:
        self.inner.prefilled(target_out)

    def start(self, state: DecodeState) -> None:
        self.inner.start(state)

    def propose(self, state: DecodeState) -> Proposal:
        return self.inner.propose(state)

    def update(self, state, proposal, verdict, target_out) -> None:
        self.inner.update(state, proposal, verdict, target_out)


def _run(export, ids: list[int], method: str, max_new_tokens: int, drafter: Drafter | None = None):
    from .generate import Generation

    # Every step drafts (no adaptive fallback): calibration observes the drafter and its cost per step.
    gen = Generation(export, ids, method=method, max_new_tokens=max_new_tokens, ignore_eos=True, drafter=drafter,
                     adaptive=False)
    gen.result()
    return gen


# ---------------------------------------------------------------- Medusa


class MedusaRecorder(ObservedDrafter):
    """Records what the heads propose where a step starts: the hidden state of each step's last
    accepted node (the next step's proposal reads it), as (sequence index, candidates [heads, top_k]).
    Every accepted node's would over-count: positions inside a long accepted run match well and
    are never a step's start (micro family, 2 prompts x 32: replay 2.65 tokens a step against 1.83
    run; as EagleRecorder, only where steps start)."""

    inner: MedusaDrafter

    def __init__(self, inner):
        super().__init__(inner)
        self.record: list[tuple[int, np.ndarray]] = []

    def update(self, state, proposal, verdict, target_out) -> None:
        self.inner.update(state, proposal, verdict, target_out)
        last = len(state.tokens) - 2  # sequence index of the last accepted node (the bonus token follows)
        ids, _ = self.inner.heads(target_out.hidden[verdict.path[-1]])
        self.record.append((last, ids.copy()))


def calibrate_medusa(export, prompts: list[list[int]], max_new_tokens: int) -> Calibration:
    """Greedy runs of the export's own Medusa method, recording at every committed position
    which rank of each head held the target's actual token."""
    from .methods import build_drafter

    config = export.method_config("medusa")
    stats, matched, steps, side_s = None, [], 0, 0.0
    for ids in prompts:
        recorder = MedusaRecorder(build_drafter(export, config))
        tokens = _run(export, ids, "medusa", max_new_tokens, recorder).state.tokens
        heads = recorder.inner.heads
        if stats is None:
            stats = AcceptanceStats.empty(heads.num_heads, heads.top_k)
        for index, cand in recorder.record:
            if index + heads.num_heads + 1 >= len(tokens):
                continue  # not every depth observable near the end
            ranks: list[int] = []
            for d in range(heads.num_heads):
                stats.trials[d] += 1
                hit = np.flatnonzero(cand[d] == tokens[index + d + 2])
                if not len(hit):
                    break
                stats.hits[d, hit[0]] += 1
                ranks.append(int(hit[0]))
            matched.append(tuple(ranks))
        # Side costs from a plain run (recording runs the heads once per accepted node).
        plain = _run(export, ids, "medusa", max_new_tokens)
        steps += plain.stats["target_calls"]
        side_s += plain.stats["draft_s"] + plain.stats["host_s"]
    assert stats is not None  # tune() refuses an empty prompt list
    return Calibration(stats, matched, side_s / max(steps, 1), [list(p) for p in config.resolved.paths])


# ---------------------------------------------------------------- EAGLE


class EagleRecorder(ObservedDrafter):
    """Drafts as the wrapped EAGLE drafter does; after each catch-up it also walks the true path
    (`teacher`: the whole greedy output, known in advance) through the head and records the
    ranks of the true next tokens in its top-k, up to `depths` levels (cut at the first miss)."""

    inner: EagleDrafter

    def __init__(self, inner, teacher: list[int], depths: int):
        super().__init__(inner)
        self.teacher, self.depths = teacher, depths
        self.record: list[tuple[int, ...]] = []

    def propose(self, state: DecodeState) -> Proposal:
        out = self.inner.catch_up(state)
        if out is not None:
            self._record_ranks(state, out)
        return self.inner.draft(state, out)

    def _record_ranks(self, state: DecodeState, first) -> None:
        head, depths = self.inner.head, self.depths
        start = len(state.tokens)
        truth = self.teacher[start : start + depths]
        if len(truth) < depths:
            return
        committed = head.cache.length
        ranks: list[int] = []
        ids, feat = first.ids[-1], first.hidden[-1:]
        try:
            for depth, token in enumerate(truth, start=1):
                hit = np.flatnonzero(ids == token)
                if not len(hit):
                    break
                ranks.append(int(hit[0]))
                if depth == depths or committed + depth > head.max_context:
                    break
                # A chain: the node at `depth` sees the rows of its depth - 1 ancestors and itself.
                out = head.forward(np.array([token], np.int64), feat, np.array([committed + depth - 1]),
                                   np.ones((1, depth), bool))
                head.commit(out, slice(0, 1))
                ids, feat = out.ids[0], out.hidden[:1]
        finally:
            head.rewind(committed)  # the walk's rows are dropped, as a draft's are
        self.record.append(tuple(ranks))


def calibrate_eagle(export, prompts: list[list[int]], max_new_tokens: int) -> Calibration:
    """Greedy runs recording, per step, the ranks of the target's actual next tokens in the
    head's top-k along the true path (for a static EAGLE-1 tree)."""
    from .methods import build_drafter

    config = export.method_config("eagle")
    # Deep enough for both the dynamic depth and the configured static tree.
    depths = max(config.depth, config.tree_paths.depth if config.tree_paths else 0)
    stats, matched, steps, side_s = None, [], 0, 0.0
    for ids in prompts:
        # The export's own mode drafts; the ranks are recorded along the true path either way.
        plain = _run(export, ids, "eagle", max_new_tokens)  # the target's greedy output, and the drafting cost
        steps += plain.stats["target_calls"]
        side_s += plain.stats["draft_s"] + plain.stats["host_s"]
        recorder = EagleRecorder(build_drafter(export, config), plain.state.tokens, depths)
        _run(export, ids, "eagle", max_new_tokens, recorder)
        if stats is None:
            stats = AcceptanceStats.empty(depths, recorder.inner.head.top_k)
        for ranks in recorder.record:
            for d, r in enumerate(ranks):
                stats.trials[d] += 1
                stats.hits[d, r] += 1
            if len(ranks) < depths:
                stats.trials[len(ranks)] += 1  # tried, and the true token was not among the top-k
            matched.append(ranks)
    current = [list(p) for p in config.tree_paths.paths] if config.tree_paths else []
    assert stats is not None  # tune() refuses an empty prompt list
    return Calibration(stats, matched, side_s / max(steps, 1), current)
