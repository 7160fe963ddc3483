"""`specdeploy engines OUT`: one TensorRT engine per exported ONNX graph.

* Network: parsed from the ONNX file (external weights resolved next to it),
  strongly typed where the flag exists (TensorRT >= 9; the only mode of
  TensorRT 11): precision is whatever the export's tensors say, so a float16
  export gives a float16 engine and a float32 export stays float32 (TF32 is
  cleared so float32 engines match ONNX Runtime within float32 tolerances).
* Profile: runtime/backends/trt_profiles.py (T fixed, past length 0..max_context-T).
* Timing cache: OUT/engines/timing.cache (or --timing-cache), loaded before and
  saved after every engine, so rebuilding one graph, or a sibling export on the
  same GPU, skips most kernel timing.
* Crash safety: every file is written to a temp name and renamed (a kill -9 leaves the
  previous engine and record; the next run removes the temp files), and the run holds
  the export's lock (export/out_dir.py), so it never races an export replacing OUT.
* Bookkeeping: OUT/engines.json (engines/engine_manifest.py writes it,
  runtime/backends/engine_records.py reads it). Fresh engines are kept; missing or stale ones are (re)built with the reason printed; --rebuild
  rebuilds everything; --no-rebuild turns a missing or stale engine into an error.
  The "trt" runtime backend never rebuilds: it refuses stale engines.

Everything tensorrt-specific is imported inside functions, so this module
imports (and `specdeploy engines` prints its skip line) without TensorRT.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

from ..runtime.backends.engine_records import ENGINE_DIR, engine_rel, file_digests, load_engines, stale_reasons
from ..runtime.backends.trt_profiles import NoProfile, graph_profile, profile_json
from ..runtime.errors import SpecDeployError
from ..runtime.manifest import load_manifest
from ..export.out_dir import export_lock
from .engine_manifest import atomic_write, graph_sources, make_record, remove_partial_writes, save_engines

TIMING_CACHE = f"{ENGINE_DIR}/timing.cache"


@dataclass
class BuildResult:
    graph: str
    action: str  # "kept", "built", "rebuilt", "skipped"
    detail: str


def skip_reason() -> str | None:
    """Why engines cannot be built here (None: TensorRT and a GPU are present)."""
    from ..runtime.backends.trt import unavailable_reason

    return unavailable_reason()


def _network_flags(trt) -> int:
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 1 << int(flag) if flag is not None else 0


def _parse(trt, builder, logger, onnx_path: Path):
    network = builder.create_network(_network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = []
        for i in range(parser.num_errors):
            err = parser.get_error(i)
            node = err.node_name() if hasattr(err, "node_name") else err.node()
            errors.append(f"node {node}: {err.desc()}")
        raise SpecDeployError(f"TensorRT cannot parse {onnx_path.name}: {'; '.join(errors[:3]) or 'unknown error'} "
                              "(`specdeploy check` lints the graph against the TensorRT operator matrix)")
    return network, parser  # the parser owns weights the network refers to: keep it alive


class TimingCache:
    """One ITimingCache shared by every build of a run, persisted after each engine."""

    def __init__(self, path: Path):
        self.path = path
        self.cache = None

    def attach(self, config) -> None:
        if self.cache is None:
            blob = self.path.read_bytes() if self.path.is_file() else b""
            self.cache = config.create_timing_cache(blob)
            if self.cache is None or not config.set_timing_cache(self.cache, False):
                # Written by another TensorRT version or GPU: start a fresh one.
                self.cache = config.create_timing_cache(b"")
                config.set_timing_cache(self.cache, False)
            return
        config.set_timing_cache(self.cache, False)

    def save(self, config) -> None:
        cache = config.get_timing_cache()
        if cache is not None:
            atomic_write(self.path, bytes(memoryview(cache.serialize())))


def build_engine(trt, builder, logger, manifest, graph, workspace_gb: float | None, timing: TimingCache):
    """Serialized engine bytes and the profile used, for one graph."""
    onnx_path = manifest.graph_path(graph)
    network, _parser = _parse(trt, builder, logger, onnx_path)
    inputs = {}
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        inputs[tensor.name] = tuple(tensor.shape)
    profile = graph_profile(manifest, graph, inputs)
    config = builder.create_builder_config()
    if workspace_gb:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gb * (1 << 30)))
    if manifest.dtype == "float32" and hasattr(trt.BuilderFlag, "TF32"):
        config.clear_flag(trt.BuilderFlag.TF32)
    opt = builder.create_optimization_profile()
    for name, r in profile.items():
        opt.set_shape(name, r.min, r.opt, r.max)
    config.add_optimization_profile(opt)
    timing.attach(config)
    logger.errors.clear()
    blob = builder.build_serialized_network(network, config)
    if blob is None:
        detail = logger.errors[-1] if logger.errors else "no error message"
        raise SpecDeployError(f"TensorRT could not build an engine for {graph.name}: {detail}")
    timing.save(config)
    return bytes(memoryview(blob)), profile


def build_engines(export_dir: str | Path, rebuild: bool = False, workspace_gb: float | None = None,
                  timing_cache: str | Path | None = None, progress=print, allow_build: bool = True) -> list[BuildResult]:
    """Build missing and stale engines (all with rebuild=True); with allow_build=False a
    missing or stale engine is an error instead (a deploy-time freshness check)."""
    reason = skip_reason()
    if reason:
        raise SpecDeployError(f"cannot build TensorRT engines: {reason}")
    import tensorrt as trt

    with export_lock(Path(export_dir), required=False):  # never beside a running export's swap
        return _build_engines(trt, export_dir, rebuild, workspace_gb, timing_cache, progress, allow_build)


def _build_engines(trt, export_dir, rebuild, workspace_gb, timing_cache, progress, allow_build) -> list[BuildResult]:
    from ..runtime.backends.trt import gpu_identity, trt_logger

    manifest = load_manifest(export_dir)
    root = manifest.root
    for path in remove_partial_writes(root):
        progress(f"  removed {path.name}, left by an interrupted run")
    identity = {"tensorrt": trt.__version__, **gpu_identity()}
    data = load_engines(root)
    digest = file_digests(root)
    logger = trt_logger()
    builder = trt.Builder(logger)
    timing = TimingCache(Path(timing_cache) if timing_cache else root / TIMING_CACHE)
    results = []
    for name, graph in manifest.trt_graphs().items():
        record = data["engines"].get(name)
        # The engine's sha256 too (the trt backend checks it): a corrupted plan is rebuilt, not kept.
        why = ["--rebuild"] if rebuild else (["no engine built"] if record is None
                                             else stale_reasons(root, record, digest, verify_engine=True, **identity))
        if not why:
            results.append(BuildResult(name, "kept", "fresh"))
            progress(f"  {name}: fresh, kept")
            continue
        if not allow_build:
            raise SpecDeployError(f"the TensorRT engine for {name} is not usable: {'; '.join(why)} "
                                  f"(run `specdeploy engines {root}` without --no-rebuild)")
        progress(f"  {name}: building ({why[0]})")
        start = time.perf_counter()
        try:
            blob, profile = build_engine(trt, builder, logger, manifest, graph, workspace_gb, timing)
        except NoProfile as exc:  # only non-decoder graphs: they run on ORT's CUDA provider instead
            results.append(BuildResult(name, "skipped", str(exc)))
            progress(f"  {name}: skipped, {exc} (it runs on ONNX Runtime under --backend trt)")
            continue
        atomic_write(root / engine_rel(name), blob)
        seconds = time.perf_counter() - start
        data["engines"][name] = make_record(root, graph, graph_sources(manifest, name), digest, len(blob),
                                            hashlib.sha256(blob).hexdigest(), manifest.dtype, profile_json(profile),
                                            identity, seconds, workspace_gb)
        save_engines(root, data)  # after each engine: an interrupted run keeps what it finished
        results.append(BuildResult(name, "built" if record is None else "rebuilt", f"{len(blob) / 2**20:.1f} MiB in {seconds:.1f}s"))
        progress(f"  {name}: {results[-1].detail}")
    return results


def cli_engines(args) -> int:
    """The CLI handler: one skip line (exit 0) without TensorRT or a GPU, else build."""
    reason = skip_reason()
    if reason:
        print(f"engines: skipped, {reason}")
        return 0
    out = Path(args.out)
    print(f"engines: building TensorRT engines for {out}")
    results = build_engines(out, rebuild=args.rebuild, workspace_gb=args.workspace_gb,
                            timing_cache=getattr(args, "timing_cache", None),
                            allow_build=not getattr(args, "no_rebuild", False))
    count = {a: sum(r.action == a for r in results) for a in ("built", "rebuilt", "kept", "skipped")}
    print(f"engines: {count['built'] + count['rebuilt']} built, {count['kept']} fresh, {count['skipped']} skipped; "
          f"listed in {out / 'engines.json'}")
    return 0
