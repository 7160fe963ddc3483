"""Where our generate loop spends its time: the runtime's own stage timers plus cProfile.

    python -m specdeploy.bench.profile OUT [--method ar] [--prompts FILE] [--max-new-tokens 128] [--threads 2]
    python -m specdeploy.bench.profile OUT --graph-vs-ortgenai [--past 200]
    python -m specdeploy.bench.profile OUT --ops [--past 200]

Stage timers (Generation.stats): prefill, draft, verify (target graph calls), host (the
rest: verification, KV commits, detokenizing). cProfile's top functions by self time then
say which Python or ONNX Runtime calls those seconds are.

--graph-vs-ortgenai times the decode graph alone (T=1, KV bound in place, same ONNX
Runtime, same thread pool, interleaved rounds): our fused target graph against
onnxruntime-genai's model of the same target (built by `make peers`). Equal graph times
put any end-to-end gap in the loops around them.

--ops runs the graph our AR step calls (its smallest fused target graph at that graph's T; where
the runtime's load check pads one-row calls, runtime/backends/ort_decoder.py, AR runs two rows) under
ONNX Runtime's profiler, KV bound in place: ms per call by op type (MatMulNBits, attention,
norms ...), beside the wall time per call, and the bytes the roofline counts for it.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

from .prompts import encode_items, load_items, shipped_sets


def profile(export_dir: Path, method: str, items: list[dict], max_new_tokens: int, threads: int,
            top: int = 18) -> str:
    """`items`: prompts as bench.prompts.load_items reads them (chat items through the export's template)."""
    from ..runtime.backends import use_shared_threads
    from ..runtime.generate import generate
    from ..runtime.loaded_export import LoadedExport

    use_shared_threads(threads)  # as the CLI, server and bench run
    export = LoadedExport(export_dir, backend="ort-cpu", threads=threads)
    ids = encode_items(items, export)
    generate(export, ids[0], method=method, max_new_tokens=max_new_tokens, ignore_eos=True)  # warm-up
    totals: dict[str, float] = {}
    tokens, calls, wall = 0, 0, 0.0
    prof = cProfile.Profile()
    for p in ids:
        t0 = time.perf_counter()
        prof.enable()
        res = generate(export, p, method=method, max_new_tokens=max_new_tokens, ignore_eos=True)
        prof.disable()
        wall += time.perf_counter() - t0
        tokens += res.stats["new_tokens"]
        calls += res.stats["target_calls"]
        for key in ("prefill_s", "draft_s", "verify_s", "host_s"):
            totals[key] = totals.get(key, 0.0) + res.stats[key]
    out = io.StringIO()
    print(f"{method}: {tokens} tokens in {wall:.3f} s under cProfile ({tokens / wall:.1f} tokens/s; profiling adds "
          f"overhead), {calls} target calls, acceptance length {tokens / max(calls, 1):.2f}", file=out)
    for key, sec in totals.items():
        print(f"  {key[:-2]:8s} {sec:7.3f} s  {100 * sec / wall:5.1f}%  {1000 * sec / max(calls, 1):6.3f} ms/step",
              file=out)
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


def graph_vs_ortgenai(export_dir: Path, peers_dir: Path, threads: int, past: int = 200, rounds: int = 10,
                      runs: int = 100) -> str:
    """Median ms per T=1 call of our fused graph and of onnxruntime-genai's, interleaved."""
    import numpy as np
    import onnxruntime as ort

    from ..runtime.backends import session_options, use_shared_threads
    from ..runtime.errors import SpecDeployError
    from ..runtime.manifest import load_manifest
    from .peers import genai_model_dirs

    use_shared_threads(threads)
    manifest = load_manifest(export_dir, verify_checksums=False)
    ours = manifest.decoder_graphs("target", "fused").get(1)
    if ours is None:
        raise SpecDeployError(f"{export_dir} has no fused T=1 target graph")
    spec = manifest.models["target"]
    source = getattr(spec, "source", None) or (getattr(spec, "extra", None) or {}).get("source")
    if not source:
        raise SpecDeployError(f"{export_dir}/manifest.json names no target source (models.target.source)")
    genai_dir = genai_model_dirs(source, None, peers_dir, build=False)["plain"]
    if not (genai_dir / "model.onnx").is_file():
        raise SpecDeployError(f"no onnxruntime-genai model at {genai_dir} (run `make peers`)")
    keep = []

    def bound(path: Path, kv_name, inputs: dict, outputs: dict):
        session = ort.InferenceSession(str(path), session_options(threads), providers=["CPUExecutionProvider"])
        binding = session.io_binding()

        def value(array):
            keep.append(array)
            keep.append(ort.OrtValue.ortvalue_from_numpy(array))
            return keep[-1]

        for layer in range(spec.num_layers):
            for kind in ("key", "value"):
                buf = value(np.zeros((1, spec.num_kv_heads, manifest.max_context, spec.head_dim), np.float32))
                binding.bind_ortvalue_input(kv_name(layer, kind, "in"), buf)
                binding.bind_ortvalue_output(kv_name(layer, kind, "out"), buf)
        known = {i.name for i in session.get_inputs()}
        for name, array in inputs.items():
            if name in known:  # logit_rows: graphs exported before it lack it
                binding.bind_ortvalue_input(name, value(array))
        for name, array in outputs.items():
            binding.bind_ortvalue_output(name, value(array))
        return session, binding

    logits = lambda: np.zeros((1, 1, spec.vocab_size), np.float32)  # noqa: E731
    systems = {
        "specdeploy (fused)": bound(
            manifest.graph_path(ours), lambda i, k, d: f"{'past' if d == 'in' else 'present'}_{k}.{i}",
            {"input_ids": np.zeros((1, 1), np.int64), "position_ids": np.array([[past]]),
             "tree_mask": np.ones((1, 1, 1), bool), "past_length": np.array([past]), "logit_rows": np.array([1])},
            {"logits": logits(), "hidden": np.zeros((1, 1, spec.hidden_size), np.float32)}),
        "onnxruntime-genai": bound(
            genai_dir / "model.onnx", lambda i, k, d: f"past_key_values.{i}.{k}" if d == "in" else f"present.{i}.{k}",
            {"input_ids": np.zeros((1, 1), np.int64), "attention_mask": np.ones((1, past + 1), np.int64)},
            {"logits": logits()}),
    }
    times: dict[str, list[float]] = {name: [] for name in systems}
    for session, binding in systems.values():  # warm-up
        for _ in range(20):
            session.run_with_iobinding(binding)
    for _ in range(rounds):
        for name, (session, binding) in systems.items():
            start = time.perf_counter()
            for _ in range(runs):
                session.run_with_iobinding(binding)
            times[name].append((time.perf_counter() - start) / runs * 1e3)
    lines = [f"decode graph alone (T=1, past {past}, {threads} threads, shared pool, KV bound in place), "
             f"median of {rounds} interleaved rounds of {runs} calls:"]
    lines += [f"  {name:20s} {sorted(t)[len(t) // 2]:.3f} ms (min {min(t):.3f})" for name, t in times.items()]
    return "\n".join(lines) + "\n"


def op_split(export_dir: Path, threads: int, past: int = 200, runs: int = 40) -> str:
    """ms per call of the AR step's graph, by op type, from ONNX Runtime's profiler."""
    import json
    import tempfile

    import numpy as np
    import onnxruntime as ort

    from ..runtime.backends import session_options
    from ..runtime.loaded_export import LoadedExport
    from . import roofline
    from .run import _target_graph

    export = LoadedExport(export_dir, backend="ort-cpu")
    graph, tokens = _target_graph(export)
    spec = export.manifest.models["target"]
    keep = []
    with tempfile.TemporaryDirectory() as tmp:
        so = session_options(threads)
        so.enable_profiling = True
        so.profile_file_prefix = str(Path(tmp) / "ort")
        session = ort.InferenceSession(str(graph), so, providers=["CPUExecutionProvider"])
        binding = session.io_binding()

        def bind(name: str, array, output: bool = False):
            keep.append(array)
            keep.append(ort.OrtValue.ortvalue_from_numpy(array))
            (binding.bind_ortvalue_output if output else binding.bind_ortvalue_input)(name, keep[-1])

        for layer in range(spec.num_layers):
            for kind in ("key", "value"):
                buf = np.zeros((1, spec.num_kv_heads, export.manifest.max_context, spec.head_dim), np.float32)
                bind(f"past_{kind}.{layer}", buf)
                binding.bind_ortvalue_output(f"present_{kind}.{layer}", keep[-1])
        bind("input_ids", np.zeros((1, tokens), np.int64))
        bind("position_ids", np.arange(past, past + tokens)[None])
        bind("tree_mask", np.tril(np.ones((tokens, tokens), bool))[None])
        bind("past_length", np.array([past]))
        if any(i.name == "logit_rows" for i in session.get_inputs()):
            bind("logit_rows", np.array([tokens]))
        bind("logits", np.zeros((1, tokens, spec.vocab_size), np.float32), output=True)
        bind("hidden", np.zeros((1, tokens, spec.hidden_size), np.float32), output=True)
        for _ in range(5):
            session.run_with_iobinding(binding)
        start = time.perf_counter()
        for _ in range(runs):
            session.run_with_iobinding(binding)
        wall = (time.perf_counter() - start) / runs * 1e3
        events = json.loads(Path(session.end_profiling()).read_text())
    by_op: dict[str, float] = {}
    calls = sum(1 for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            op = e.get("args", {}).get("op_name", "?")
            by_op[op] = by_op.get(op, 0.0) + e["dur"] / 1e3
    total = sum(by_op.values())
    nbytes = roofline.onnx_weight_bytes(graph, tokens)["bytes_per_pass"]
    lines = [f"{graph.name} (T={tokens}, past {past}, {threads} threads, KV bound in place): {wall:.2f} ms per call "
             f"(wall, {runs} calls); the roofline counts {nbytes / 1e6:.1f} MB read per call; kernel time by op "
             f"(ONNX Runtime profiler, {calls} calls):"]
    for op, ms in sorted(by_op.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {op:32s} {ms / max(calls, 1):7.3f} ms  {ms / total:5.1%}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="export directory")
    p.add_argument("--method", default="ar")
    p.add_argument("--prompts", type=Path, help="JSONL prompts (default: the shipped code set)")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--graph-vs-ortgenai", action="store_true",
                   help="time the T=1 decode graph alone beside onnxruntime-genai's (needs `make peers`)")
    p.add_argument("--ops", action="store_true",
                   help="the AR step's graph alone under ONNX Runtime's profiler: ms per call by op type")
    p.add_argument("--past", type=int, default=200, help="cached tokens for --graph-vs-ortgenai and --ops")
    p.add_argument("--peers-dir", type=Path, default=Path("build/peers"))
    args = p.parse_args(argv)
    if args.graph_vs_ortgenai:
        from ..runtime.errors import SpecDeployError
        from .peers import PeerUnavailable

        try:
            sys.stdout.write(graph_vs_ortgenai(args.out, args.peers_dir, args.threads, args.past))
        except (SpecDeployError, PeerUnavailable) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    from ..runtime.errors import SpecDeployError

    try:
        if args.ops:
            sys.stdout.write(op_split(args.out, args.threads, args.past))
            return 0
        items = load_items(args.prompts or shipped_sets()["code"])[: args.num_prompts]
        sys.stdout.write(profile(args.out, args.method, items, args.max_new_tokens, args.threads))
    except SpecDeployError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
