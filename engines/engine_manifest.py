"""OUT/engines.json, written: the builder's records (their format and the staleness rules
are runtime/backends/engine_records.py's, which the "trt" backend reads them with).

Pure logic (no tensorrt import).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from ..runtime.backends.engine_records import ENGINES_JSON, engine_rel, file_digests, load_engines, stale_reasons
from ..runtime.manifest import Manifest


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
