"""The KV cache of a device-resident decoder (TensorRT, ORT with IOBinding).

Same contract as runtime/kv_cache.KVCache, but the buffers live in `memory`
(CUDA, or host memory in the tests) and are only ever touched through raw
pointers:

* one allocation holds every layer's key and value buffer, each [max_context,
  kv_heads, head_dim] (sequence-major, so the past `[:P]` is the buffer's first
  P rows: the graph reads it in place, no copy);
* a scratch allocation receives the graph's `present_*` outputs ([T, kv_heads,
  head_dim] per layer and kind);
* committing copies only the accepted rows from scratch to the buffers, one
  strided copy per contiguous run of rows covering all layers at once
  (a chain's accepted prefix is a single copy per step).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import SpecDeployError
from ..graph_contract import ModelRecord
from ..kv_cache import NP_DTYPES
from .device_memory import align_up


def row_runs(rows: Sequence[int]) -> list[tuple[int, int, int]]:
    """(source row, destination offset, count) for each run of consecutive source rows."""
    runs: list[tuple[int, int, int]] = []
    for dst, src in enumerate(int(r) for r in rows):
        if runs and runs[-1][0] + runs[-1][2] == src:
            s, d, c = runs[-1]
            runs[-1] = (s, d, c + 1)
        else:
            runs.append((src, dst, 1))
    return runs


class DeviceKVCache:
    def __init__(self, spec: ModelRecord, max_context: int, dtype: str, memory, scratch_tokens: int):
        self.spec, self.memory = spec, memory
        self.np_dtype = np.dtype(NP_DTYPES[dtype])
        self.max_context = max_context
        self.layers = spec.num_layers
        self.row_shape = (spec.num_kv_heads, spec.head_dim)
        self.row_bytes = spec.num_kv_heads * spec.head_dim * self.np_dtype.itemsize
        self.scratch_tokens = scratch_tokens
        # Slot 2*layer is the key, 2*layer+1 the value; strides stay 256-byte aligned so every
        # buffer start is a valid TensorRT tensor address.
        self.stride = align_up(max_context * self.row_bytes)
        self.scratch_stride = align_up(scratch_tokens * self.row_bytes)
        self.base = memory.alloc(2 * self.layers * self.stride)
        self.scratch = memory.alloc(2 * self.layers * self.scratch_stride)
        self.length = 0
        self.bytes_copied = 0  # device copy traffic of commits (same meaning as KVCache's)

    def past_ptr(self, layer: int, kind: int) -> int:
        """Start of layer's key (kind 0) or value (kind 1) buffer: its first `length` rows are the past."""
        return self.base + (2 * layer + kind) * self.stride

    def present_ptr(self, layer: int, kind: int) -> int:
        return self.scratch + (2 * layer + kind) * self.scratch_stride

    def commit(self, rows: Sequence[int] | slice, available: int) -> None:
        """Append the given rows of the last step's presents (scratch rows < `available`)."""
        if isinstance(rows, slice):
            rows = range(*rows.indices(available))
        rows = [int(r) for r in rows]
        if any(not 0 <= r < available for r in rows):
            raise SpecDeployError(f"commit rows {rows} outside the step's {available} tokens")
        n, start = len(rows), self.length
        if start + n > self.max_context:
            raise SpecDeployError(f"context full: {start + n} tokens exceed max_context {self.max_context}")
        for src, off, count in row_runs(rows):
            self.memory.d2d_2d(self.base + (start + off) * self.row_bytes, self.stride,
                               self.scratch + src * self.row_bytes, self.scratch_stride,
                               count * self.row_bytes, 2 * self.layers)
        self.bytes_copied += 2 * n * self.row_bytes * self.layers
        self.length = start + n

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def read(self, layer: int, kind: int) -> np.ndarray:
        """Host copy of the committed rows of one buffer ([length, kv_heads, head_dim]); for checks."""
        out = np.empty((self.length, *self.row_shape), self.np_dtype)
        if self.length:
            self.memory.sync()
            self.memory.d2h(out, self.past_ptr(layer, kind))
        return out
