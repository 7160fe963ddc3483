"""The decoder interface: static-T graphs over one KV cache, as the generator and drafters see them.

Every model runner is a StaticDecoder: the target/draft decoders (`Decoder`, on
ONNX Runtime in backends/ort_decoder.py, device-resident in backends/device_decoder.py)
and the EAGLE head (drafters/eagle_head.py, whose rows also carry features).

* graph_for(n): the smallest static token count T that holds n rows: an exported one, or
  any T between the smallest and the largest exported where the backend runs the one
  dynamic-T graph at any T (`call_sizes`; ORT's fused graphs), so calls are not padded;
* fit(n): (rows, T) of the next call over n pending rows that also fits the room left
  (near the context end a smaller graph over fewer rows; prefill and catch-ups use it);
* prefill_limit(chunk): rows per prefill call for an export whose prefill chunk is `chunk`; more
  (`long_rows`) where the backend runs its one dynamic-T graph at any T and can score the last
  row alone (ORT's fused graphs, backends/ort_decoder.py);
* spare: positions a call writes past its own rows (a quantized target's padded attention row,
  export/attention_pad.py): a call must end that many positions before the context end;
* forward(...): scores n rows after the cached past, padded to T by StaticCall; commits nothing;
* commit(step, rows): appends the chosen rows of the latest step to the cache;
* rewind(length): forgets cached rows past `length` (nothing is cleared: the next step overwrites them);
* cache.length: rows committed; calls / seconds: graph calls and the time spent in them.
"""

from __future__ import annotations

import bisect
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .errors import SpecDeployError
from .graph_contract import INPUT_IDS, PORTABLE, POSITION_IDS, TREE_MASK, ModelRecord


@functools.lru_cache(maxsize=64)
def _eye(t: int) -> np.ndarray:
    return np.eye(t, dtype=bool)


class StaticCall:
    """The per-row inputs of one static-T graph, reused across calls: input_ids and
    position_ids [1, T], tree_mask [1, T, S], and any other per-row input (features).

    A call of n <= T rows fills the first n and pads the rest: token 0, the last real
    position, zeros, and a mask row that sees only itself, while no real row sees a
    padding row, so padding changes no real row's output. The mask's last T columns are
    the new rows; S - T columns before them are cached rows the mask also decides
    (the EAGLE head's earlier draft levels); every key before those is visible.
    `arrays` may be a graph's bound input arrays (filled in place).
    """

    def __init__(self, tokens: int, arrays: dict[str, np.ndarray] | None = None):
        self.tokens = tokens
        self.arrays = arrays if arrays is not None else {
            INPUT_IDS: np.zeros((1, tokens), np.int64), POSITION_IDS: np.zeros((1, tokens), np.int64),
            TREE_MASK: np.zeros((1, tokens, tokens), bool)}

    def fill(self, tokens, positions, mask: np.ndarray, past_length: int, **rows: np.ndarray) -> dict[str, np.ndarray]:
        """`mask` is [n, D + n]: the D cached rows it decides, then the n new rows."""
        t, n = self.tokens, len(tokens)
        cached = mask.shape[1] - n
        ids = self.arrays[INPUT_IDS][0]
        ids[:n] = tokens
        ids[n:] = 0
        pos = self.arrays[POSITION_IDS][0]
        pos[:n] = positions
        pos[n:] = positions[-1] if n else past_length
        if self.arrays[TREE_MASK].shape[2] != cached + t:
            self.arrays[TREE_MASK] = np.zeros((1, t, cached + t), bool)
        full = self.arrays[TREE_MASK][0]
        full[:n, : cached + n] = mask
        if n < t:
            full[:n, cached + n :] = False
            full[n:, :cached] = False
            full[n:, cached:] = _eye(t)[n:]
        for name, values in rows.items():
            arr = self.arrays.get(name)
            if arr is None or arr.shape[2:] != values.shape[1:]:
                arr = self.arrays[name] = np.zeros((1, t, *values.shape[1:]), values.dtype)
            arr[0, :n] = values
            arr[0, n:] = 0
        return self.arrays


def smallest_fit(sizes: list[int], n: int, what: str) -> int:
    """The smallest static token count in sorted `sizes` that holds n rows."""
    i = bisect.bisect_left(sizes, n)
    if i == len(sizes):
        raise SpecDeployError(f"no {what} graph holds {n} tokens (exported sizes: {sizes})")
    return sizes[i]


def fitting_call(sizes: Sequence[int], n: int, room: int) -> tuple[int, int] | None:
    """(rows, T) of the next call over n pending rows that never pads past the context end:
    the smallest graph in sorted `sizes` holding all n when it fits the `room` left, else the
    largest that fits, taking T rows (the caller calls again for the rest); None: none fits."""
    i = bisect.bisect_left(sizes, n)
    if i < len(sizes) and sizes[i] <= room:
        return n, sizes[i]
    j = bisect.bisect_right(sizes, room) - 1  # any T >= n would have been found above: T < n
    return (sizes[j], sizes[j]) if j >= 0 else None


class StaticDecoder:
    """What every model runner shares (see the module docstring); subclasses add forward and commit."""

    def __init__(self, cache, sizes, max_context: int, what: str):
        self.cache = cache
        self.sizes = sorted(sizes)  # the exported static T
        self.call_sizes = self.sizes  # the T a call may run at (see the module docstring)
        self.max_context = max_context
        self.spare = 0  # positions a call writes past its rows (module docstring)
        # last-row prefill calls may take up to this many rows, past the largest graph (0: none may;
        # a backend whose one graph runs at any T sets it)
        self.long_rows = 0
        self.what = what  # names the model in messages
        self.calls = 0
        self.seconds = 0.0

    def graph_for(self, n: int) -> int:
        return smallest_fit(self.call_sizes if n <= self.sizes[-1] else self.sizes, n, self.what)

    def fit(self, n: int, sizes: Sequence[int] | None = None) -> tuple[int, int] | None:
        return fitting_call(self.call_sizes if sizes is None else sizes, n, self.room)

    def prefill_limit(self, chunk: int) -> int:
        """Rows per prefill call for an export whose prefill chunk is `chunk` (module docstring)."""
        return max(chunk, self.long_rows)

    @property
    def room(self) -> int:
        """Rows a call may still take before the context end (its spare positions kept)."""
        return self.max_context - self.spare - self.cache.length

    def rewind(self, length: int) -> None:
        self.cache.truncate(length)

    def reset(self) -> None:
        self.rewind(0)

    def _check_room(self, t: int) -> None:
        if t > self.room:
            spare = f" (less {self.spare} spare)" if self.spare else ""
            raise SpecDeployError(f"{self.what} context full: {self.cache.length} cached + {t} new tokens exceed "
                                  f"max_context {self.max_context}{spare}")

    def _timed(self, run, *args):
        start = time.perf_counter()
        out = run(*args)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return out


@dataclass
class StepOutput:
    logits: np.ndarray  # [n, vocab] float32, real (unpadded) tokens only ([1, vocab]: a last_logits call)
    hidden: np.ndarray  # [n, hidden] float32
    # per layer key, value: [1, T, kv_heads, head_dim]; empty when the cache was written in place
    presents: list[np.ndarray]
    features: np.ndarray | None = None


class Decoder(StaticDecoder):
    """A target or draft model: rows are tokens at positions. Backends implement `_run`
    (one padded static-T call -> StepOutput of the n real rows) and `commit`."""

    flavor = PORTABLE

    def __init__(self, record: ModelRecord, cache, sizes, max_context: int):
        super().__init__(cache, sizes, max_context, record.name)
        self.spec = record
        self.inputs = {t: StaticCall(t) for t in self.sizes}

    @property
    def fused(self) -> bool:
        return self.flavor != PORTABLE

    def forward(self, tokens: np.ndarray, positions: np.ndarray, mask: np.ndarray,
                last_logits: bool = False) -> StepOutput:
        """Score n new tokens after the cached past; `mask` is [n, n] (row sees column).
        `last_logits`: only the last row's logits are needed (a prefill chunk); a backend that
        can skip the others returns logits [1, vocab] (hidden and features stay per row)."""
        t = self.graph_for(len(tokens))
        self._check_room(t)
        feeds = self.inputs[t].fill(tokens, positions, mask, self.cache.length)
        return self._timed(self._run_last_logits if last_logits else self._run, t, feeds, len(tokens))

    def _run(self, t: int, feeds: dict[str, np.ndarray], n: int) -> StepOutput:
        raise NotImplementedError

    def _run_last_logits(self, t: int, feeds: dict[str, np.ndarray], n: int) -> StepOutput:
        return self._run(t, feeds, n)  # every row's logits, of which callers read the last

    def commit(self, step: StepOutput, rows) -> None:
        raise NotImplementedError

    def prefill(self, tokens: list[int] | np.ndarray, chunk: int, on_chunk=None,
                all_logits: bool = False) -> StepOutput | None:
        """Process and commit tokens causally, at most `chunk` per call (the prefill graph's size).

        Each call takes the smallest graph holding its rows; near the context end, where that
        graph would pad past it, a smaller graph over fewer rows (`fit`). `on_chunk(step)`
        sees every call's output (EAGLE reads the prompt's features). A step's logits may be
        its last row's only (`forward(last_logits=True)`) unless `all_logits` (scoring a text).
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        # chunks past the largest graph: last-row calls at any T up to `long_rows` (module docstring)
        longer = not all_logits and chunk > self.call_sizes[-1] and self.long_rows > self.call_sizes[-1]
        sizes = range(self.call_sizes[0], min(chunk, self.long_rows) + 1) if longer else None
        last, s = None, 0
        while s < len(tokens):
            call = self.fit(min(chunk, len(tokens) - s), sizes)
            if call is None:
                self._check_room(self.call_sizes[0])  # raises: not even the smallest graph fits
            assert call is not None
            n = call[0]
            start = self.cache.length
            last = self.forward(tokens[s : s + n], np.arange(start, start + n), np.tril(np.ones((n, n), dtype=bool)),
                                last_logits=not all_logits)
            self.commit(last, slice(0, n))
            s += n
            if on_chunk is not None:
                on_chunk(last)
        return last
