"""`specdeploy check`, TensorRT part: per graph, polygraphy TrtRunner vs OnnxrtRunner.

Both run the reference inputs saved at export (check/<graph>.inputs.json), plus
the same inputs with an empty past (P = 0, the bottom of the engine's profile,
which every request's first prefill chunk uses). The engine is the one
`specdeploy engines` built when it is fresh; otherwise one is built in memory
with the same builder settings, so the check never reads a stale engine.

Without TensorRT, a GPU or polygraphy it prints one line saying the comparison
was skipped and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..runtime.backends.trt_profiles import NoProfile
from ..runtime.errors import SpecDeployError
from ..runtime.graph_contract import is_past

CHECK_DIR = "check"  # where the exporter saved the reference feeds (export/reference.py)
# Per exported dtype: (atol, rtol) of TensorRT vs ONNX Runtime CPU. TF32 is off in
# float32 engines, so float32 agrees like two float32 kernels do; float16 engines
# accumulate differently from ORT's CPU kernels.
TOLERANCES = {"float32": (1e-3, 1e-3), "float16": (5e-2, 5e-2), "bfloat16": (1e-1, 1e-1)}


@dataclass
class TrtGraphCheck:
    graph: str
    passed: bool
    detail: str
    skipped: bool = False


def skip_reason() -> str | None:
    from .builder import skip_reason as engines_skip

    reason = engines_skip()
    if reason:
        return reason
    try:
        import polygraphy.backend.trt  # noqa: F401
    except Exception as exc:
        return f"polygraphy's TensorRT backend does not import ({str(exc).splitlines()[0][:200]})"
    return None


def _feeds(onnx_path: Path) -> list[dict] | None:
    from polygraphy.json import load_json

    path = onnx_path.parent / CHECK_DIR / f"{onnx_path.stem}.inputs.json"
    if not path.is_file():
        return None
    feeds = list(load_json(str(path)))
    empty = {k: (v[:, :0] if is_past(k) else v) for k, v in feeds[0].items()}
    if any(is_past(k) for k in empty):
        feeds.append(empty)
    return feeds


def _engine_bytes(manifest, graph) -> tuple[bytes, str, int]:
    """The fresh built engine if there is one (and the profile of `graph` in it), else a new
    in-memory build for this graph alone (profile 0)."""
    import tensorrt as trt

    from ..runtime.backends.engine_records import check_engine_bytes, file_digests, load_engines, stale_reasons
    from ..runtime.backends.trt import gpu_identity, trt_logger
    from .builder import TIMING_CACHE, TimingCache, build_engine

    record = load_engines(manifest.root)["engines"].get(graph.name)
    here = {"tensorrt": trt.__version__, **gpu_identity()}
    if record and not stale_reasons(manifest.root, record, file_digests(manifest.root), **here):
        path = manifest.root / record["file"]
        blob = path.read_bytes()
        check_engine_bytes(record, blob, path)
        return blob, "built engine", int(record.get("profile_index", 0))
    logger = trt_logger()
    blob, _ = build_engine(trt, trt.Builder(logger), logger, manifest, graph, None,
                           TimingCache(manifest.root / TIMING_CACHE))
    return blob, "engine built for this check", 0


def check_graph(manifest, graph) -> TrtGraphCheck:
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner
    from polygraphy.comparator import Comparator, CompareFunc
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.ERROR
    onnx_path = manifest.graph_path(graph)
    feeds = _feeds(onnx_path)
    if feeds is None:
        return TrtGraphCheck(graph.name, False, f"no saved reference inputs in {onnx_path.parent / CHECK_DIR}")
    atol, rtol = TOLERANCES.get(manifest.dtype, TOLERANCES["float32"])
    try:
        blob, origin, profile = _engine_bytes(manifest, graph)
        runners = [TrtRunner(EngineFromBytes(blob), name="tensorrt", optimization_profile=profile),
                   OnnxrtRunner(SessionFromOnnx(str(onnx_path), providers=["CPUExecutionProvider"]), name="onnxrt")]
        results = Comparator.run(runners, data_loader=feeds)
        verdict = Comparator.compare_accuracy(results, compare_func=CompareFunc.simple(atol=atol, rtol=rtol))
    except NoProfile as exc:
        return TrtGraphCheck(graph.name, True, f"skipped: {exc}", skipped=True)
    except SpecDeployError as exc:
        return TrtGraphCheck(graph.name, False, str(exc))
    except Exception as exc:
        first_line = str(exc).splitlines()[0][:300] if str(exc) else ""
        return TrtGraphCheck(graph.name, False, f"could not run: {type(exc).__name__}: {first_line}")
    passed = bool(verdict)
    return TrtGraphCheck(graph.name, passed, f"tensorrt ({origin}) vs onnxrt, {len(feeds)} feeds incl. empty past, "
                                             f"atol={atol} rtol={rtol}: {'PASS' if passed else 'FAIL'}")


def _manifest_for(path: Path):
    from ..runtime.manifest import load_manifest

    if path.is_dir():
        return load_manifest(path, verify_checksums=False), None
    if path.suffix == ".onnx" and (path.parent / "manifest.json").is_file():
        manifest = load_manifest(path.parent, verify_checksums=False)
        names = [g.name for g in manifest.graphs.values() if manifest.graph_path(g).resolve() == path.resolve()]
        if names:
            return manifest, names
    return None, None


def check_path(path: str | Path) -> list[TrtGraphCheck]:
    manifest, only = _manifest_for(Path(path))
    if manifest is None:
        raise SpecDeployError(f"no export manifest beside {path}: the TensorRT profile comes from it")
    return [check_graph(manifest, g) for g in manifest.trt_graphs().values() if only is None or g.name in only]


def cli_report(path: str | Path) -> int:
    """Print one line per graph (or one skip line); return the number of graphs that failed."""
    reason = skip_reason()
    if reason:
        print(f"trt-check: TensorRT vs ONNX Runtime comparison skipped, {reason}")
        return 0
    manifest, _ = _manifest_for(Path(path))
    if manifest is None:
        print(f"trt-check: skipped, no export manifest beside {path} to derive the engine profile from")
        return 0
    results = check_path(path)
    for r in results:
        print(f"{'skip' if r.skipped else 'ok  ' if r.passed else 'FAIL'} trt-check {r.graph}: {r.detail}")
    return sum(not r.passed for r in results)
