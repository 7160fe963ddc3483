"""Typed configs and the YAML files that override them.

Every default lives in a frozen dataclass: `ExportConfig` here, one `*Config` per method
beside its drafter (runtime/drafters/). A config is validated once, in its
`__post_init__`, when a YAML file, a manifest, the CLI or a request's overrides become a
config object; afterwards the typed object is passed around.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path

import yaml

from .errors import SpecDeployError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "default.yaml"  # shipped overrides, overlaid by the user's --config file


MAX_CONFIG_BYTES = 1 << 20  # a config is a few hundred bytes; a weights file given by mistake is not read whole


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise SpecDeployError(f"config file not found: {path}")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise SpecDeployError(f"config {path} is {path.stat().st_size:,} bytes, not a config file "
                              f"(at most {MAX_CONFIG_BYTES:,})")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:  # a binary file given by mistake (a .safetensors)
        raise SpecDeployError(f"config {path} is not a YAML text file (not UTF-8)") from None
    except yaml.YAMLError as exc:  # PyYAML's own message spans lines and quotes the source: one line instead
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = str(getattr(exc, "problem", None) or exc).splitlines()[0]  # a ReaderError (NUL bytes) has none
        raise SpecDeployError(f"config {path} is not valid YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise SpecDeployError(f"config {path} must be a mapping at the top level")
    return data


def positive_int(value, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecDeployError(f"config: {name} must be an integer >= {minimum}, got {value!r}")
    return value


def from_dict(cls, data: dict | None, section: str):
    """`cls(**data)`, unknown keys rejected (the dataclass validates the values)."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise SpecDeployError(f"config: {section} must be a mapping, got {data!r}")
    unknown = sorted(set(data) - {f.name for f in fields(cls)})
    if unknown:
        shown = [f.name for f in fields(cls) if not f.metadata.get("derived")]
        raise SpecDeployError(f"config: unknown {section} keys {unknown} (known: {', '.join(shown) or 'none'})")
    return cls(**data)


def to_dict(config) -> dict:
    """The JSON form (the manifest's): tuples become lists."""
    return _lists(asdict(config))


def _lists(value):
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_lists(v) for v in value]
    return value


def with_overrides(config, overrides: dict, section: str):
    """A new config: `config`'s settings with `overrides` applied, validated again."""
    return from_dict(type(config), {**to_dict(config), **overrides}, section)


def describe(config) -> str:
    """`key=value, ...` of the settings as written (fields marked `derived` left out), for messages."""
    shown = []
    for f in fields(config):
        if f.metadata.get("derived"):
            continue
        value = getattr(config, f.name)
        shown.append(f"{f.name}={f'<{len(value)} inline entries>' if isinstance(value, tuple) else value}")
    return ", ".join(shown)


@dataclass(frozen=True)
class ExportConfig:
    """Export-time settings; each method's verify graph size comes from its own config."""

    max_context: int = 512  # past + new tokens; bounds the dynamic past length
    prefill_chunk: int = 64  # prompt tokens per prefill call (a 250-token prompt: 45 ms vs 65 ms at 16,
    #                          default family, 2 cores: fewer calls, fewer weight reads); the exported
    #                          graph size: ORT's fused CPU graph takes longer calls (backends/ort_decoder.py)

    def __post_init__(self):
        positive_int(self.max_context, "max_context", 2)
        positive_int(self.prefill_chunk, "prefill_chunk")
        # Any chunk below the context works: max_context need not be a multiple of it, since the
        # prefill's last call takes a smaller graph where the chunk's would pad past the end.
        if self.prefill_chunk >= self.max_context:
            raise SpecDeployError(f"config: prefill_chunk {self.prefill_chunk} must be below max_context "
                                  f"{self.max_context}")


def load_export_config(path: str | Path | None = None) -> tuple[ExportConfig, dict[str, dict]]:
    """The export settings and each method's overrides: configs/default.yaml, then the
    user's file on top (method by method, key by key). Method names and keys are checked
    where the overrides become method configs (runtime/methods.py)."""
    export: dict = {}
    methods: dict[str, dict] = {}
    for source in (DEFAULT_CONFIG, path):
        if source is None:
            continue
        data = load_yaml(source)
        unknown = set(data) - {"max_context", "prefill_chunk", "methods"}
        if unknown:
            raise SpecDeployError(f"config {source}: unknown keys {sorted(unknown)}")
        export.update({k: data[k] for k in ("max_context", "prefill_chunk") if k in data})
        for method, params in (data.get("methods") or {}).items():
            if not isinstance(params, dict):
                raise SpecDeployError(f"config {source}: methods.{method} must be a mapping")
            methods[method] = {**methods.get(method, {}), **params}
    context = export.get("max_context")
    if "prefill_chunk" not in export and isinstance(context, int) and not isinstance(context, bool) \
            and 2 <= context <= ExportConfig.prefill_chunk:
        # the chunk is a default: a context set at or below it (a model's sliding window of 64, as the
        # export's own advice asks) takes a chunk that fits, as a context read from the model does
        export["prefill_chunk"] = context // 2
    return from_dict(ExportConfig, export, "export"), methods
