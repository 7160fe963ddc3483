"""Repetition, frequency and presence penalties and logit biases, applied where the target's logits
choose a token.

Their meanings are those of the APIs users know, applied to the logits before temperature, top-k
and top-p, in this order:
- `repetition` (HF transformers' `repetition_penalty`, 0.01 to 100; 1: none): every token of the
  prompt and of the output so far has its logit divided by it where positive, multiplied where not
  (HF takes any value > 0; past these bounds float32 logits turn 0 or inf, and the choice garbage);
- `frequency` and `presence` (OpenAI's `frequency_penalty`, `presence_penalty`, -2..2; 0: none):
  a token of the output so far loses `frequency` x its count, and `presence` once;
- `logit_bias` (OpenAI's: {token id: -100..100}, at most MAX_BIASES): added to those tokens'
  logits at every position (-100 bans a token in practice, 100 all but forces it).

Lossless as everything else: a verify row is penalized by the tokens before it, the committed
ones and the accepted drafts on its path (runtime/verify.py walks that path), so each token is
chosen from exactly the distribution plain decoding with the same penalties chooses from, and
every method emits `ar`'s tokens (greedy, or seeded with the same seed). Drafters propose from
their own, unpenalized guesses: a penalty can only lower acceptance, never change the output.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .errors import SpecDeployError
from .sampling import as_int, as_real

MAX_BIASES = 300  # OpenAI's limit on logit_bias entries
REPETITION = (0.01, 100.0)  # repetition_penalty's bounds: far past any use, short of float32's ends


@dataclass(frozen=True)
class Penalties:
    repetition: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); a mapping is taken too

    def __post_init__(self):
        for name, value, ok, bound in (
                ("repetition_penalty", self.repetition, lambda v: REPETITION[0] <= v <= REPETITION[1],
                 f"a number from {REPETITION[0]} to {REPETITION[1]:g}"),
                ("frequency_penalty", self.frequency, lambda v: -2 <= v <= 2, "a number from -2 to 2"),
                ("presence_penalty", self.presence, lambda v: -2 <= v <= 2, "a number from -2 to 2")):
            v = as_real(value)
            if v is None or not math.isfinite(v) or not ok(v):
                raise SpecDeployError(f"{name} must be {bound}, got {value!r}")
        for field in ("repetition", "frequency", "presence"):
            object.__setattr__(self, field, float(getattr(self, field)))
        object.__setattr__(self, "logit_bias", _checked_bias(self.logit_bias))

    @property
    def active(self) -> bool:
        return self.repetition != 1.0 or self.frequency != 0.0 or self.presence != 0.0 or bool(self.logit_bias)

    def check_vocab(self, vocab: int) -> None:
        bad = [t for t, _ in self.logit_bias if t >= vocab]
        if bad:
            raise SpecDeployError(f"logit_bias token ids out of range [0, {vocab}): {bad[:5]}")


def _checked_bias(bias) -> tuple[tuple[int, float], ...]:
    items = bias.items() if isinstance(bias, Mapping) else bias
    if isinstance(items, (str, bytes)) or not hasattr(items, "__iter__"):
        raise SpecDeployError(f"logit_bias must map token ids to numbers, got {type(bias).__name__}")
    out: dict[int, float] = {}
    for item in items:
        if not isinstance(item, tuple) or len(item) != 2:
            raise SpecDeployError("logit_bias must map token ids to numbers")
        token, value = as_int(item[0]), as_real(item[1])
        if token is None or token < 0:
            raise SpecDeployError(f"logit_bias keys must be token ids (integers >= 0), got {item[0]!r}")
        if value is None or not -100 <= value <= 100:
            raise SpecDeployError(f"logit_bias values must be numbers from -100 to 100, got {item[1]!r} "
                                  f"for token {token}")
        out[token] = value
        if len(out) > MAX_BIASES:
            raise SpecDeployError(f"logit_bias has more than {MAX_BIASES} entries")
    return tuple(sorted(out.items()))


class PenaltyContext:
    """One request's penalties over what it has committed: `apply(row, path)` penalizes one verify
    row's logits for the context before it (the committed tokens, then `path`, the drafts accepted
    on the way to that row); `commit(tokens)` after each step.

    The committed part is kept as arrays, rebuilt once a step, so a row costs a few gathers
    whatever the context's length (sets and Counters rebuilt per row: 0.2-0.5 ms at 2,500 tokens).
    A token on the path is penalized from its count in one expression, as a row after the same
    tokens committed would be: the same float32 operations, so the same logits bit for bit."""

    def __init__(self, penalties: Penalties, prompt_ids: list[int]):
        self.penalties = penalties
        self.seen = set(prompt_ids)  # prompt and output: the repetition penalty's tokens
        self.counts: Counter[int] = Counter()  # output only: frequency and presence
        self.bias_ids = np.array([t for t, _ in penalties.logit_bias], np.int64)
        self.bias = np.array([v for _, v in penalties.logit_bias], np.float32)
        self._arrays()

    def commit(self, tokens: list[int]) -> None:
        self.seen.update(tokens)
        self.counts.update(tokens)
        self._arrays()

    def _arrays(self) -> None:
        self.seen_ids = np.fromiter(self.seen, np.int64, len(self.seen))
        self.count_ids = np.fromiter(self.counts.keys(), np.int64, len(self.counts))
        self.count_n = np.fromiter(self.counts.values(), np.float32, len(self.counts))

    def apply(self, logits: np.ndarray, path: list[int]) -> np.ndarray:
        """The target's logits are the vocabulary; a draft model's may be fewer (a draft whose embedding is
        padded differently, export/draft_vocab.py): ids past its row are skipped there."""
        pen = self.penalties
        out = np.array(logits, dtype=np.float32)  # a copy: the verify rows stay as the target gave them
        vocab = len(out)
        if pen.repetition != 1.0:
            new = [t for t in set(path) if t not in self.seen]
            ids = np.concatenate([self.seen_ids, np.array(new, np.int64)]) if new else self.seen_ids
            ids = ids[ids < vocab]
            x = out[ids]
            out[ids] = np.where(x > 0, x / np.float32(pen.repetition), x * np.float32(pen.repetition))
        if pen.frequency or pen.presence:
            on_path = Counter(t for t in path if t < vocab)
            ids, n = self.count_ids, self.count_n
            if on_path:  # each path token from its whole count, in the one expression below
                path_ids = np.fromiter(on_path.keys(), np.int64, len(on_path))
                path_n = np.array([self.counts.get(t, 0) + c for t, c in on_path.items()], np.float32)
                rest = ~np.isin(ids, path_ids)
                ids, n = np.concatenate([ids[rest], path_ids]), np.concatenate([n[rest], path_n])
            keep = ids < vocab
            out[ids[keep]] -= np.float32(pen.frequency) * n[keep] + np.float32(pen.presence)
        if len(self.bias_ids):
            keep = self.bias_ids < vocab
            out[self.bias_ids[keep]] += self.bias[keep]
        return out
