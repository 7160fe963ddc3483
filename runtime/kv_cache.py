"""The one KV-cache manager: a static buffer per model, indexed by absolute position.

Two layouts, one contract (rows past `length` are scratch, commits append):
- row-major [max_context, kv_heads, D] for portable graphs: feeding the past is a
  contiguous prefix view (no copy) and a step writes back only the accepted rows
  of the new tokens' KV (one gather per layer);
- head-major [1, kv_heads, max_context, D] for fused graphs, which the graph
  reads and writes in place: a step's rows land at length.., and committing the
  accepted ones moves only those not already in place (none for a chain).
Either way per-step copy traffic is O(new tokens), never O(context). Rolling back
is just moving `length`: stale rows past it are overwritten by the next step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .errors import SpecDeployError
from .graph_contract import KEY, VALUE, ModelRecord, past_name

NP_DTYPES = {"float32": np.float32, "float16": np.float16}


def cache_bytes(spec: ModelRecord, positions: int, dtype: str = "float32") -> int:
    """K and V bytes of `positions` tokens over all of a model's layers (KVCache's buffers)."""
    itemsize = np.dtype(NP_DTYPES.get(dtype, np.float32)).itemsize
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * positions * itemsize


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux: MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def require_memory(need: int, what: str, advice: str) -> None:
    """One SpecDeployError, before anything is allocated, where caches of `need` bytes could not all be
    resident: buffers map lazily, but a full batch or pool writes them (and the batch's start-up
    calibration writes rows of every slot), and the kernel's OOM killer is no error message."""
    available = available_memory()
    if available is not None and need > available:
        raise SpecDeployError(f"{what} needs {need / 2**30:.1f} GiB of KV cache, and {available / 2**30:.1f} GiB "
                              f"of memory is available: {advice}")


class KVCache:
    def __init__(self, spec: ModelRecord, max_context: int, dtype: str = "float32", in_place: bool = False):
        self.in_place = in_place
        shape: tuple[int, ...]
        if in_place:
            shape = (1, spec.num_kv_heads, max_context, spec.head_dim)
        else:
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

    def past_feeds(self) -> dict[str, np.ndarray]:
        """A portable graph's past_* inputs: views of the committed rows."""
        feeds = {}
        for layer in range(len(self.keys)):
            feeds[past_name(layer, KEY)], feeds[past_name(layer, VALUE)] = self.past(layer)
        return feeds

    def head_major(self) -> list[np.ndarray]:
        """Every layer's key then value buffer as a [kv_heads, S, D] view, whatever the layout."""
        bufs = (*self.keys, *self.values)
        return [b[0] for b in bufs] if self.in_place else [b.transpose(1, 0, 2) for b in bufs]

    def buffers(self) -> dict[str, np.ndarray]:
        """The whole buffers by past_* name, for a fused graph to bind as past and present."""
        return {past_name(layer, kind): bufs[layer] for layer in range(len(self.keys))
                for kind, bufs in ((KEY, self.keys), (VALUE, self.values))}

    def _row_bytes(self) -> int:
        """K and V bytes of one token across all layers."""
        per_layer = self.keys[0].nbytes // self.max_context
        return 2 * per_layer * len(self.keys)

    def commit_in_place(self, rows: Sequence[int] | slice) -> None:
        """Keep the given rows of the step the graph just wrote at length..; drop the rest."""
        # buf[0]: [kv_heads, S, D]; index rows on axis 1 (buf[0, :, src] would move the axis)
        n, moved = keep_rows_in_place([buf[0] for buf in (*self.keys, *self.values)], self.length, rows,
                                      self.max_context)
        self.bytes_copied += moved * self._row_bytes()
        self.length += n

    def commit(self, presents: Sequence[np.ndarray], rows: Sequence[int] | slice) -> None:
        """Append the given rows of a step's new KV (presents alternate key, value per layer)."""
        if self.in_place:
            self.commit_in_place(rows)
            return
        sel: np.ndarray | slice
        if isinstance(rows, slice):
            sel = rows
            n = len(range(*rows.indices(presents[0].shape[1])))
        else:
            sel = np.asarray(rows, dtype=np.int64)
            n = len(sel)
            # A prefix of the new tokens is a slice: a plain copy, no fancy-index temporary.
            if n and sel[0] == 0 and sel[-1] == n - 1:
                sel = slice(0, n)
        start = self.length
        if start + n > self.max_context:
            raise SpecDeployError(f"context full: {start + n} tokens exceed max_context {self.max_context}")
        for layer in range(len(self.keys)):
            k, v = presents[2 * layer][0], presents[2 * layer + 1][0]
            self.keys[layer][start : start + n] = k[sel]
            self.values[layer][start : start + n] = v[sel]
        self.bytes_copied += 2 * n * self.keys[0][0].nbytes * len(self.keys)
        self.length = start + n

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


class RowCopy:
    """Copies committed rows from cache `src` to cache `dst`, two caches of one geometry (layers, KV
    heads, head size) in any layout: a self-draft's cache seeded with its target's KV. The views and
    the geometry are taken once: a copy per decode step is one slice assignment per buffer."""

    def __init__(self, src, dst):
        self.src, self.dst = src, dst
        self.pairs = list(zip(src.head_major(), dst.head_major()))
        if len(self.pairs) != len(src.head_major()) or len(self.pairs) != len(dst.head_major()) or any(
                a.shape[0] != b.shape[0] or a.shape[2] != b.shape[2] for a, b in self.pairs):
            raise SpecDeployError("cannot copy KV rows between caches of different geometry")
        self.rows = min(min(a.shape[1], b.shape[1]) for a, b in self.pairs)

    def __call__(self, n: int, start: int = 0) -> None:
        """Make `dst`'s rows start..n `src`'s and its length n."""
        if n > self.rows:
            raise SpecDeployError(f"cannot copy {n} KV rows into caches of {self.rows}")
        for a, b in self.pairs:
            b[:, start:n] = a[:, start:n]
        self.dst.length = n


def keep_rows_in_place(heads: Sequence[np.ndarray], start: int, rows: Sequence[int] | slice,
                       max_context: int) -> tuple[int, int]:
    """Commit `rows` of a step written in place at start.. into [kv_heads, S, D] buffers.

    Rows before the first one out of place are already where they belong; from there on (a
    tree path) they move down. Returns (rows committed, rows moved). Shared by the batch-1
    cache and the batch's row slots (runtime/batching/kv_slots.py).
    """
    if isinstance(rows, slice):
        rows = range(rows.start or 0, rows.stop, rows.step or 1)
    idx = np.asarray(rows, dtype=np.int64)
    n = len(idx)
    if start + n > max_context:
        raise SpecDeployError(f"context full: {start + n} tokens exceed max_context {max_context}")
    misplaced = np.nonzero(idx != np.arange(n))[0]
    if not len(misplaced):
        return n, 0
    first = int(misplaced[0])
    src, dst = start + idx[first:], slice(start + first, start + n)
    for h in heads:
        h[:, dst] = h[:, src]
    return n, n - first
