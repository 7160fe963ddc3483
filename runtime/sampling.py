"""Sampling parameters and the target/draft distributions they define."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import SpecDeployError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k filter
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise SpecDeployError(f"temperature must be a finite number >= 0, got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise SpecDeployError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) or not 0 < p <= 1:
            raise SpecDeployError(f"top_p must be in (0, 1], got {p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise SpecDeployError(f"seed must be a non-negative integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: np.ndarray) -> np.ndarray:
        """The distribution to sample from: temperature, then top-k, then top-p (float64)."""
        z = logits.astype(np.float64) / self.temperature
        if self.top_k and self.top_k < z.shape[-1]:
            kth = np.partition(z, -self.top_k)[-self.top_k]
            z = np.where(z >= kth, z, -np.inf)
        z = np.exp(z - z.max())
        p = z / z.sum()
        if self.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            cum = np.cumsum(p[order])
            keep = int(np.searchsorted(cum, self.top_p)) + 1  # smallest prefix reaching top_p
            filtered = np.zeros_like(p)
            filtered[order[:keep]] = p[order[:keep]]
            p = filtered / filtered.sum()
        return p


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw; robust to rounding in the cumulative sum."""
    c = np.cumsum(p)
    return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), len(p) - 1))
