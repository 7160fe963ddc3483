"""Offline TensorRT compatibility lint: would TensorRT's ONNX parser take these graphs?

Checks every node of every graph (subgraphs and model-local functions included)
against engines/trt_support.json, the onnx-tensorrt operator support matrix
for the TensorRT versions we support:

* op type: present and supported in the matrix for that version;
* domain: only the default ONNX domain (other domains would need plugins);
* data types: the op's data inputs (and Cast's target type) must be of a type
  the matrix lists for it; graph inputs/outputs must be types TensorRT has;
* attributes and inputs the matrix restricts (e.g. Slice axes must be an
  initializer in 10.0, TopK must be sorted, MaxPool's Indices output unused);
* the default-domain opset must be in the version's supported range.

Needs only the `onnx` package (no TensorRT, no GPU); weights are not loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..runtime.errors import SpecDeployError

SUPPORT_FILE = Path(__file__).with_name("trt_support.json")


@dataclass(frozen=True)
class Finding:
    graph: str
    node: str
    op_type: str
    domain: str
    reason: str
    versions: tuple[str, ...]

    def __str__(self) -> str:
        op = f"{self.domain}::{self.op_type}" if self.domain else self.op_type
        return f"node '{self.node}' ({op}): {self.reason} [TensorRT {', '.join(self.versions)}]"


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


class SupportMatrix:
    def __init__(self, data: dict):
        self.data = data
        self.ops: dict = data["ops"]
        self.targets: list[str] = list(data["default_targets"])
        self.domains = set(data["domains"]["supported"])
        self.type_names: dict[str, str] = data["data_types"]["names"]

    @classmethod
    @lru_cache(maxsize=None)
    def load(cls, path: Path = SUPPORT_FILE) -> SupportMatrix:
        try:
            return cls(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise SpecDeployError(f"cannot read the TensorRT support matrix {path}: {exc}") from None

    def opset_range(self, version: str) -> tuple[int, int]:
        lo, hi = self.data["tensorrt"][version]["opset"]
        return lo, hi

    def entry(self, op_type: str, version: str) -> dict | None:
        """The op's row as of `version`: the 10.0 row plus every later change up to `version`."""
        base = self.ops.get(op_type)
        if base is None:
            return None
        row = {k: v for k, v in base.items() if k != "versions"}
        for since, change in sorted(base.get("versions", {}).items(), key=lambda kv: _version_key(kv[0])):
            if _version_key(since) <= _version_key(version):
                row.update(change)
        return row


class _Scope:
    """What one graph (with its enclosing scopes) knows: value types and constant values."""

    def __init__(self, graph, parent: _Scope | None = None):
        import onnx

        self.types: dict[str, int] = dict(parent.types) if parent else {}
        self.consts: dict[str, object] = dict(parent.consts) if parent else {}
        for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                self.types[vi.name] = vi.type.tensor_type.elem_type
        for init in graph.initializer:
            self.types[init.name] = init.data_type
            self.consts[init.name] = init
        for node in graph.node:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.output:
                self.consts[node.output[0]] = node
                for a in node.attribute:
                    if a.name == "value":
                        self.types[node.output[0]] = a.t.data_type
                    elif a.name in ("value_float", "value_floats"):
                        self.types[node.output[0]] = onnx.TensorProto.FLOAT
                    elif a.name in ("value_int", "value_ints"):
                        self.types[node.output[0]] = onnx.TensorProto.INT64

    def const_value(self, name: str):
        """The constant's numpy value, or None when it is not a constant (or holds no data here)."""
        import onnx
        from onnx import numpy_helper

        src = self.consts.get(name)
        if src is None:
            return None
        try:
            if isinstance(src, onnx.TensorProto):
                return None if src.data_location == onnx.TensorProto.EXTERNAL else numpy_helper.to_array(src)
            for a in src.attribute:
                value = onnx.helper.get_attribute_value(a)
                return numpy_helper.to_array(value) if isinstance(value, onnx.TensorProto) else value
        except Exception:
            return None
        return None


def _attr(node, name: str, default=None):
    import onnx

    for a in node.attribute:
        if a.name == name:
            value = onnx.helper.get_attribute_value(a)
            return value.decode() if isinstance(value, bytes) else value
    return default


class _Linter:
    def __init__(self, matrix: SupportMatrix, graph_name: str, targets: list[str], functions: dict):
        self.m, self.graph_name, self.targets, self.functions = matrix, graph_name, targets, functions
        self.found: dict[tuple[str, str, str, str], list[str]] = {}  # (node, op, domain, reason) -> versions
        self.nodes = 0

    def add(self, node: str, op: str, domain: str, reason: str, version: str) -> None:
        versions = self.found.setdefault((node, op, domain, reason), [])
        if version not in versions:
            versions.append(version)

    def type_name(self, elem_type: int) -> str:
        import onnx

        known = elem_type in onnx.TensorProto.DataType.values()
        raw = onnx.TensorProto.DataType.Name(elem_type) if known else str(elem_type)
        return self.m.type_names.get(raw, raw)

    def lint_graph(self, graph, scope: _Scope, prefix: str = "") -> None:
        for node in graph.node:
            self.nodes += 1
            name = prefix + (node.name or f"{node.op_type}_{self.nodes}")
            fn = self.functions.get((node.domain, node.op_type))
            if fn is not None:  # a model-local function: the parser inlines its body
                self.lint_graph(fn, _Scope(_FunctionGraph(fn), scope), prefix=f"{name}/")
                continue
            for version in self.targets:
                self.lint_node(node, name, scope, version)
            for a in node.attribute:  # If/Loop/Scan bodies
                subgraphs = ([a.g] if a.HasField("g") else []) + list(a.graphs)
                for sub in subgraphs:
                    self.lint_graph(sub, _Scope(sub, scope), prefix=f"{name}/")

    def lint_node(self, node, name: str, scope: _Scope, version: str) -> None:
        op, domain = node.op_type, node.domain
        if domain not in self.m.domains:
            self.add(name, op, domain,
                     f"domain '{domain}' is not the default ONNX domain (TensorRT would need a plugin)", version)
            return
        row = self.m.entry(op, version)
        if row is None:
            self.add(name, op, domain, "op is not in the TensorRT operator matrix", version)
            return
        if not row.get("supported"):
            self.add(name, op, domain, "op is not supported by TensorRT's ONNX parser", version)
            return
        types = row.get("types", [])
        for i in row.get("typed_inputs", [0]):
            if i < len(node.input) and node.input[i] and node.input[i] in scope.types:
                t = self.type_name(scope.types[node.input[i]])
                if t not in types:
                    self.add(name, op, domain, f"input {i} ('{node.input[i]}') is {t}; TensorRT supports {op} "
                                                f"for {', '.join(types)}", version)
        for check in row.get("checks", []):
            reason = self.check(check, node, scope, types)
            if reason:
                self.add(name, op, domain, reason, version)

    def check(self, c: dict, node, scope: _Scope, types: list[str]) -> str | None:
        kind = c["kind"]
        if kind in ("const_input", "const_input_below"):
            i = c["input"]
            if i < len(node.input) and node.input[i]:
                if node.input[i] not in scope.consts:
                    return f"`{c['what']}` (input {i}) must be a constant initializer for TensorRT"
                if kind == "const_input_below":
                    value = scope.const_value(node.input[i])
                    if value is not None and int(value.max() if hasattr(value, "max") else value) >= c["below"]:
                        return f"`{c['what']}` must be below {c['below']}"
            return None
        if kind == "no_input":
            i = c["index"]
            return f"input `{c['what']}` is unsupported" if i < len(node.input) and node.input[i] else None
        if kind == "no_output":
            i = c["index"]
            return f"output `{c['what']}` is unsupported" if i < len(node.output) and node.output[i] else None
        if kind == "attr_absent":
            present = [a.name for a in node.attribute if a.name in c["attrs"]]
            return f"attribute `{present[0]}` is unsupported" if present else None
        if kind == "attr_eq":
            value = _attr(node, c["attr"], c.get("default"))
            if value == c["value"]:
                return None
            return f"attribute `{c['attr']}`={value!r} is unsupported (must be {c['value']!r})"
        if kind == "attr_in":
            value = _attr(node, c["attr"], c.get("default"))
            if value in c["allowed"]:
                return None
            return f"attribute `{c['attr']}`={value!r} is unsupported (allowed: {', '.join(c['allowed'])})"
        if kind == "attr_ones":
            value = _attr(node, c["attr"])
            return None if value is None or all(v == 1 for v in value) else f"attribute `{c['attr']}` must be all ones"
        if kind == "attr_type":
            value = _attr(node, c["attr"])
            t = self.type_name(value) if value is not None else None
            return None if t is None or t in types else f"casting to {t} is unsupported (supported: {', '.join(types)})"
        if kind == "input_type":
            i = c["input"]
            if i < len(node.input) and node.input[i] in scope.types:
                t = self.type_name(scope.types[node.input[i]])
                return None if t in c["types"] else f"`{c['what']}` must be {'/'.join(c['types'])}, not {t}"
            return None
        raise SpecDeployError(f"trt_support.json: unknown check kind {kind!r}")


class _FunctionGraph:
    """A FunctionProto seen as a graph (nodes only; its values have no declared types)."""

    def __init__(self, fn):
        self.node, self.input, self.output, self.value_info, self.initializer = fn.node, [], [], [], []


def lint_model(model, graph_name: str, matrix: SupportMatrix | None = None,
               targets: list[str] | None = None) -> tuple[list[Finding], int]:
    """Findings for one ModelProto (loaded without external data), and its node count."""
    import onnx

    matrix = matrix or SupportMatrix.load()
    targets = targets or matrix.targets
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # inference is a help for dtype checks, not a requirement
        inferred = model
    functions = {(f.domain, f.name): f for f in model.functions}
    linter = _Linter(matrix, graph_name, targets, functions)
    scope = _Scope(inferred.graph)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    for version in targets:
        lo, hi = matrix.opset_range(version)
        if opset is not None and not lo <= opset <= hi:
            linter.add("(model)", "opset", "", f"default-domain opset {opset} is outside {lo}..{hi}", version)
        for vi in list(model.graph.input) + list(model.graph.output):
            t = vi.type.tensor_type.elem_type if vi.type.HasField("tensor_type") else 0
            if t and linter.type_name(t) not in set(matrix.type_names.values()):
                linter.add(f"(graph io) {vi.name}", "io", "",
                           f"type {linter.type_name(t)} has no TensorRT equivalent", version)
    linter.lint_graph(inferred.graph, scope)
    findings = [Finding(graph_name, node, op, domain, reason, tuple(v))
                for (node, op, domain, reason), v in linter.found.items()]
    return findings, linter.nodes


def lint_file(path: str | Path, matrix: SupportMatrix | None = None, targets: list[str] | None = None):
    import onnx

    path = Path(path)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:
        raise SpecDeployError(f"cannot read {path}: {str(exc).splitlines()[0][:200]}") from None
    return lint_model(model, path.stem, matrix, targets)


def graph_files(path: str | Path) -> list[Path]:
    """An export directory's graphs (from its manifest) or a single .onnx file."""
    path = Path(path)
    if path.is_file() and path.suffix == ".onnx":
        return [path]
    if not path.is_dir():
        raise SpecDeployError(f"nothing to lint at {path} (expected an export directory or a .onnx file)")
    from ..runtime.manifest import load_manifest

    manifest = load_manifest(path, verify_checksums=False)
    return [manifest.graph_path(g) for g in manifest.trt_graphs().values()]


def cli_report(path: str | Path) -> int:
    """Print one result line per graph (plus one line per unsupported node); return the number of findings."""
    try:
        import onnx  # noqa: F401
    except ImportError:
        print("trt-lint: skipped, the onnx package is not installed")
        return 0
    matrix = SupportMatrix.load()
    versions = ", ".join(matrix.targets)
    total = 0
    for file in graph_files(path):
        findings, nodes = lint_file(file, matrix)
        total += len(findings)
        if not findings:
            print(f"ok   trt-lint {file.stem}: {nodes} nodes, all supported by TensorRT {versions}")
            continue
        print(f"FAIL trt-lint {file.stem}: {len(findings)} unsupported of {nodes} nodes")
        for f in findings:
            print(f"       {f}")
    return total
