"""The export manifest: everything the runtime needs to know, validated on load."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import SpecDeployError

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    architecture: str = ""
    model_type: str = ""
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class GraphSpec:
    name: str
    file: str
    model: str
    kind: str  # "decoder", "medusa_heads", "eagle_draft", ...
    tokens: int
    extra: dict = field(default_factory=dict)

    @property
    def flavor(self) -> str:
        return self.extra.get("flavor", "portable")


@dataclass
class Manifest:
    root: Path
    dtype: str
    max_context: int
    models: dict[str, ModelSpec]
    graphs: dict[str, GraphSpec]
    tokenizer: dict
    methods: dict
    files: dict[str, str]
    raw: dict

    def decoder_graphs(self, model: str, flavor: str = "portable") -> dict[int, GraphSpec]:
        """Decoder graphs of one model and flavor ("portable": standard ONNX ops, what TensorRT
        builds from; "fused": ORT CPU contrib ops, KV in place) keyed by their static token count."""
        return {g.tokens: g for g in self.graphs.values()
                if g.model == model and g.kind == "decoder" and g.flavor == flavor}

    def trt_graphs(self) -> dict[str, GraphSpec]:
        """The graphs TensorRT builds engines from: all but the fused (ORT-only) ones."""
        return {name: g for name, g in self.graphs.items() if g.flavor != "fused"}

    def graph_path(self, graph: GraphSpec) -> Path:
        return self.root / graph.file

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.tokenizer.get("eos_token_ids", []))


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
        models = {}
        for name, m in _require(raw, "models", "manifest").items():
            known = {k: m[k] for k in ("num_layers", "num_kv_heads", "head_dim", "hidden_size", "vocab_size")}
            rest = {k: v for k, v in m.items() if k not in known}
            models[name] = ModelSpec(
                name=name, architecture=m.get("architecture", ""), model_type=m.get("model_type", ""),
                extra=rest, **{k: int(v) for k, v in known.items()},
            )
        graphs = {}
        for name, g in _require(raw, "graphs", "manifest").items():
            rest = {k: v for k, v in g.items() if k not in ("file", "model", "kind", "tokens")}
            graphs[name] = GraphSpec(name=name, file=g["file"], model=g["model"], kind=g["kind"],
                                     tokens=int(g["tokens"]), extra=rest)
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
        root=root, dtype=raw.get("dtype", "float32"), max_context=int(_require(raw, "max_context", "manifest")),
        models=models, graphs=graphs, tokenizer=raw.get("tokenizer", {}), methods=raw.get("methods", {}),
        files=files, raw=raw,
    )
