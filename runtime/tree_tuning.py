"""Static-tree calibration: per-depth, per-rank acceptance + this backend's verify time -> the
tree that maximizes expected tokens per second (the Medusa paper's greedy construction).

Method-agnostic: a method supplies `AcceptanceStats` (how often its rank-r candidate at
depth d is the target's token, given that the path through depth d-1 was accepted) and
the per-step cost that is not the target call; `choose_tree` does the rest. Under the
product model a node's acceptance probability is the product of its path's per-level
rates, which never exceeds its parent's, so adding nodes in order of that probability
(ties: shallower first) keeps every prefix of the order a valid, prefix-closed tree, and
each prefix is the best tree of its size. Expected tokens per step = 1 (the bonus token)
+ the sum of node probabilities; the size is chosen to maximize that over the step time.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

import numpy as np

from .errors import SpecDeployError


@dataclass
class AcceptanceStats:
    """hits[d, r]: rank r at depth d+1 was the target's token; trials[d]: the path through depth d was accepted."""

    hits: np.ndarray  # [depths, ranks] int
    trials: np.ndarray  # [depths] int

    @staticmethod
    def empty(depths: int, ranks: int) -> "AcceptanceStats":
        return AcceptanceStats(np.zeros((depths, ranks), np.int64), np.zeros(depths, np.int64))

    def rates(self) -> np.ndarray:
        """[depths, ranks] conditional acceptance probabilities (0 where never tried)."""
        return self.hits / np.maximum(self.trials, 1)[:, None]

    def to_json(self) -> dict:
        return {"hits": self.hits.tolist(), "trials": self.trials.tolist(),
                "rates": np.round(self.rates(), 4).tolist()}


@dataclass
class TimeModel:
    """Seconds per step as a function of the verify call's token count (root included).

    Piecewise-linear through measured (tokens, seconds) points, extended with the
    slope of the last two points; plus a constant for the drafter and the host loop.
    """

    points: list[tuple[int, float]]  # measured verify-call times
    per_step: float = 0.0  # drafting + host work per step, independent of the tree size

    def __post_init__(self):
        if not self.points:
            raise SpecDeployError("tree tuning: no verify timings to build a time model from")
        # A bigger call never costs less: without this, timing noise would make the tuner
        # favour whatever size happened to measure low.
        self.points = [(int(t), float(s)) for t, s in sorted(self.points)]
        for i in range(1, len(self.points)):
            t, s = self.points[i]
            self.points[i] = (t, max(s, self.points[i - 1][1]))

    def verify(self, tokens: int) -> float:
        xs = np.array([p[0] for p in self.points], float)
        ys = np.array([p[1] for p in self.points], float)
        if len(xs) == 1:
            return float(ys[0])
        if tokens <= xs[-1]:
            return float(np.interp(tokens, xs, ys))
        slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
        return float(ys[-1] + slope * (tokens - xs[-1]))

    def __call__(self, tokens: int) -> float:
        return self.verify(tokens) + self.per_step

    def to_json(self) -> dict:
        return {"verify_s": [[t, round(s, 6)] for t, s in self.points], "per_step_s": round(self.per_step, 6)}


def greedy_order(rates: np.ndarray, max_nodes: int) -> list[tuple[tuple[int, ...], float]]:
    """Nodes (paths of ranks) in the order Medusa's greedy construction adds them, with
    their acceptance probabilities under the product model."""
    depths, ranks = rates.shape
    order: list[tuple[tuple[int, ...], float]] = []
    # Max-heap on probability; ties go to shallower, then lower ranks (parents before children).
    heap: list[tuple[float, int, tuple[int, ...]]] = [(-float(rates[0, r]), 1, (r,)) for r in range(ranks)]
    heapq.heapify(heap)
    while heap and len(order) < max_nodes:
        neg_p, depth, path = heapq.heappop(heap)
        order.append((path, -neg_p))
        if depth < depths:
            for r in range(ranks):
                heapq.heappush(heap, (neg_p * float(rates[depth, r]), depth + 1, path + (r,)))
    return order


@dataclass
class TreeChoice:
    paths: list[list[int]]
    expected_tokens: float  # per step, bonus token included
    step_s: float
    tokens_per_s: float
    curve: list[dict] = field(default_factory=list)  # per candidate size

    def to_json(self) -> dict:
        return {"nodes": len(self.paths), "expected_tokens_per_step": round(self.expected_tokens, 4),
                "step_s": round(self.step_s, 6), "expected_tokens_per_s": round(self.tokens_per_s, 2)}


def choose_tree(rates: np.ndarray, time_model, max_nodes: int = 64) -> TreeChoice:
    """The prefix of the greedy order maximizing expected tokens/s under `time_model(tokens)`."""
    rates = np.asarray(rates, float)
    if rates.ndim != 2 or rates.size == 0 or not np.all((0 <= rates) & (rates <= 1)):
        raise SpecDeployError("tree tuning: acceptance rates must be a non-empty [depths, ranks] array in [0, 1]")
    order = greedy_order(rates, max_nodes)
    best: tuple[int, float, float, float] | None = None
    curve: list[dict] = []
    expected = 1.0
    # Size 0 (plain decoding) is a candidate too: the tree must pay for itself.
    for n in range(0, len(order) + 1):
        if n:
            expected += order[n - 1][1]
        step = time_model(n + 1)
        rate = expected / step
        curve.append({"nodes": n, "expected_tokens": round(expected, 4), "step_s": round(step, 6),
                      "tokens_per_s": round(rate, 2)})
        if n and (best is None or rate > best[2]):
            best = (n, expected, rate, step)
    assert best is not None or not order  # size 1 onwards always sets it
    if best is None:
        return TreeChoice([], 1.0, 0.0, 0.0, curve)
    n, expected, rate, step = best
    return TreeChoice([list(p) for p, _ in order[:n]], expected, step, rate, curve)


def chain_rates(rates: np.ndarray) -> np.ndarray:
    """Acceptance as a target held to exact rows verifies a tree (a quantized or `--exact-rows` export:
    runtime/verify.py, `exact_rows`): only the leading chain is followed, so a node off it adds no
    token (the token it guessed is the bonus token of its parent's row either way). Rank 0 at every
    depth is the chain the greedy order builds first."""
    out = np.array(rates, float)
    out[:, 1:] = 0.0
    return out


def empirical_expected_tokens(paths: list[list[int]], matched: list[tuple[int, ...]]) -> float:
    """Mean tokens per step a tree would have produced on recorded greedy steps.

    `matched[i]` is step i's ranks of the target's actual tokens at depths 1, 2, ...
    (cut at the first token outside the candidates). Greedy verification accepts the
    longest tree path that is a prefix of it. No independence assumption: a check on
    the product model.
    """
    nodes = {tuple(p) for p in paths}
    total = 0
    for ranks in matched:
        depth = 0
        while depth < len(ranks) and tuple(ranks[: depth + 1]) in nodes:
            depth += 1
        total += depth + 1
    return total / max(len(matched), 1)


def timed_sizes(decoder, largest: int) -> list[int]:
    """The call sizes the time model measures: the exported ones, and where the backend calls
    at any T (decoder.call_sizes), each small T too: a tree of n nodes runs at T = n + 1, and
    a row's cost is far from linear there (SmolLM2 on 2 cores: T=2 as T=1, T=4 1.1x, T=9 1.4x)."""
    small = [t for t in decoder.call_sizes if t <= min(largest, 16)]
    return sorted(set(decoder.sizes) | set(small))


def time_verify(decoder, sizes: list[int], past: int, repeats: int = 20) -> list[tuple[int, float]]:
    """Median seconds of one target call per static size, with `past` cached tokens (contents irrelevant)."""
    if past + max(sizes) > decoder.max_context:
        past = max(decoder.max_context - max(sizes) - 1, 0)
    out = []
    for t in sizes:
        tokens, positions = np.zeros(t, np.int64), past + np.arange(t)
        mask = np.tril(np.ones((t, t), bool))
        times = []
        for _ in range(repeats + 2):
            decoder.cache.length = past
            start = time.perf_counter()
            decoder.forward(tokens, positions, mask)
            times.append(time.perf_counter() - start)
        out.append((t, float(np.median(times[2:]))))  # first calls warm the session up
    decoder.cache.length = 0
    return out


# ---------------------------------------------------------------- calibration driver


@dataclass
class Calibration:
    """What a method's calibration hook (MethodSpec.calibrate) measured on the calibration prompts (greedy)."""

    stats: AcceptanceStats
    matched: list[tuple[int, ...]]  # per recorded position: ranks of the target's next tokens (see empirical_...)
    per_step_s: float  # drafting + host seconds per step, outside the target call
    current_paths: list[list[int]]  # the export's own tree, for comparison


def tune(export, method: str, prompts: list[list[int]], max_new_tokens: int = 64, max_nodes: int = 64,
         progress=print) -> dict:
    """Calibrate `method` on `prompts` (token ids) and choose its static tree for this backend."""
    from .methods import method_spec, tunable_methods  # the registry's hooks import this module

    tunable = tunable_methods()
    if method not in tunable:
        raise SpecDeployError(f"tune-tree supports {', '.join(sorted(tunable))}, not {method!r}")
    if not prompts:
        raise SpecDeployError("tune-tree: no calibration prompts")
    start = time.perf_counter()
    calibrate = method_spec(method).calibrate
    assert calibrate is not None  # tunable_methods() lists only methods with the hook
    cal = calibrate(export, prompts, max_new_tokens)
    progress(f"[tune-tree] {len(cal.matched)} calibration positions from {len(prompts)} prompts "
             f"({time.perf_counter() - start:.1f}s)")
    decoder = export.decoder("target")
    past = int(np.mean([len(p) for p in prompts])) + max_new_tokens // 2
    model = TimeModel(time_verify(decoder, timed_sizes(decoder, max_nodes + 1), past), cal.per_step_s)
    progress("[tune-tree] verify time per call: "
             + ", ".join(f"T={t} {s * 1e3:.2f}ms" for t, s in model.points)
             + f"; drafting + host {cal.per_step_s * 1e3:.2f}ms per step")
    exact = export.manifest.exact_rows
    rates = chain_rates(cal.stats.rates()) if exact else cal.stats.rates()
    followed = (lambda paths: [p for p in paths if not any(p)]) if exact else (lambda paths: paths)  # noqa: E731
    choice = choose_tree(rates, model, max_nodes)
    current = cal.current_paths
    current_expected = 1.0 + sum(float(np.prod([rates[d, r] for d, r in enumerate(p)])) for p in current)
    export_empirical = empirical_expected_tokens(followed(current), cal.matched)
    report = {
        "method": method,
        "exact_rows": exact,  # trees followed along their leading chain only (chain_rates)
        "chosen": {**choice.to_json(), "empirical_tokens_per_step":
                   round(empirical_expected_tokens(followed(choice.paths), cal.matched), 4)},
        "export_tree": {"nodes": len(current), "expected_tokens_per_step": round(current_expected, 4),
                        "empirical_tokens_per_step": round(export_empirical, 4),
                        "expected_tokens_per_s": round(current_expected / model(len(current) + 1), 2)},
        "acceptance": cal.stats.to_json(),
        "time_model": model.to_json(),
        "curve": choice.curve,
        "prompts": len(prompts),
        "positions": len(cal.matched),
        "seconds": round(time.perf_counter() - start, 1),
    }
    progress(f"[tune-tree] chosen: {len(choice.paths)} nodes, {choice.expected_tokens:.2f} tokens/step expected "
             f"({report['chosen']['empirical_tokens_per_step']:.2f} on the calibration steps), "
             f"{choice.tokens_per_s:.1f} tokens/s expected; the export's tree of {len(current)} nodes: "
             f"{report['export_tree']['expected_tokens_per_s']:.1f} tokens/s expected")
    return {"paths": choice.paths, "report": report}


def read_prompts_file(path) -> list[str]:
    """Calibration prompts: a .json list of strings, or .jsonl lines (a string or {"prompt": ...})."""
    from pathlib import Path

    from .manifest import parse_json

    path = Path(path)
    if not path.is_file():
        raise SpecDeployError(f"prompts file not found: {path}")
    try:
        if path.suffix == ".jsonl":
            items = [parse_json(line) for line in path.read_text().splitlines() if line.strip()]
        else:
            items = parse_json(path.read_text())
    except ValueError as exc:
        raise SpecDeployError(f"prompts file {path} is not valid JSON/JSONL: {exc}") from None
    except OSError as exc:
        raise SpecDeployError(f"cannot read prompts file {path}: {exc.strerror or exc}") from None
    if not isinstance(items, list):
        raise SpecDeployError(f"prompts file {path}: expected a list of strings")
    prompts = [item.get("prompt") if isinstance(item, dict) else item for item in items]
    texts = [p for p in prompts if isinstance(p, str) and p]
    if not texts or len(texts) != len(prompts):
        raise SpecDeployError(f"prompts file {path}: expected non-empty strings (or objects with a 'prompt')")
    return texts


TREE_SOURCE = "specdeploy tune-tree"  # what write_tree writes as "source": such a file may be overwritten
MAX_TREE_BYTES = 1 << 20


def check_tree_out(path) -> None:
    """Refuse an --out that write_tree must not replace, before the calibration (minutes) runs:
    a directory, or an existing file that an earlier tune-tree did not write (the prompts file,
    an export's manifest.json, ...: nothing the user gave is overwritten)."""
    from pathlib import Path

    from .manifest import parse_json

    path = Path(path)
    if path.is_dir():
        raise SpecDeployError(f"--out {path} is a directory; give the tree file's name (e.g. {path / 'tree.json'})")
    if path.exists() and not path.is_file():  # a device or a pipe (/dev/stdout): reading it could block
        raise SpecDeployError(f"--out {path} is not a regular file; give the tree file's name")
    if path.exists():
        try:  # a tree file is kilobytes: a big file (a model given by mistake) is not read whole
            doc = parse_json(path.read_text(encoding="utf-8")) if path.stat().st_size <= MAX_TREE_BYTES else None
        except (OSError, ValueError):
            doc = None
        if not (isinstance(doc, dict) and doc.get("source") == TREE_SOURCE):
            raise SpecDeployError(f"--out {path} exists and is not a tree written by `specdeploy tune-tree`; "
                                  "refusing to overwrite it: choose another file")
    # the file is written beside itself and renamed (atomic_write): its folder, the nearest that exists, must
    # take a new file, or the calibration's minutes end in "Read-only file system"
    import os

    folder = path.absolute().parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not os.access(folder, os.W_OK | os.X_OK):
        raise SpecDeployError(f"--out {path}: cannot write in {folder} (read-only, or no permission): choose "
                              "another file")


def write_tree(path, method: str, result: dict) -> None:
    """A tree file `--tree FILE` (and configs/trees/) accepts, with the calibration that chose it."""
    import json
    from pathlib import Path

    from .atomic_write import replace_text

    path = Path(path)
    check_tree_out(path)
    head = {"about": f"static {method} tree chosen by `specdeploy tune-tree` for this export and backend",
            "source": TREE_SOURCE, "calibration": result["report"]}
    paths = ",\n".join("  " + json.dumps(p) for p in result["paths"])  # one path per line: readable diffs
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # whole or not at all: a failed write truncated an earlier tree, and left a file the rerun refused
        replace_text(path, json.dumps(head)[:-1] + f', "paths": [\n{paths}\n]}}\n')
    except OSError as exc:
        raise SpecDeployError(f"cannot write {path}: {exc.strerror or exc}") from None
