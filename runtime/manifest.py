"""manifest.json: written by the exporter, read (and validated) by the runtime, one format.

Its model and graph entries are the graph contract's records (runtime/graph_contract.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from .errors import SpecDeployError
from .graph_contract import DECODER, FUSED, PORTABLE, GraphRecord, ModelRecord

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class Manifest:
    root: Path
    dtype: str
    max_context: int
    models: dict[str, ModelRecord]
    graphs: dict[str, GraphRecord]
    tokenizer: dict
    methods: dict
    files: dict[str, str]
    raw: dict

    def graphs_of(self, kind: str, model: str | None = None, flavor: str | None = None) -> list[GraphRecord]:
        return [g for g in self.graphs.values()
                if g.kind == kind and model in (None, g.model) and flavor in (None, g.flavor)]

    def decoder_graphs(self, model: str, flavor: str = PORTABLE) -> dict[int, GraphRecord]:
        """Decoder graphs of one model and flavor, keyed by their static token count."""
        return {g.tokens: g for g in self.graphs_of(DECODER, model, flavor)}

    def trt_graphs(self) -> dict[str, GraphRecord]:
        """The graphs TensorRT builds engines from: all but the fused (ORT-only) ones."""
        return {name: g for name, g in self.graphs.items() if g.flavor != FUSED}

    def graph_path(self, graph: GraphRecord) -> Path:
        return self.root / graph.file

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.tokenizer.get("eos_token_ids", []))


def write_manifest(out: Path, *, dtype: str, max_context: int, prefill_chunk: int, models: dict[str, ModelRecord],
                   graphs: dict[str, GraphRecord], tokenizer: dict, methods: dict, files: dict[str, str],
                   **facts) -> Path:
    """Write OUT/manifest.json; `facts` are informational top-level entries (exported_in_s...)."""
    data = {
        "format": FORMAT_VERSION, "dtype": dtype, "max_context": max_context, "prefill_chunk": prefill_chunk,
        "models": {name: m.to_json() for name, m in models.items()},
        "graphs": {name: g.to_json() for name, g in graphs.items()},
        "tokenizer": tokenizer, "methods": methods, "files": files, **facts,
    }
    path = Path(out) / MANIFEST_NAME
    path.write_text(json.dumps(data, indent=2))
    return path


def _require(d: dict, key: str, where: str):
    if key not in d:
        raise SpecDeployError(f"manifest: missing '{key}' in {where}")
    return d[key]


def load_manifest(export_dir: str | Path, verify_checksums: bool = True) -> Manifest:
    root = Path(export_dir)
    if not root.exists():
        raise SpecDeployError(f"export directory not found: {root}")
    path = root / MANIFEST_NAME if root.is_dir() else root
    if path.is_file() and root.is_file():
        root = path.parent
    if not path.is_file():
        raise SpecDeployError(f"no {MANIFEST_NAME} in {root} (run `specdeploy export` first)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpecDeployError(f"manifest {path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise SpecDeployError(f"manifest {path} must be a JSON object")
    if raw.get("format") != FORMAT_VERSION:
        raise SpecDeployError(f"manifest {path}: unsupported format {raw.get('format')!r} (expected {FORMAT_VERSION})")
    try:
        models = {name: ModelRecord.from_json(name, m) for name, m in _require(raw, "models", "manifest").items()}
        graphs = {name: GraphRecord.from_json(name, g) for name, g in _require(raw, "graphs", "manifest").items()}
        max_context = int(_require(raw, "max_context", "manifest"))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise SpecDeployError(f"manifest {path} is malformed: {exc!r}") from None
    files = raw.get("files", {})
    for rel, digest in files.items():
        fpath = root / rel
        if not fpath.is_file():
            raise SpecDeployError(f"export file missing: {fpath} (listed in the manifest)")
        if verify_checksums and sha256_file(fpath) != digest:
            raise SpecDeployError(f"checksum mismatch for {fpath}: the file changed since export (re-export it)")
    for g in graphs.values():
        if g.model not in models:
            raise SpecDeployError(f"manifest: graph '{g.name}' refers to unknown model '{g.model}'")
        if not (root / g.file).is_file():
            raise SpecDeployError(f"graph file missing: {root / g.file}")
    return Manifest(
        root=root, dtype=raw.get("dtype", "float32"), max_context=max_context,
        models=models, graphs=graphs, tokenizer=raw.get("tokenizer", {}), methods=raw.get("methods", {}),
        files=files, raw=raw,
    )
