"""The one KV-cache manager: a static buffer per model, indexed by absolute position.

Feeding the past is a contiguous view of each layer's buffer (no copy); a step
writes back only the accepted rows of the new tokens' KV (one gather per layer),
so per-step copy traffic is O(new tokens), never O(context). Rolling back is
just moving `length`: stale rows past it are overwritten by the next commit.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .errors import SpecDeployError
from .manifest import ModelSpec

NP_DTYPES = {"float32": np.float32, "float16": np.float16}


class KVCache:
    def __init__(self, spec: ModelSpec, max_context: int, dtype: str = "float32"):
        shape = (max_context, spec.num_kv_heads, spec.head_dim)
        np_dtype = NP_DTYPES[dtype]
        self.keys = [np.zeros(shape, np_dtype) for _ in range(spec.num_layers)]
        self.values = [np.zeros(shape, np_dtype) for _ in range(spec.num_layers)]
        self.max_context = max_context
        self.length = 0
        self.bytes_copied = 0  # host copy traffic of commits, for the O(new tokens) claim

    def past(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """[1, length, kv_heads, head_dim] views into the buffers (no copy)."""
        return self.keys[layer][None, : self.length], self.values[layer][None, : self.length]

    def commit(self, presents: Sequence[np.ndarray], rows: Sequence[int] | slice) -> None:
        """Append the given rows of a step's new KV (presents alternate key, value per layer)."""
        if isinstance(rows, slice):
            n = len(range(*rows.indices(presents[0].shape[1])))
        else:
            rows = np.asarray(rows, dtype=np.int64)
            n = len(rows)
            # A prefix of the new tokens is a slice: a plain copy, no fancy-index temporary.
            if n and rows[0] == 0 and rows[-1] == n - 1:
                rows = slice(0, n)
        start = self.length
        if start + n > self.max_context:
            raise SpecDeployError(f"context full: {start + n} tokens exceed max_context {self.max_context}")
        for layer in range(len(self.keys)):
            k, v = presents[2 * layer][0], presents[2 * layer + 1][0]
            self.keys[layer][start : start + n] = k[rows]
            self.values[layer][start : start + n] = v[rows]
        self.bytes_copied += 2 * n * self.keys[0][0].nbytes * len(self.keys)
        self.length = start + n

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)
