"""OUT/engines.json as the "trt" backend reads it: which engine was built from what, and
whether it may still be used. engines/engine_manifest.py writes the records.

One record per graph:

    {"file": "engines/target_t1.engine", "bytes": N, "sha256": "...",
     "sources": {"target_t1.onnx": "<sha256>", "weights/target.bin": "<sha256>"},
     "dtype": "float16", "tokens": 1, "profile": {"past_key.0": {"min": [...], "opt": [...], "max": [...]}, ...},
     "tensorrt": "10.13.0", "gpu": "NVIDIA H200", "compute_capability": "9.0",
     "built_in_s": 41.2, "workspace_gb": null}

An engine is stale when its file is gone or changed, when the ONNX graph or any
weights file it was built from changed, or when this machine's TensorRT version
or GPU differs from the one it was built with (serialized engines are not
portable across either). Every path a record names stays inside the export
(runtime/containment.py), and the "trt" backend checks an engine's sha256 on the
bytes it deserializes (`check_engine_bytes`): a plan is code TensorRT runs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

from ..containment import inside
from ..errors import SpecDeployError
from ..graph_contract import DECODER
from ..manifest import Manifest, parse_json, sha256_file
from ..manifest_fields import SHA256

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
        data = parse_json(path.read_text())
    except ValueError as exc:
        raise SpecDeployError(
            f"{path} is not valid JSON ({exc}); delete it and run `specdeploy engines` again") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("engines"), dict):
        raise SpecDeployError(f"{path} is not an engine manifest of format {FORMAT}; "
                              "delete it and run `specdeploy engines` again")
    for name, record in data["engines"].items():
        _check_record(Path(root), path, name, record)
    return data


def _check_record(root: Path, path: Path, name: str, record) -> None:
    """A record's paths inside the export and its digests well-formed (a hostile engines.json
    must not point TensorRT at a plan outside the export, nor hash files elsewhere)."""
    where = f"{path}: engines.{name}"
    if not isinstance(record, dict):
        raise SpecDeployError(f"{where} must be a JSON object")
    inside(root, record.get("file"), f"{where}.file")
    sources = record.get("sources", {})
    if not isinstance(sources, dict):
        raise SpecDeployError(f"{where}.sources must be a JSON object")
    for rel, digest in sources.items():
        inside(root, rel, f"{where}.sources")
        if not isinstance(digest, str) or not SHA256.match(digest):
            raise SpecDeployError(f"{where}.sources[{rel!r}] must be a sha256 hex digest, got {digest!r}")
    size = record.get("bytes")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise SpecDeployError(f"{where}.bytes must be a non-negative integer, got {size!r}")


def check_engine_bytes(record: dict, blob: bytes, path: Path) -> None:
    """Refuse an engine whose bytes are not the ones `specdeploy engines` recorded (the size
    check in stale_reasons misses same-size corruption or a swapped plan)."""
    if hashlib.sha256(blob).hexdigest() != record.get("sha256"):
        raise SpecDeployError(f"the TensorRT engine {path} does not match its sha256 in engines.json (corrupted or "
                              f"replaced since it was built); rebuild it with `specdeploy engines {path.parent.parent} "
                              "--rebuild`")


def engines_listed(manifest: Manifest) -> bool:
    """Whether `specdeploy engines` recorded an engine for every decoder graph (cheap: no hashing)."""
    try:
        records = load_engines(manifest.root)["engines"]
    except SpecDeployError:
        return False
    return all(name in records for name, g in manifest.trt_graphs().items() if g.kind == DECODER)


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
