"""`specdeploy check`: every graph's ONNX Runtime outputs against a float64 PyTorch reference.

A fixed tolerance cannot hold across depths: float32 error grows with the layers (a 30-layer
model's T=64 logits differ from float64 by ~1e-2 with nothing wrong). So each output's bound
comes from the model itself (export/reference.py saved the runs): ONNX Runtime's max |error|
against the float64 run must stay within ERROR_FACTOR x PyTorch's own max |error| in the export
dtype on the same call (the worst of the plain run and the rounding-noise runs), plus a floor of
FLOOR_ULPS units in the last place of the output's magnitude (outputs PyTorch gets nearly exactly).
On `logits`, top-1 must agree on every row and the top-5 sets on every row, except rows whose
float64 margin (top-2, or 5th-6th) is within twice PyTorch's error: there the dtype itself may
flip them. Integer ids from a top-k must match, except slots whose float64 values are within twice
the values' bound of a neighbour (or the last slot, whose competitor is not in the outputs).

polygraphy runs ONNX Runtime (`Comparator.run` with `OnnxrtRunner`) and applies the bound as its
compare function (`Comparator.compare_accuracy(..., compare_func=ErrorBound(...))`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..runtime.errors import SpecDeployError
from .reference import (
    CHECK_DIR,
    NOISE_RUNS,
    REFERENCE_RUNNER,
    TorchReference,
    load_reference,
    quiet_polygraphy,
    reference_paths,
)

ERROR_FACTOR = 4.0  # ORT may be this much less accurate than PyTorch in the same dtype
FLOOR_ULPS = 8.0  # floor: this many eps(output dtype) x max|reference|
TOP_K_OVERLAP = 5
LOGITS_OUTPUTS = ("logits",)
TIE_MARGIN = 2.0  # a row flips legitimately when its margin is within twice the error


@dataclass
class OutputCheck:
    """One output: ORT's max |error| vs float64 beside its bound (or an exact-match count)."""

    name: str
    passed: bool
    max_err: float = 0.0
    bound: float = 0.0
    torch_err: float = 0.0  # PyTorch's max |error| in the export dtype: the worst of its runs
    floor: float = 0.0
    notes: list[str] = field(default_factory=list)  # top-1/top-5/ids results, or why it failed
    exact: bool = False  # integer outputs: counted mismatches, no error bound

    def __bool__(self) -> bool:  # polygraphy reads a compare result's truth as pass/fail
        return self.passed

    @property
    def ratio(self) -> float:
        return self.max_err / self.bound if self.bound > 0 else (0.0 if self.max_err == 0 else np.inf)

    def describe(self, dtype: str) -> str:
        if self.exact or (self.notes and not self.bound):
            return ", ".join(self.notes)
        rel = "<=" if self.max_err <= self.bound else ">"
        text = (f"max|err| {self.max_err:.2e} {rel} bound {self.bound:.2e} "
                f"({ERROR_FACTOR:g}x torch {dtype} {self.torch_err:.2e} + {self.floor:.1e})")
        return ", ".join([text, *self.notes])


@dataclass
class GraphCheck:
    graph: str
    passed: bool
    detail: str  # one line: the failures, or the logits line and the worst output
    outputs: list[OutputCheck] = field(default_factory=list)
    dtype: str = "float32"

    def table(self, every_output: bool = False) -> list[str]:
        """One line per output: logits/hidden/features and failures always, KV outputs as their worst."""
        if not self.outputs:
            return [f"    {self.detail}"]
        width = max(len(o.name) for o in self.outputs)
        shown = [o for o in self.outputs if every_output or not o.passed or not o.name.startswith("present_")]
        lines = [f"    {o.name:<{width}}  {'' if o.passed else 'FAIL '}{o.describe(self.dtype)}" for o in shown]
        kv = [o for o in self.outputs if o.name.startswith("present_") and o.passed]
        if kv and not every_output:
            worst = max(kv, key=lambda o: o.ratio)
            lines.append(f"    {'present_*':<{width}}  {len(kv)} outputs, worst {worst.name}: "
                         f"{worst.describe(self.dtype)}")
        return lines


def _max_abs(a: np.ndarray) -> float:
    return float(np.max(np.abs(a))) if a.size else 0.0


def _float_check(name: str, ours: np.ndarray, ref: np.ndarray, torch_out: np.ndarray,
                 noise_errors: list[float]) -> OutputCheck:
    if not np.issubdtype(ours.dtype, np.floating):
        return OutputCheck(name, False, notes=[f"dtype {ours.dtype}, the reference is floating"])
    eps = float(np.finfo(ours.dtype).eps)  # the output's own dtype: float32 logits of a float16 export
    ours, ref, torch_out = (np.asarray(a, np.float64) for a in (ours, ref, torch_out))
    if not np.all(np.isfinite(ours)):
        return OutputCheck(name, False, notes=[f"{int(np.sum(~np.isfinite(ours)))} non-finite values"])
    err, torch_err = _max_abs(ours - ref), max([_max_abs(torch_out - ref), *noise_errors])
    floor = FLOOR_ULPS * eps * _max_abs(ref)
    bound = ERROR_FACTOR * torch_err + floor
    return OutputCheck(name, err <= bound, err, bound, torch_err, floor)


def _top_k_agreement(check: OutputCheck, ours: np.ndarray, ref: np.ndarray) -> None:
    """Top-1 and top-5 of each logits row vs float64, rows within float32's reach of a tie excused."""
    ours, ref = ours.reshape(-1, ours.shape[-1]), np.asarray(ref, np.float64).reshape(-1, ref.shape[-1])
    rows, k = ref.shape[0], min(TOP_K_OVERLAP, ref.shape[-1] - 1)
    order = np.argpartition(-ref, k, axis=-1)[:, : k + 1]  # the k + 1 largest, then sorted
    order = np.take_along_axis(order, np.argsort(-np.take_along_axis(ref, order, -1), axis=-1), -1)
    top = np.take_along_axis(ref, order, -1)
    close = TIE_MARGIN * check.torch_err
    top1_tied = top[:, 0] - top[:, 1] <= close
    top1_wrong = (np.argmax(ours, -1) != order[:, 0]) & ~top1_tied
    ours_top = np.argpartition(-ours, k - 1, axis=-1)[:, :k]
    overlap = np.array([len(set(a) & set(b)) for a, b in zip(ours_top.tolist(), order[:, :k].tolist())])
    topk_tied = top[:, k - 1] - top[:, k] <= close
    topk_wrong = (overlap < k) & ~topk_tied
    check.notes.append(f"top1 {rows - int(top1_wrong.sum())}/{rows}"
                       + (f" ({int(top1_tied.sum())} near-tie rows exempt)" if top1_tied.any() else ""))
    check.notes.append(f"top{k} overlap {overlap.mean() / k:.1%}"
                       + (f", {int(topk_wrong.sum())} rows differ" if topk_wrong.any() else ""))
    if top1_wrong.any() or topk_wrong.any():
        check.passed = False


def _ids_check(name: str, ours: np.ndarray, ref: np.ndarray, values: np.ndarray | None,
               values_check: OutputCheck | None) -> OutputCheck:
    """Integer outputs match exactly; with their top-k values, swaps among near-tied slots are excused."""
    differ = np.asarray(ours) != np.asarray(ref)
    excused = np.zeros_like(differ)
    if values is not None and values_check is not None and values.shape == differ.shape and differ.ndim:
        v = np.asarray(values, np.float64)
        close = TIE_MARGIN * values_check.bound
        gaps = np.abs(np.diff(v, axis=-1)) <= close
        excused[..., :-1] |= gaps
        excused[..., 1:] |= gaps
        excused[..., -1] = True  # the slot after the last one is not saved: a tie with it is invisible
    wrong = int((differ & ~excused).sum())
    notes = [f"{int(differ.sum())} of {differ.size} differ"
             + (f" ({int((differ & excused).sum())} at near-tied slots, excused)" if (differ & excused).any() else "")]
    return OutputCheck(name, wrong == 0, max_err=float(wrong), notes=notes, exact=True)


class ErrorBound:
    """polygraphy compare function: (onnxrt, pytorch-float64) -> {output: OutputCheck}.

    Bounds come from the export-dtype PyTorch run of the same call, given at construction."""

    def __init__(self, ref: TorchReference):
        self.ref = ref

    def __call__(self, ours, reference) -> OrderedDict:
        checks: OrderedDict[str, OutputCheck] = OrderedDict()
        for name in reference:
            if name not in ours:
                checks[name] = OutputCheck(name, False, notes=["missing from the graph's outputs"])
        for name, out in ours.items():
            if name not in reference:
                checks[name] = OutputCheck(name, False, notes=["not in the saved reference"])
                continue
            ref = reference[name]
            if np.shape(out) != np.shape(ref):
                checks[name] = OutputCheck(name, False, notes=[f"shape {np.shape(out)} vs reference {np.shape(ref)}"])
            elif np.issubdtype(np.asarray(ref).dtype, np.floating):
                noise = self.ref.noise_errors.get(name, [])
                checks[name] = _float_check(name, np.asarray(out), ref, self.ref.torch[name], noise)
                if name in LOGITS_OUTPUTS:
                    _top_k_agreement(checks[name], np.asarray(out), ref)
        for name, out in ours.items():  # ids after floats: a top-k's ids need its values' bound
            if name in reference and name not in checks:
                values_name = name.replace("_ids", "_logprobs")
                values = reference[values_name] if values_name in reference else None  # no .get on it
                checks[name] = _ids_check(name, out, reference[name], values, checks.get(values_name))
        return OrderedDict((name, checks[name]) for name in [*ours.keys(), *reference.keys()] if name in checks)


def _summary(checks: list[OutputCheck], dtype: str) -> str:
    failed = [c for c in checks if not c.passed]
    if failed:
        return "; ".join(f"{c.name}: {c.describe(dtype)}" for c in failed[:3]) + \
            (f"; and {len(failed) - 3} more outputs" if len(failed) > 3 else "")
    worst = max(checks, key=lambda c: c.ratio)
    logits = [c for c in checks if c.name in LOGITS_OUTPUTS]
    parts = [f"{c.name} {c.describe(dtype)}" for c in logits]
    if worst not in logits:
        parts.append(f"worst {worst.name} {worst.describe(dtype)}")
    return f"{len(checks)} outputs within bound; " + "; ".join(parts)


def _failure(exc: Exception) -> str:
    return str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__


def check_graph(onnx_path: Path) -> GraphCheck:
    """ONNX Runtime on the graph's saved feeds vs its float64 reference, per output."""
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.comparator import Comparator, IterationResult

    quiet_polygraphy()
    onnx_path = Path(onnx_path)
    name = onnx_path.stem
    check_dir = onnx_path.parent / CHECK_DIR
    if not all(p.is_file() for p in reference_paths(check_dir, name)):
        return GraphCheck(name, False, f"no saved PyTorch reference in {check_dir} (re-export to create it)")
    try:
        feeds, ref = load_reference(check_dir, name)
    except Exception as exc:  # corrupt or old-format reference files
        return GraphCheck(name, False, f"unreadable reference: {_failure(exc)}")
    try:
        runner = OnnxrtRunner(SessionFromOnnx(str(onnx_path), providers=["CPUExecutionProvider"]), name="onnxrt")
        runs = Comparator.run([runner], data_loader=[feeds])
    except Exception as exc:  # a graph ONNX Runtime cannot load or run
        return GraphCheck(name, False, f"could not run: {_failure(exc)}", dtype=ref.dtype)
    runs.append((REFERENCE_RUNNER, [IterationResult(outputs=ref.reference, runner_name=REFERENCE_RUNNER)]))
    try:
        verdict = Comparator.compare_accuracy(runs, comparisons=[(0, 1)], compare_func=ErrorBound(ref))
    except Exception as exc:  # e.g. a reference missing a run's output
        return GraphCheck(name, False, f"could not compare: {_failure(exc)}", dtype=ref.dtype)
    checks = list(verdict[0][("onnxrt", REFERENCE_RUNNER)][0].values())
    passed = bool(verdict) and all(checks)
    return GraphCheck(name, passed, _summary(checks, ref.dtype), checks, ref.dtype)


def check_path(path: Path) -> list[GraphCheck]:
    """An export dir (every graph in its manifest) or a single .onnx file (its check/ beside it)."""
    path = Path(path)
    if path.is_file() and path.suffix == ".onnx":
        return [check_graph(path)]
    if not path.is_dir():
        raise SpecDeployError(f"nothing to check at {path} (expected an export directory or a .onnx file)")
    from ..runtime.manifest import load_manifest
    from .quantize import quantized_graphs

    manifest = load_manifest(path)
    quantized = quantized_graphs(manifest)  # int4/int8 weights: the task check's (export/task_check.py)
    return [check_graph(manifest.graph_path(g)) for name, g in manifest.graphs.items() if name not in quantized]


def print_report(results: list[GraphCheck], every_output: bool = False, out=None) -> None:
    """The table `specdeploy check` prints: a verdict line per graph, then its outputs."""
    import sys

    out = out or sys.stdout
    print(f"ONNX Runtime vs PyTorch float64, per output: max|err| <= {ERROR_FACTOR:g}x PyTorch's own max|err| in the "
          f"export dtype (worst of {1 + NOISE_RUNS} runs: plain + rounding noise) + {FLOOR_ULPS:g} ulp of "
          "max|reference|",
          file=out)
    for r in results:
        print(f"{'ok  ' if r.passed else 'FAIL'} {r.graph}", file=out)
        for line in r.table(every_output):
            print(line, file=out)
