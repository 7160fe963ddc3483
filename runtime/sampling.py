"""Sampling parameters, the target/draft distributions they define, and the draws from them.

Two schemes (SamplingParams.sampling):
- "seeded": the token at absolute sequence index i is a deterministic function of its
  distribution and noise(seed, i) (`PositionNoise`), so every method emits ar's tokens
  for the same seed, whatever the drafts, tree, draft length or batching.
- "rejection": one sequential rng per request; verification is recursive rejection
  sampling (runtime/verify.py). Exact in distribution only.
"""

from __future__ import annotations

import math
import numbers
import secrets
from dataclasses import dataclass

import numpy as np

from .errors import SpecDeployError

SCHEMES = ("seeded", "rejection")


def as_int(value) -> int | None:
    """An integer of any kind (int, numpy's integers: numbers.Integral) as a Python int; None for anything
    else, bools included (True is no count)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def as_real(value) -> float | None:
    """A real number of any kind (int, float, numpy's floats and ints: numbers.Real) as a Python float;
    None for anything else, bools included, and for an int too big for a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k filter
    top_p: float = 1.0
    seed: int | None = None
    # "seeded" | "rejection"; None: seeded when a seed is given, else the method's default (Drafter.default_sampling)
    sampling: str | None = None
    # keeps the tokens at least min_p times as likely as the likeliest, after top-p as HF's MinPLogitsWarper
    # (vLLM's v1 sampler applies its min_p before top-k and top-p, which differs where top-p is set); 0: off
    min_p: float = 0.0

    def __post_init__(self):
        # numpy scalars (np.float32(0.5), np.int64(5)) are numbers too: taken as Python floats and ints
        t = as_real(self.temperature)
        if t is None or not math.isfinite(t) or t < 0:
            raise SpecDeployError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        top_k = as_int(self.top_k)
        if top_k is None or top_k < 0:
            raise SpecDeployError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        p = as_real(self.top_p)
        # 0 keeps the most probable token only (as in transformers and the OpenAI API)
        if p is None or not math.isfinite(p) or not 0 <= p <= 1:
            raise SpecDeployError(f"top_p must be in [0, 1], got {self.top_p!r}")
        min_p = as_real(self.min_p)
        if min_p is None or not math.isfinite(min_p) or not 0 <= min_p <= 1:
            raise SpecDeployError(f"min_p must be in [0, 1], got {self.min_p!r}")
        seed = None if self.seed is None else as_int(self.seed)
        if self.seed is not None and (seed is None or seed < 0):
            raise SpecDeployError(f"seed must be a non-negative integer, got {self.seed!r}")
        if seed is not None and seed >= 2**64:
            raise SpecDeployError(f"seed must be below 2**64, got {self.seed!r}")
        for name, value in (("temperature", t), ("top_k", top_k), ("top_p", p), ("seed", seed), ("min_p", min_p)):
            object.__setattr__(self, name, value)  # frozen: the checked Python value replaces the given one
        if self.sampling is not None and self.sampling not in SCHEMES:
            raise SpecDeployError(f"sampling must be one of {', '.join(SCHEMES)}, got {self.sampling!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: np.ndarray) -> np.ndarray:
        """The distribution to sample from: temperature, then top-k, then top-p, then min-p (float64), in
        HF transformers' order.

        Host work a sampled token waits for (verification runs it once per node of the path, a
        draft model once per draft): the exponentials are taken over top-k's support only, and
        the filters find their tokens by thresholds, not by selecting over the whole vocabulary
        (SmolLM2's 49,152 tokens, logits from chat: 0.72-0.75 ms a token with top-k or top-p and
        7.0 ms with both, where the nucleus sorted the whole vocabulary; now 0.18-0.36 ms). The result
        is what filtering the whole vocabulary gives: the same support, ties included, and each
        sum over the dense vector."""
        x = np.asarray(logits)
        vocab = x.shape[-1]
        # The max first, then the temperature: a vanishing temperature sends every other logit to
        # -inf (greedy in the limit) instead of overflowing all of them to inf (inf - inf = NaN).
        top = np.float64(x.max())
        if self.top_k and self.top_k < vocab:
            ids = np.flatnonzero(x >= kth_largest(x, self.top_k))  # ties with the k-th stay in
            with np.errstate(over="ignore"):
                z = (x[ids].astype(np.float64) - top) / self.temperature
            p = np.zeros(vocab)
            p[ids] = np.exp(z)
        else:  # in place: one vocabulary-sized array a token
            p = x.astype(np.float64)
            p -= top
            with np.errstate(over="ignore"):
                p /= self.temperature
            np.exp(p, out=p)
        p /= p.sum()
        if self.top_p < 1.0:
            kept = nucleus(p, self.top_p)
            mass = p[kept]
            p[:] = 0.0
            p[kept] = mass
            p /= p.sum()
        if self.min_p > 0.0:  # relative to the likeliest, so the same on the renormalized p (which keeps it)
            p[p < self.min_p * p.max()] = 0.0
            p /= p.sum()
        return p


def kth_largest(x: np.ndarray, k: int) -> float:
    """The k-th largest of x (1 <= k <= len(x)), as np.partition gives it, without selecting over all
    of x: the k-th largest of a strided sample is at most x's, so every one of x's k largest is
    among the elements at least that large, a few times k of them, and the k-th is selected there."""
    n = len(x)
    sample = x[:: max(1, n // max(k, int(math.sqrt(k * n))))]
    if len(sample) < k or 8 * len(sample) > n:  # a sample near x's size saves nothing
        return np.partition(x, n - k)[n - k]
    floor = np.partition(sample, len(sample) - k)[len(sample) - k]
    candidates = x[x >= floor]
    return np.partition(candidates, len(candidates) - k)[len(candidates) - k]


# Probability floors nucleus() tries before it sorts the whole vocabulary: at most 1 / floor
# tokens reach a floor, so each try sorts at most that many (sorting all of SmolLM2's 49,152
# probabilities took 5.9 ms a token, a decode step ~16 ms).
NUCLEUS_FLOORS = (1e-3, 1e-4, 1e-5)


def nucleus(p: np.ndarray, top_p: float) -> np.ndarray:
    """The smallest prefix of p's tokens in descending order (ties: lower id first) whose mass
    reaches top_p (at least the top token). Exactly what sorting the whole vocabulary gives: the
    tokens at least as likely as a floor are a prefix of that order (every tie of the last one
    included, in id order), their sums the full order's first sums, added in the same order;
    only where they fall short of top_p does it sort more."""
    vocab = len(p)
    for floor in [*NUCLEUS_FLOORS, None]:
        # ascending ids (the stable sort keeps ties in id order)
        ids = np.flatnonzero(p >= floor) if floor is not None else np.arange(vocab)
        if not len(ids):
            continue
        order = ids[np.argsort(-p[ids], kind="stable")]
        cum = np.cumsum(p[order])
        if cum[-1] >= top_p or floor is None:
            return order[: int(np.searchsorted(cum, top_p)) + 1]  # smallest prefix reaching top_p (0: the top token)
    raise AssertionError("the last try is the whole vocabulary")


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw; robust to rounding in the cumulative sum."""
    c = np.cumsum(p)
    return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), len(p) - 1))


def fresh_seed() -> int:
    """A request without a seed draws one, so it samples like a seeded one (and can be replayed)."""
    return secrets.randbits(63)


def race(p: np.ndarray, e: np.ndarray) -> int:
    """Exponential race (the Gumbel-max trick): argmin e_i / p_i, e_i ~ Exp(1) i.i.d., is
    distributed exactly as p. Two distributions raced with the same e agree often. Tokens
    outside the support (p_i = 0) score inf and never win."""
    return int(np.argmin(np.divide(e, p, out=np.full(len(p), np.inf), where=p > 0)))


class PositionNoise:
    """The randomness of the token at absolute sequence index i: a function of (seed, i) alone.

    Philox is counter-based: keyed by the seed, with i in the counter's third word, each index
    has its own stream (draws advance the low words) and nothing carries over from earlier
    draws. A draft model and the target read the same vector for the same index: kept until
    verification passes the index (`release`), at most `keep` indices (a vector per index is
    vocabulary-sized: 384 KiB at 49152 tokens).
    """

    def __init__(self, seed: int, keep: int = 64):
        self.seed, self.keep = seed, keep
        self._cache: dict[int, np.ndarray] = {}
        self._bits = np.random.Philox(key=seed)
        self._gen = np.random.Generator(self._bits)
        self._state = self._bits.state  # reset per index: cheaper than a new generator

    def exponentials(self, index: int, n: int) -> np.ndarray:
        e = self._cache.get(index)
        if e is None or len(e) < n:
            self._state["state"]["counter"] = np.array([0, 0, index, 0], dtype=np.uint64)
            self._state["buffer_pos"], self._state["has_uint32"] = 4, 0  # nothing buffered from the last index
            self._bits.state = self._state
            # 1 - u is exact and in (0, 1]. Doubles are drawn one after another: a prefix of a
            # longer draw is the same draw.
            e = -np.log(1.0 - self._gen.random(n))
            self._cache[index] = e
            if len(self._cache) > self.keep:
                del self._cache[min(self._cache)]
        return e[:n]

    def release(self, below: int) -> None:
        """Indices below `below` are committed: their noise is never read again."""
        for index in [i for i in self._cache if i < below]:
            del self._cache[index]

    def sample(self, p: np.ndarray, index: int) -> int:
        return race(p, self.exponentials(index, len(p)))
