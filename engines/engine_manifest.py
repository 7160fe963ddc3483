"""OUT/engines.json: which engine was built from what, and whether it is still valid.

Pure logic (no tensorrt import): the builder writes records, the "trt" runtime
backend and the tests read them. One record per graph:

    {"file": "engines/target_t1.engine", "bytes": N, "sha256": "...",
     "sources": {"target_t1.onnx": "<sha256>", "weights/target.bin": "<sha256>"},
     "dtype": "float16", "tokens": 1, "profile": {"past_key.0": {"min": [...], "opt": [...], "max": [...]}, ...},
     "tensorrt": "10.13.0", "gpu": "NVIDIA H200", "compute_capability": "9.0",
     "built_in_s": 41.2, "workspace_gb": null}

An engine is stale when its file is gone or changed, when the ONNX graph or any
weights file it was built from changed, or when this machine's TensorRT version
or GPU differs from the one it was built with (serialized engines are not
portable across either).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..runtime.errors import SpecDeployError
from ..runtime.manifest import Manifest, sha256_file

ENGINES_JSON = "engines.json"
ENGINE_DIR = "engines"
FORMAT = 1


def engine_rel(graph: str) -> str:
    return f"{ENGINE_DIR}/{graph}.engine"


def load_engines(root: str | Path) -> dict:
    path = Path(root) / ENGINES_JSON
    if not path.is_file():
        return {"format": FORMAT, "engines": {}}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpecDeployError(f"{path} is not valid JSON ({exc}); delete it and run `specdeploy engines` again") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("engines"), dict):
        raise SpecDeployError(f"{path} is not an engine manifest of format {FORMAT}; "
                              "delete it and run `specdeploy engines` again")
    return data


def atomic_write(path: Path, data: bytes) -> None:
    """Write via a temp file + rename so a crash never leaves a half-written engine or manifest."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_engines(root: str | Path, data: dict) -> None:
    atomic_write(Path(root) / ENGINES_JSON, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())


def external_data_files(onnx_path: Path) -> list[str] | None:
    """Weights files an ONNX graph references (relative to its directory); None without the onnx package."""
    try:
        import onnx
    except ImportError:
        return None
    model = onnx.load(str(onnx_path), load_external_data=False)
    files = set()
    graphs = [model.graph]
    while graphs:  # subgraphs (If/Loop bodies) can hold initializers too
        g = graphs.pop()
        for init in g.initializer:
            if init.data_location == onnx.TensorProto.EXTERNAL:
                files.update(e.value for e in init.external_data if e.key == "location")
        for node in g.node:
            graphs.extend(a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH)
            for a in node.attribute:
                graphs.extend(a.graphs)
    return sorted(files)


def graph_sources(manifest: Manifest, graph: str) -> list[str]:
    """Files (relative to the export dir) an engine of `graph` is built from: its ONNX and weights."""
    g = manifest.graphs[graph]
    rels = external_data_files(manifest.graph_path(g))
    if rels is None:  # no onnx package: every weights file counts, which can only over-report staleness
        rels = [r for r in manifest.files if r.startswith("weights/")]
    parent = Path(g.file).parent
    return [g.file] + [(parent / r).as_posix() for r in rels]


def file_digests(root: Path) -> Callable[[str], str]:
    """sha256 of files under root, each hashed once per call site."""
    cache: dict[str, str] = {}

    def digest(rel: str) -> str:
        if rel not in cache:
            cache[rel] = sha256_file(root / rel)
        return cache[rel]

    return digest


def stale_reasons(root: str | Path, record: dict, digest: Callable[[str], str], tensorrt: str | None = None,
                  gpu: str | None = None, compute_capability: str | None = None,
                  verify_engine: bool = False) -> list[str]:
    """Why the engine `record` must not be used (empty: it is fresh).

    `digest(rel)` gives the current sha256 of a source file; the TensorRT version
    and GPU are compared only when given (they are unknown without TensorRT).
    """
    root = Path(root)
    why = []
    engine = root / record.get("file", "")
    if not record.get("file") or not engine.is_file():
        return [f"engine file {record.get('file')} is missing"]
    if engine.stat().st_size != record.get("bytes") or (verify_engine and sha256_file(engine) != record.get("sha256")):
        why.append(f"engine file {record['file']} changed since it was built")
    for rel, sha in sorted(record.get("sources", {}).items()):
        if not (root / rel).is_file():
            why.append(f"{rel} is missing")
        elif digest(rel) != sha:
            why.append(f"{rel} changed since the engine was built")
    if not record.get("sources"):
        why.append("the record lists no source files")
    if tensorrt is not None and record.get("tensorrt") != tensorrt:
        why.append(f"built with TensorRT {record.get('tensorrt')}, this is TensorRT {tensorrt}")
    if compute_capability is not None and record.get("compute_capability") != compute_capability:
        why.append(f"built for {record.get('gpu')} (compute {record.get('compute_capability')}), "
                   f"this GPU is {gpu} (compute {compute_capability})")
    elif gpu is not None and record.get("gpu") != gpu:
        why.append(f"built on {record.get('gpu')}, this GPU is {gpu}")
    return why


def engine_status(manifest: Manifest, **here) -> dict[str, list[str]]:
    """Per graph of the export: [] when its engine is fresh, else the reasons it is missing or stale."""
    records = load_engines(manifest.root)["engines"]
    digest = file_digests(manifest.root)
    status = {}
    for name in manifest.trt_graphs():
        rec = records.get(name)
        status[name] = ["no engine built"] if rec is None else stale_reasons(manifest.root, rec, digest, **here)
    return status


def make_record(root: Path, graph, sources: list[str], digest, engine_bytes: int, engine_sha: str, dtype: str,
                profile: dict, identity: dict, built_in_s: float, workspace_gb: float | None) -> dict:
    return {"file": engine_rel(graph.name), "bytes": engine_bytes, "sha256": engine_sha,
            "sources": {rel: digest(rel) for rel in sources}, "dtype": dtype, "tokens": graph.tokens,
            "kind": graph.kind, "profile": profile, **identity, "built_in_s": round(built_in_s, 2),
            "workspace_gb": workspace_gb}
