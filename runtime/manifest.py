"""manifest.json: written by the exporter, read (and validated) by the runtime, one format.

Its model and graph entries are the graph contract's records (runtime/graph_contract.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from . import manifest_fields as fields
from .atomic_write import replace_text
from .containment import inside
from .errors import SpecDeployError
from .graph_contract import DECODER, FUSED_BATCHED, PORTABLE, TARGET, GraphRecord, ModelRecord
from .manifest_fields import CHECK_SKIPPED
from .onnx_external import external_data_locations, initializer_dims

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1
TOKENIZER_FILE = "tokenizer.json"  # the one tokenizer file the runtime needs (runtime/tokenizer.py)


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
    prefill_chunk: int = 64
    check: str = CHECK_SKIPPED  # the accuracy check: "passed" or "skipped" (--no-check)
    quantization: dict | None = None  # int4/int8 weights of some models' fused graphs (export/quantize.py)
    exact_rows_entry: dict | None = None  # a float target's padded attentions (export/exact_rows.py)

    def graphs_of(self, kind: str, model: str | None = None, flavor: str | None = None) -> list[GraphRecord]:
        return [g for g in self.graphs.values()
                if g.kind == kind and model in (None, g.model) and flavor in (None, g.flavor)]

    def decoder_graphs(self, model: str, flavor: str = PORTABLE) -> dict[int, GraphRecord]:
        """Decoder graphs of one model and flavor, keyed by their static token count."""
        return {g.tokens: g for g in self.graphs_of(DECODER, model, flavor)}

    def trt_graphs(self) -> dict[str, GraphRecord]:
        """The graphs TensorRT builds engines from: the portable ones (not the ORT-only fused ones)."""
        return {name: g for name, g in self.graphs.items() if g.flavor == PORTABLE}

    def batched_graph(self) -> GraphRecord | None:
        """The target's batched fused graph (continuous batching, runtime/batching), if exported."""
        return next(iter(self.graphs_of(DECODER, TARGET, FUSED_BATCHED)), None)

    def weight_scheme(self, model: str) -> dict | None:
        """The quantization scheme of `model`'s fused graphs (bits, block size, attention_pad ...;
        export/quantize.py), or None where they are float."""
        return (self.quantization or {}).get("models", {}).get(model)

    def graph_path(self, graph: GraphRecord) -> Path:
        return self.root / graph.file  # kept inside root when the manifest loaded

    def _padding(self, model: str) -> dict:
        """`model`'s attention padding: in its quantization scheme, or (a float target) in `exact_rows`."""
        return self.weight_scheme(model) or (self.exact_rows_entry or {}).get("models", {}).get(model) or {}

    def attention_pad(self, model: str) -> int:
        """Rows a call of `model`'s fused graphs writes past its own (export/attention_pad.py): 0 or 1."""
        return int(self._padding(model).get("attention_pad", 0))

    def unpadded_graph_path(self, model: str) -> Path | None:
        """`model`'s fused graph without attention padding rows, where the export wrote one (export/quantize.py,
        export/exact_rows.py)."""
        file = self._padding(model).get("unpadded_graph")
        return None if file is None else self.root / file  # kept inside root when the manifest loaded

    @property
    def exact_rows(self) -> bool:
        """Whether a tree may be followed along its leading chain only (runtime/verify.py, `exact_rows`):
        the target's rows are held bit-exact across call sizes, as a quantized target's must be
        (int8 activations turn a tree row's ulp-level difference into whole logits) and an
        `export --exact-rows` float target's are (export/exact_rows.py)."""
        return self.weight_scheme(TARGET) is not None or self.attention_pad(TARGET) > 0

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.tokenizer.get("eos_token_ids", []))


def _write_json(path: Path, data: dict) -> None:
    """Through a temp file and a rename: a reader sees the old manifest or the new one, never half of one."""
    replace_text(path, json.dumps(data, indent=2))


def write_manifest(out: Path, *, dtype: str, max_context: int, prefill_chunk: int, models: dict[str, ModelRecord],
                   graphs: dict[str, GraphRecord], tokenizer: dict, methods: dict, files: dict[str, str],
                   check: str = CHECK_SKIPPED, **facts) -> Path:
    """Write OUT/manifest.json; `check` records the accuracy check (passed, skipped, or pending
    while the exporter checks its staging copy); `facts` are informational entries (exported_in_s...)."""
    data = {
        "format": FORMAT_VERSION, "dtype": dtype, "max_context": max_context, "prefill_chunk": prefill_chunk,
        "models": {name: m.to_json() for name, m in models.items()},
        "graphs": {name: g.to_json() for name, g in graphs.items()},
        "tokenizer": tokenizer, "methods": methods, "files": files, "check": check, **facts,
    }
    path = Path(out) / MANIFEST_NAME
    _write_json(path, data)
    return path


def set_check(out: Path, state: str) -> None:
    """Record the accuracy check's outcome in an existing manifest (atomically)."""
    path = Path(out) / MANIFEST_NAME
    _write_json(path, {**json.loads(path.read_text()), "check": state})


def add_graph(out: Path, record: GraphRecord, files: list[str]) -> None:
    """Record one more graph in an existing manifest, with the checksums of its `files` (relative
    to `out`), atomically (a reader sees the manifest without it or with all of it)."""
    path = Path(out) / MANIFEST_NAME
    data = json.loads(path.read_text())
    data["graphs"][record.name] = record.to_json()
    data["files"].update((rel, sha256_file(Path(out) / rel)) for rel in files)
    _write_json(path, data)


def parse_json(text: str):
    """json.loads for a file the user gave (a manifest, a prompts or tree file): nesting deeper than the
    parser's recursion limit ('[' * 100000) is a ValueError like any other malformed JSON, not a
    RecursionError. Callers catch ValueError (JSONDecodeError and UnicodeDecodeError are ValueErrors too)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _read(export_dir: str | Path) -> tuple[Path, Path, dict]:
    # Every load of an export starts here (LoadedExport, Service.load, the CLI): None, a number or
    # bytes is refused by name rather than by pathlib's TypeError.
    if not isinstance(export_dir, (str, os.PathLike)) or not isinstance(os.fspath(export_dir), str):
        raise SpecDeployError(f"the export path must be a path (str or os.PathLike), got {type(export_dir).__name__}")
    root = Path(export_dir)
    if not root.exists():
        raise SpecDeployError(f"export directory not found: {root}")
    if root.is_file() and root.name != MANIFEST_NAME:
        raise SpecDeployError(f"{root} is a file, not an export directory (a directory with {MANIFEST_NAME})")
    path = root / MANIFEST_NAME if root.is_dir() else root
    if path.is_file() and root.is_file():
        root = path.parent
    if not path.is_file():
        raise SpecDeployError(f"no {MANIFEST_NAME} in {root} (run `specdeploy export` first)")
    try:
        raw = parse_json(path.read_text())
    except ValueError as exc:
        raise SpecDeployError(f"manifest {path} is not valid JSON: {exc}") from None
    except OSError as exc:
        raise SpecDeployError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not isinstance(raw, dict):
        raise SpecDeployError(f"manifest {path} must be a JSON object")
    return root, path, raw


def _check_graph_files(root: Path, graphs: dict[str, GraphRecord]) -> None:
    """Each graph's file kept inside root and present."""
    for g in graphs.values():
        path = inside(root, g.file, f"manifest: graphs.{g.name}.file")
        if not path.is_file():
            raise SpecDeployError(f"graph file missing: {path} (re-export it)")


def _check_rope_positions(root: Path, graphs: dict[str, GraphRecord], max_context: int) -> None:
    """The manifest's max_context within every fused graph's RoPE tables (their `rope.cos` rows: the
    positions it was exported for). The manifest is not checksummed: a raised max_context would pass
    until a long request's attention failed inside ONNX Runtime."""
    seen: dict[str, list[int] | None] = {}
    for g in graphs.values():
        if g.file not in seen:
            seen[g.file] = initializer_dims(root / g.file, "rope.cos")
        dims = seen[g.file]
        if dims and dims[0] < max_context:
            fields.fail("max_context", f"({max_context}) exceeds the {dims[0]} positions graph {g.name} was "
                        "exported for (the manifest does not match its graphs: re-export it)")


def _referenced_files(root: Path, graphs: dict[str, GraphRecord], tokenizer_dir: str,
                      models: dict[str, ModelRecord], quantization: dict | None,
                      exact_rows: dict | None) -> dict[str, str]:
    """Every file the runtime opens, relative to root -> what refers to it; each kept inside root
    (a graph's external-data locations are read from its protobuf: runtime/onnx_external.py)."""
    refs = {}
    files = {g.file: f"graph {g.name}" for g in graphs.values()}
    padded = [(f"{section}.models.{model}", scheme) for section, entries in (("quantization", quantization),
                                                                              ("exact_rows", exact_rows))
              for model, scheme in (entries or {}).get("models", {}).items()]
    for section, scheme in padded:
        if "unpadded_graph" in scheme:
            where = f"{section}.unpadded_graph"
            path = inside(root, scheme["unpadded_graph"], f"manifest: {where}")
            if not path.is_file():
                raise SpecDeployError(f"graph file missing: {path} ({where}; re-export it)")
            files[scheme["unpadded_graph"]] = where
    for file, what in files.items():
        refs[os.path.normpath(file)] = what
        parent = Path(file).parent
        for location in external_data_locations(root / file):
            rel = (parent / location).as_posix()
            inside(root, rel, f"{file}: external data location")
            refs.setdefault(os.path.normpath(rel), f"{file}'s external data")
    refs[os.path.normpath(Path(tokenizer_dir) / TOKENIZER_FILE)] = "the tokenizer"
    for m in models.values():  # a draft vocabulary's id map (runtime/drafters/draft_model.py)
        if "draft_vocab_file" in m.extra:
            rel = m.extra["draft_vocab_file"]
            inside(root, rel, f"manifest: models.{m.name}.draft_vocab_file")
            refs[os.path.normpath(rel)] = f"models.{m.name}.draft_vocab_file"
    return refs


def load_manifest(export_dir: str | Path, verify_checksums: bool = True, allow_pending: bool = False) -> Manifest:
    """Read and validate OUT/manifest.json: every field's type and range (runtime/manifest_fields.py),
    every file reference inside OUT, every file the runtime opens listed in `files` and present,
    and (`verify_checksums`) every listed file's sha256. `allow_pending` admits the exporter's own
    staging copy while its accuracy check runs."""
    root, path, raw = _read(export_dir)
    scalars = fields.top_level(raw, path)
    check = fields.check_state(raw, allow_pending)
    max_context = scalars["max_context"]
    models = {key: fields.model(key, m, max_context) for key, m in raw["models"].items()}
    for key, g in raw["graphs"].items():
        fields.graph(key, g, models, max_context)
    try:
        graphs = {key: GraphRecord.from_json(key, g) for key, g in raw["graphs"].items()}
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecDeployError(f"manifest {path} is malformed: {exc}") from None
    target = models.get(TARGET)
    if target is None:
        fields.fail("models", "has no 'target' model")
    prefill_sizes = [g.tokens for g in graphs.values() if g.model == TARGET and g.kind == DECODER]
    if prefill_sizes and scalars["prefill_chunk"] > max(prefill_sizes):
        fields.fail("prefill_chunk", f"({scalars['prefill_chunk']}) exceeds the largest target graph "
                    f"({max(prefill_sizes)} tokens)")
    quantization = fields.quantization(raw["quantization"], models) if "quantization" in raw else None
    exact_rows = fields.exact_rows(raw["exact_rows"], models) if "exact_rows" in raw else None
    tokenizer = raw["tokenizer"]
    fields.tokenizer(tokenizer, target.vocab_size)
    tokenizer_dir = tokenizer.get("dir", "tokenizer")
    inside(root, tokenizer_dir, "manifest: tokenizer.dir")
    files = raw["files"]
    fields.files(files)
    for rel in files:
        inside(root, rel, "manifest: files entry")
    _check_graph_files(root, graphs)
    for rel, digest in files.items():  # before reading any graph: a damaged file is named as such
        fpath = root / rel
        if not fpath.is_file():
            raise SpecDeployError(f"export file missing: {fpath} (listed in the manifest; re-export it)")
        if verify_checksums and sha256_file(fpath) != digest:
            raise SpecDeployError(f"checksum mismatch for {fpath}: the file changed since export (re-export it)")
    listed = {os.path.normpath(rel) for rel in files}
    for rel, what in _referenced_files(root, graphs, tokenizer_dir, models, quantization, exact_rows).items():
        if rel not in listed:
            raise SpecDeployError(f"manifest: {rel} ({what}) is not in the files map, so its integrity cannot be "
                                  "checked (re-export it)")
    _check_rope_positions(root, graphs, max_context)
    return Manifest(
        root=root, dtype=scalars["dtype"], max_context=max_context, models=models, graphs=graphs,
        tokenizer=tokenizer, methods=raw.get("methods", {}), files=files, raw=raw,
        prefill_chunk=scalars["prefill_chunk"], check=check, quantization=quantization,
        exact_rows_entry=exact_rows,
    )
