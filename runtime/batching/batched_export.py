"""An export served as rows of one batch: each row a LoadedExport whose target is a RowDecoder.

The rows share the loaded manifest, tokenizer and configs (LoadedExport.sibling), the batched
target graph (one session: the weights once) and its scheduler; each owns a slot of the batch's
KV and its drafter's state. A RowPool lends rows to requests like runtime/pool.ExportPool lends
instances (same admission, queue and 429s) and tells the scheduler which rows are running.
"""

from __future__ import annotations

from pathlib import Path

from ..adaptive import on_by_default
from ..errors import SpecDeployError
from ..graph_contract import TARGET
from ..loaded_export import LoadedExport
from ..methods import build_drafter
from ..pool import ExportPool
from .gate import SpeculationGate
from .graph import BatchedGraph
from .kv_slots import SlotKV
from .policy import CostModel, LoadAwareDrafter, SpeculationPolicy
from .row_decoder import RowDecoder
from .scheduler import Batcher


class BatchedExport(LoadedExport):
    times_steps = False  # a row's step rides in the batch's call: the batch's policy sizes drafts (policy.py)

    def __init__(self, path: str | Path, rows: int, threads: int | None = None, verify_checksums: bool = True):
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise SpecDeployError(f"batch size must be an integer >= 1, got {rows!r}")
        super().__init__(path, backend="ort-cpu", threads=threads, verify_checksums=verify_checksums)
        if self.manifest.dtype != "float32":
            raise SpecDeployError(f"batched serving runs float32 exports only (this one is {self.manifest.dtype})")
        kv = SlotKV(self.manifest.models[TARGET], rows, self.manifest.max_context)
        self.batcher = Batcher(BatchedGraph(self.manifest, threads), kv)
        self.slot = 0
        costs = CostModel()
        self.policy = SpeculationPolicy(costs, enabled=on_by_default())
        self.gate: SpeculationGate | None = None
        if self.policy.enabled:
            self.gate = self.batcher.gate = SpeculationGate()
            widths = [1 << i for i in range(rows.bit_length()) if 1 << i < rows] + [rows]
            most = max(config.verify_tokens for config in self.methods.values())
            sizes = sorted({t for t in (2, 4, 8, 16, most + 1) if 1 < t <= most + 1})
            costs.calibrate(self.batcher, widths, sizes)
            self.batcher.observers.append(costs.observe)  # then every call refines the times

    def rows(self) -> list[LoadedExport]:
        """One instance per slot of the batch."""
        out: list[LoadedExport] = []
        for slot in range(self.batcher.kv.slots):
            row = self.sibling()
            assert isinstance(row, BatchedExport)
            row.slot = slot
            out.append(row)
        return out

    def generation_options(self, method: str) -> dict:
        """What a Generation on this row takes beside the request: the method's drafter under the
        batch's speculation policy (which replaces the batch-1 adaptive policy)."""
        config = self.method_config(method)
        if config.verify_tokens <= 1:
            return {"adaptive": False}
        drafter = LoadAwareDrafter(build_drafter(self, config), self.policy, self.batcher, self.slot,
                                   config.verify_tokens - 1, self.gate)
        return {"drafter": drafter, "adaptive": False}

    def warm_up(self, method: str) -> None:
        if method == "eagle" and self.manifest.models[TARGET].extra.get("feature_layers"):
            raise SpecDeployError("EAGLE-3 reads the target's layer features; the batched target graph "
                                  "outputs logits and hidden states only")
        super().warm_up(method)

    def _open_decoder(self, model: str):
        if model == TARGET:
            return RowDecoder(self.manifest, self.batcher, self.slot)
        return super()._open_decoder(model)


class RowPool(ExportPool):
    def acquire(self, timeout: float | None = None, ticket=None):
        row = super().acquire(timeout, ticket)
        if row is not None:
            row.batcher.join(row.slot)
        return row

    def release(self, export) -> None:
        export.batcher.leave(export.slot)
        super().release(export)
