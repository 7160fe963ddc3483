"""The KV cache of a batch: per layer one buffer of row slots, [slots, kv_heads, S + 1, D].

A slot holds one request's cache, head-major like the batch-1 fused cache (runtime/kv_cache.py),
so a call over slots lo..hi binds the contiguous view buf[lo:hi] and the graph writes each row's
new KV in place at that row's own length. Row TRASH (= max_context) is never part of a sequence:
a slot inside a call's range that does not take part writes its placeholder token there.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import SpecDeployError
from ..graph_contract import KEY, VALUE, ModelRecord, past_name
from ..kv_cache import cache_bytes, keep_rows_in_place, require_memory
from .graph import EXTRA_ROWS


class SlotKV:
    def __init__(self, spec: ModelRecord, slots: int, max_context: int):
        shape = (slots, spec.num_kv_heads, max_context + EXTRA_ROWS, spec.head_dim)
        need = slots * cache_bytes(spec, max_context + EXTRA_ROWS)
        # (a batch of 100,000 micro rows grew to 22 GB during its start-up calibration)
        require_memory(need, f"a batch of {slots} rows ({max_context} positions a row)",
                       "serve fewer rows, or export with a smaller max_context")
        try:
            self.keys = [np.zeros(shape, np.float32) for _ in range(spec.num_layers)]
            self.values = [np.zeros(shape, np.float32) for _ in range(spec.num_layers)]
        except MemoryError:
            raise SpecDeployError(f"a batch of {slots} rows needs {need / 2**30:.1f} GiB of KV cache address space "
                                  f"({max_context} positions a row), more than this machine maps: serve fewer "
                                  "rows") from None
        self.slots, self.max_context = slots, max_context
        self.trash = max_context

    def views(self, lo: int, hi: int) -> dict[str, np.ndarray]:
        """The slots lo..hi of every buffer by past_* name (contiguous: no copy)."""
        return {past_name(layer, kind): bufs[layer][lo:hi] for layer in range(len(self.keys))
                for kind, bufs in ((KEY, self.keys), (VALUE, self.values))}

    def row(self, slot: int) -> "RowCache":
        return RowCache(self, slot)


class RowCache:
    """One slot as a decoder's cache: the in-place half of runtime/kv_cache.KVCache's contract
    (rows past `length` are scratch; commit keeps the accepted rows of the step just written)."""

    in_place = True

    def __init__(self, kv: SlotKV, slot: int):
        self.kv, self.slot = kv, slot
        self.max_context = kv.max_context
        self.length = 0
        self.bytes_copied = 0

    def head_major(self) -> list[np.ndarray]:
        """Every layer's key then value slot as a [kv_heads, S + 1, D] view."""
        return [buf[self.slot] for buf in (*self.kv.keys, *self.kv.values)]

    def _row_bytes(self) -> int:
        k = self.kv.keys[0]
        return 2 * len(self.kv.keys) * k.shape[1] * k.shape[3] * k.itemsize

    def commit_in_place(self, rows: Sequence[int] | slice) -> None:
        n, moved = keep_rows_in_place([buf[self.slot] for buf in (*self.kv.keys, *self.kv.values)], self.length,
                                      rows, self.max_context)
        self.bytes_copied += moved * self._row_bytes()
        self.length += n

    def commit(self, presents, rows) -> None:
        self.commit_in_place(rows)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)
