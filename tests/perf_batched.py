"""What a lone row costs in the batched target graph beside the batch-1 graph (not collected by
pytest): a plain decode step and a speculative step of T tokens, each at a past of 64, the
graphs' calls interleaved, median wall and CPU ms of `--repeats` calls each. `batched-last`:
the step scoring its last row only (a prefill chunk); `--before EXPORT`: that export's batched
graph too (an older form, e.g. one without the lone-row branch), as `batched-before`.

    python tests/perf_batched.py build/export/default [--threads 2] [--tokens 1 5 64] [--before DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from specdeploy.runtime.backends.ort import InPlaceGraph
from specdeploy.runtime.batching.graph import BatchedGraph, Run
from specdeploy.runtime.graph_contract import INPUT_IDS, PAST_LENGTH, POSITION_IDS, TARGET, TREE_MASK, past_names
from specdeploy.runtime.manifest import load_manifest

PAST = 64


def batch1_call(manifest, threads):
    """The batch-1 fused decoder's call: bound once per T in place (backends/ort.InPlaceGraph)."""
    record = next(iter(manifest.decoder_graphs(TARGET, "fused").values()))
    spec = manifest.models[TARGET]
    kv = {n: np.zeros((1, spec.num_kv_heads, manifest.max_context, spec.head_dim), np.float32)
          for n in past_names(spec.num_layers)}
    graphs: dict[int, InPlaceGraph] = {}

    def call(t: int) -> None:
        if t not in graphs:
            graphs[t] = InPlaceGraph(manifest.graph_path(record), threads, kv, tokens=t)
        graphs[t].run({INPUT_IDS: np.zeros((1, t), np.int64), POSITION_IDS: PAST + np.arange(t)[None],
                       TREE_MASK: np.tril(np.ones((1, t, t), bool)), PAST_LENGTH: np.array([PAST])})
    return call


def batched_call(manifest, threads, last_row: bool = False):
    graph = BatchedGraph(manifest, threads)
    spec = manifest.models[TARGET]
    kv = {n: np.zeros((1, spec.num_kv_heads, manifest.max_context + 1, spec.head_dim), np.float32)
          for n in past_names(spec.num_layers)}

    def call(t: int) -> None:
        if t == 1:
            graph.run([(0, PAST, PAST)], kv, [])
        else:
            graph.run([], None, [Run(np.zeros(t, np.int64), PAST + np.arange(t), np.tril(np.ones((t, t), bool)),
                                     PAST, kv, np.array([t - 1]) if last_row else None)])
    return call


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--before", type=Path, help="an export whose batched graph to time beside")
    args = ap.parse_args(argv)
    manifest = load_manifest(args.export, verify_checksums=False)
    calls = {"batch-1": batch1_call(manifest, args.threads), "batched": batched_call(manifest, args.threads),
             "batched-last": batched_call(manifest, args.threads, last_row=True)}
    if args.before is not None:
        calls["batched-before"] = batched_call(load_manifest(args.before, verify_checksums=False), args.threads)
    times: dict = {(name, t): ([], []) for name in calls for t in args.tokens}
    for name, call in calls.items():  # warm-up
        for t in args.tokens:
            call(t)
    for _ in range(args.repeats):
        for t in args.tokens:
            for name, call in calls.items():
                w, c = time.perf_counter(), time.process_time()
                call(t)
                times[name, t][0].append(time.perf_counter() - w)
                times[name, t][1].append(time.process_time() - c)
    for (name, t), (wall, cpu) in times.items():
        wall_ms, cpu_ms = 1000 * statistics.median(wall), 1000 * statistics.median(cpu)
        print(f"{name:14s} T={t:<3d} wall {wall_ms:6.1f} ms  cpu {cpu_ms:6.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
