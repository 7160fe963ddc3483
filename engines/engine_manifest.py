"""OUT/engines.json, written: the builder's records (their format and the staleness rules
are runtime/backends/engine_records.py's, which the "trt" backend reads them with).

Pure logic (no tensorrt import).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from ..runtime.backends.engine_records import (
    ENGINE_DIR,
    ENGINES_JSON,
    engine_rel,
    file_digests,
    load_engines,
    stale_reasons,
)
from ..runtime.manifest import Manifest
from ..runtime.onnx_external import external_data_locations

PARTIAL = ".partial-"  # temp files of atomic_write: `.NAME.partial-XXXX`, removed by the next run


def atomic_write(path: Path, data: bytes) -> None:
    """Write via a temp file + fsync + rename so a crash never leaves a half-written engine or
    manifest under its real name (a kill -9 leaves at most a temp file: remove_partial_writes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}{PARTIAL}")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def remove_partial_writes(root: Path) -> list[Path]:
    """Temp files an interrupted `specdeploy engines` left in the export (the caller holds the lock)."""
    gone = []
    for folder in (Path(root), Path(root) / ENGINE_DIR):
        if folder.is_dir():
            for path in folder.glob(f".*{PARTIAL}*"):
                if path.is_file() and not path.is_symlink():
                    path.unlink()
                    gone.append(path)
    return gone


def save_engines(root: str | Path, data: dict) -> None:
    atomic_write(Path(root) / ENGINES_JSON, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())


def graph_sources(manifest: Manifest, graph: str) -> list[str]:
    """Files (relative to the export dir) an engine of `graph` is built from: its ONNX and weights."""
    g = manifest.graphs[graph]
    parent = Path(g.file).parent
    return [g.file] + [(parent / r).as_posix() for r in external_data_locations(manifest.graph_path(g))]


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
