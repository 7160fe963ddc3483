"""Repetition, frequency and presence penalties and logit biases, applied where the target's logits
choose a token.

Their meanings are those of the APIs users know, applied to the logits before temperature, top-k
and top-p, in this order:
- `repetition` (HF transformers' `repetition_penalty`, > 0; 1: none): every token of the prompt
  and of the output so far has its logit divided by it where positive, multiplied where not;
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


@dataclass(frozen=True)
class Penalties:
    repetition: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); a mapping is taken too

    def __post_init__(self):
        for name, value, ok, bound in (
                ("repetition_penalty", self.repetition, lambda v: v > 0, "a finite number > 0"),
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
    on the way to that row); `commit(tokens)` after each step."""

    def __init__(self, penalties: Penalties, prompt_ids: list[int]):
        self.penalties = penalties
        self.seen = set(prompt_ids)  # prompt and output: the repetition penalty's tokens
        self.counts: Counter[int] = Counter()  # output only: frequency and presence
        self.bias_ids = np.array([t for t, _ in penalties.logit_bias], np.int64)
        self.bias = np.array([v for _, v in penalties.logit_bias], np.float32)

    def commit(self, tokens: list[int]) -> None:
        self.seen.update(tokens)
        self.counts.update(tokens)

    def apply(self, logits: np.ndarray, path: list[int]) -> np.ndarray:
        """The target's logits are the vocabulary; a draft model's may be fewer (a draft whose embedding is
        padded differently, export/draft_vocab.py): ids past its row are skipped there."""
        pen = self.penalties
        out = np.array(logits, dtype=np.float32)  # a copy: the verify rows stay as the target gave them
        vocab = len(out)
        if pen.repetition != 1.0:
            ids = np.fromiter(self.seen.union(path), np.int64)
            ids = ids[ids < vocab]
            x = out[ids]
            out[ids] = np.where(x > 0, x / np.float32(pen.repetition), x * np.float32(pen.repetition))
        if pen.frequency or pen.presence:
            counts = self.counts + Counter(path) if path else self.counts
            if counts:
                ids = np.fromiter(counts.keys(), np.int64, len(counts))
                n = np.fromiter(counts.values(), np.float32, len(counts))
                keep = ids < vocab
                out[ids[keep]] -= np.float32(pen.frequency) * n[keep] + np.float32(pen.presence)
        if len(self.bias_ids):
            keep = self.bias_ids < vocab
            out[self.bias_ids[keep]] += self.bias[keep]
        return out
