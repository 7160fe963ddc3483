"""The target decoder of one batch row: runtime/decoder.Decoder over a slot of the batch's KV.

A generation (runtime/generate.py) runs on it unchanged: padding, graph sizes, prefill chunks
and commits are the batch-1 decoder's, so each row computes what it would alone. Its calls go
to the batch scheduler (scheduler.py), which runs plain steps of all rows together.
"""

from __future__ import annotations

import numpy as np

from ..backends.ort_decoder import OnFirstUse
from ..backends.sessions import graph_identity
from ..decoder import Decoder, StaticCall, StepOutput
from ..graph_contract import FUSED, INPUT_IDS, PORTABLE, POSITION_IDS, TARGET, TREE_MASK
from ..manifest import Manifest
from .scheduler import Batcher, Work


class RowDecoder(Decoder):
    flavor = FUSED

    def __init__(self, manifest: Manifest, batcher: Batcher, slot: int):
        # The static T of the export's target graphs: each call pads as the batch-1 decoder does.
        records = manifest.decoder_graphs(TARGET, FUSED) or manifest.decoder_graphs(TARGET, PORTABLE)
        super().__init__(manifest.models[TARGET], batcher.kv.row(slot), records, manifest.max_context)
        if len({graph_identity(manifest.graph_path(r)) for r in records.values()}) == 1:
            # One dynamic-T graph: calls run at T = their rows, as the batch-1 fused decoder's do
            # (backends/ort_decoder.py), so each row's numbers stay that decoder's.
            self.call_sizes = list(range(self.sizes[0], self.sizes[-1] + 1))
            self.inputs = OnFirstUse(StaticCall)
        self.batcher, self.slot = batcher, slot
        self._prefilling = False

    def _run(self, t: int, feeds: dict[str, np.ndarray], n: int, logit_rows: np.ndarray | None = None) -> StepOutput:
        work = self.batcher.submit(Work(self.slot, feeds[INPUT_IDS][0].copy(), feeds[POSITION_IDS][0].copy(),
                                        feeds[TREE_MASK][0].copy(), self.cache.length, prefill=self._prefilling,
                                        logit_rows=logit_rows))
        assert work.logits is not None and work.hidden is not None
        return StepOutput(work.logits[:n], work.hidden[:n], [])

    def _run_last_logits(self, t: int, feeds: dict[str, np.ndarray], n: int) -> StepOutput:
        """A prefill chunk: the last real row's logits only ([1, vocab], as the batch-1 decoder's)."""
        return self._run(t, feeds, n, np.array([n - 1], np.int64))

    def prefill(self, tokens, chunk: int, on_chunk=None, all_logits: bool = False) -> StepOutput | None:
        self._prefilling = True  # the scheduler runs one prefill chunk per step
        try:
            return super().prefill(tokens, chunk, on_chunk, all_logits)
        finally:
            self._prefilling = False

    def commit(self, step: StepOutput, rows) -> None:
        self.cache.commit_in_place(rows)
