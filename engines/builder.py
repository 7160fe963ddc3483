"""`specdeploy engines OUT`: TensorRT engines for the exported portable graphs.

* Layout: one engine per model. The exporter writes a decoder's graph with a dynamic
  token count, the same file content for every static T (export/onnx_writer.py), so
  those graphs become one engine with one optimization profile per static T
  (`engine_groups`): the weights are on the GPU once, each T still runs kernels
  tuned for its exact shape. Every other graph (static-T files of older exports,
  heads) is an engine of its own. engines.json keeps one record per graph, naming
  the engine file and its `profile_index` (the "trt" backend binds that profile).
* Network: parsed from the ONNX file (external weights resolved next to it),
  strongly typed where the flag exists (TensorRT >= 9; the only mode of
  TensorRT 11): precision is whatever the export's tensors say, so a float16
  export gives a float16 engine and a float32 export stays float32 (TF32 is
  cleared so float32 engines match ONNX Runtime within float32 tolerances).
* Profiles: runtime/backends/trt_profiles.py (T fixed, past length 0..max_context-T),
  one per graph of the engine, in the order of its graphs (ascending T).
* Timing cache: OUT/engines/timing.cache (or --timing-cache), loaded before and
  saved after every engine, so rebuilding one graph, or a sibling export on the
  same GPU, skips most kernel timing.
* Crash safety: every file is written to a temp name and renamed (a kill -9 leaves the
  previous engine and record; the next run removes the temp files), and the run holds
  the export's lock (export/out_dir.py), so it never races an export replacing OUT.
* Bookkeeping: OUT/engines.json (engines/engine_manifest.py writes it,
  runtime/backends/engine_records.py reads it). Fresh engines are kept; missing or stale
  ones are (re)built with the reason printed; --rebuild rebuilds everything;
  --no-rebuild turns a missing or stale engine into an error.
  The "trt" runtime backend never rebuilds: it refuses stale engines.

Written to the documented TensorRT 10 Python API (IBuilder.create_optimization_profile,
IOptimizationProfile.set_shape, IBuilderConfig.add_optimization_profile). Everything
tensorrt-specific is imported inside functions, so this module imports (and
`specdeploy engines` prints its skip line) without TensorRT.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

from ..export.out_dir import export_lock
from ..runtime.backends.engine_records import ENGINE_DIR, engine_rel, file_digests, load_engines, stale_reasons
from ..runtime.backends.trt_profiles import NoProfile, graph_profile, profile_json
from ..runtime.errors import SpecDeployError
from ..runtime.graph_contract import DECODER, GraphRecord
from ..runtime.manifest import load_manifest
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


@dataclass(frozen=True)
class EngineGroup:
    """The graphs one engine serves: profile i is graphs[i] (ascending T)."""

    name: str  # the engine file's stem: engines/{name}.engine
    graphs: tuple[GraphRecord, ...]


def engine_groups(manifest, digest) -> list[EngineGroup]:
    """A model's decoder graphs whose ONNX files are byte-identical (one dynamic-T graph written
    for each static T) share an engine; any other graph is an engine of its own, named after it.
    `digest(rel)` is the sha256 of a file of the export."""
    shared: dict[tuple, list[GraphRecord]] = {}
    for name, g in manifest.trt_graphs().items():
        key = (g.model, digest(g.file)) if g.kind == DECODER else (name,)
        shared.setdefault(key, []).append(g)
    groups = []
    for graphs in shared.values():
        graphs.sort(key=lambda g: g.tokens)
        name = graphs[0].name if len(graphs) == 1 else f"{graphs[0].model}_t" + "-".join(str(g.tokens) for g in graphs)
        groups.append(EngineGroup(name, tuple(graphs)))
    return groups


def group_staleness(root: Path, group: EngineGroup, records: dict, digest, identity: dict) -> list[str]:
    """Why the group's engine must be (re)built: a graph without a record, a record of another
    layout (another file or profile), or a stale engine (engine_records.stale_reasons)."""
    for index, g in enumerate(group.graphs):
        record = records.get(g.name)
        if record is None:
            return [f"no engine built for {g.name}"]
        if record.get("file") != engine_rel(group.name) or record.get("profile_index", 0) != index:
            return [f"{g.name}'s engine is laid out otherwise (now {engine_rel(group.name)}, profile {index})"]
    why = []
    for index, g in enumerate(group.graphs):  # the engine's sha256 once: its records share the file
        why += stale_reasons(root, records[g.name], digest, verify_engine=index == 0, **identity)
    return why


def build_engine(trt, builder, logger, manifest, graphs, workspace_gb: float | None, timing: TimingCache):
    """Serialized engine bytes and its profiles (one per graph, in order), for one graph or the
    graphs of an EngineGroup (the same ONNX file, written for several static T)."""
    graphs = (graphs,) if isinstance(graphs, GraphRecord) else tuple(graphs)
    onnx_path = manifest.graph_path(graphs[0])
    network, _parser = _parse(trt, builder, logger, onnx_path)
    inputs = {}
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        inputs[tensor.name] = tuple(tensor.shape)
    profiles = [graph_profile(manifest, g, inputs) for g in graphs]
    config = builder.create_builder_config()
    if workspace_gb:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gb * (1 << 30)))
    if manifest.dtype == "float32" and hasattr(trt.BuilderFlag, "TF32"):
        config.clear_flag(trt.BuilderFlag.TF32)
    for index, profile in enumerate(profiles):
        opt = builder.create_optimization_profile()
        for name, r in profile.items():
            opt.set_shape(name, r.min, r.opt, r.max)
        if config.add_optimization_profile(opt) != index:
            raise SpecDeployError(f"TensorRT refused the T={graphs[index].tokens} profile of {onnx_path.name}")
    timing.attach(config)
    logger.errors.clear()
    blob = builder.build_serialized_network(network, config)
    if blob is None:
        detail = logger.errors[-1] if logger.errors else "no error message"
        raise SpecDeployError(f"TensorRT could not build an engine for {', '.join(g.name for g in graphs)}: {detail}")
    timing.save(config)
    return bytes(memoryview(blob)), profiles


def build_engines(export_dir: str | Path, rebuild: bool = False, workspace_gb: float | None = None,
                  timing_cache: str | Path | None = None, progress=print,
                  allow_build: bool = True) -> list[BuildResult]:
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
    replaced: set[str] = set()
    for group in engine_groups(manifest, digest):
        names = [g.name for g in group.graphs]
        label = f"{group.name} (T={', '.join(str(g.tokens) for g in group.graphs)})" if len(names) > 1 else group.name
        # The engine's sha256 too (the trt backend checks it): a corrupted plan is rebuilt, not kept.
        why = ["--rebuild"] if rebuild else group_staleness(root, group, data["engines"], digest, identity)
        if not why:
            results += [BuildResult(name, "kept", "fresh") for name in names]
            progress(f"  {label}: fresh, kept")
            continue
        if not allow_build:
            raise SpecDeployError(f"the TensorRT engine for {label} is not usable: {'; '.join(why)} "
                                  f"(run `specdeploy engines {root}` without --no-rebuild)")
        progress(f"  {label}: building ({why[0]})")
        start = time.perf_counter()
        try:
            blob, profiles = build_engine(trt, builder, logger, manifest, group.graphs, workspace_gb, timing)
        except NoProfile as exc:  # only non-decoder graphs: they run on ORT's CUDA provider instead
            results += [BuildResult(name, "skipped", str(exc)) for name in names]
            progress(f"  {label}: skipped, {exc} (it runs on ONNX Runtime under --backend trt)")
            continue
        engine_file = engine_rel(group.name)
        atomic_write(root / engine_file, blob)
        seconds = time.perf_counter() - start
        sha = hashlib.sha256(blob).hexdigest()
        for index, (g, profile) in enumerate(zip(group.graphs, profiles)):
            old = data["engines"].get(g.name)
            if old is not None and old.get("file") != engine_file:
                replaced.add(old["file"])
            record = make_record(root, g, graph_sources(manifest, g.name), digest, len(blob), sha, manifest.dtype,
                                 profile_json(profile), identity, seconds, workspace_gb)
            record.update(file=engine_file, profile_index=index)
            data["engines"][g.name] = record
            results.append(BuildResult(g.name, "built" if old is None else "rebuilt",
                                       f"{len(blob) / 2**20:.1f} MiB in {seconds:.1f}s"))
        save_engines(root, data)  # after each engine: an interrupted run keeps what it finished
        progress(f"  {label}: {results[-1].detail}")
    _remove_unused(root, data, replaced)
    return results


def _remove_unused(root: Path, data: dict, candidates: set[str]) -> None:
    """Delete engine files of an earlier layout that no record names any more."""
    used = {record.get("file") for record in data["engines"].values()}
    for rel in candidates - used:
        (root / rel).unlink(missing_ok=True)  # paths from engines.json, kept inside OUT when it loaded


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
