"""Log probabilities of generated tokens (OpenAI's `logprobs`), read off the verify call's rows.

A token's log probability is the target's log-softmax at the row that chose it: the root's row
for the first token of a step, an accepted draft's row for the next. Every emitted token comes
from an exact row (runtime/verify.py), so the numbers are the target's own whichever method
drafted: bit for bit `ar`'s where one-row calls are padded (quantized targets), within float32
rounding elsewhere (a verify call of several rows sums in another order than a one-row call: README). They are
the model's distribution before penalties, temperature, top-k, top-p and min-p
(as vLLM's default, `raw_logprobs`, and HF's `output_logits`): those settings decide which
token is drawn, not what the model thinks of it. Costs nothing unless asked for: one pass over
the vocabulary per emitted token (SmolLM2's 49,152: 0.06 ms, 0.15 ms with 20 alternatives).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from .errors import SpecDeployError

MAX_TOP = 20  # alternatives per token at most: OpenAI's limit (chat's top_logprobs)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the likeliest tokens (id, logprob), likeliest first, ties by id
    # where the token's text starts in the generation's text (set by the generation: a token that
    # holds part of a character starts where that character does; one past a stop string, at the end)
    text_offset: int = 0

    def to_json(self) -> dict:
        return {"token_id": self.token_id, "logprob": self.logprob, "top": [list(t) for t in self.top],
                "text_offset": self.text_offset}


def checked_top(value) -> int | None:
    """`logprobs` as a request gives it: None (off) or the number of alternatives per token, 0..MAX_TOP."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= int(value) <= MAX_TOP:
        raise SpecDeployError(f"logprobs must be an integer from 0 to {MAX_TOP} (alternatives per token), "
                              f"got {value!r}")
    return int(value)


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """`token`'s log-softmax in one row of logits [vocab], and the `top` likeliest tokens'."""
    peak = float(logits.max())
    log_total = peak + float(np.log(np.sum(np.exp(logits - peak), dtype=np.float64)))
    best: tuple[tuple[int, float], ...] = ()
    if top:
        # every token at least the top-th largest value (ties at the boundary all taken, then cut by id)
        kth = logits[np.argpartition(logits, len(logits) - top)[len(logits) - top]]
        ids = np.flatnonzero(logits >= kth)
        ids = ids[np.lexsort((ids, -logits[ids]))][:top]
        best = tuple((int(i), float(logits[i]) - log_total) for i in ids)
    return TokenLogprob(int(token), float(logits[token]) - log_total, best)
