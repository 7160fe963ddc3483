"""Method and export configs: YAML in configs/, validated with clear errors."""

from __future__ import annotations

from pathlib import Path

import yaml

from .errors import SpecDeployError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "default.yaml"


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise SpecDeployError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise SpecDeployError(f"config {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise SpecDeployError(f"config {path} must be a mapping at the top level")
    return data


def positive_int(value, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecDeployError(f"config: {name} must be an integer >= {minimum}, got {value!r}")
    return value


def load_export_config(path: str | Path | None = None) -> dict:
    """The default config, overlaid by the user's file (method by method)."""
    base = load_yaml(DEFAULT_CONFIG)
    if path is not None:
        user = load_yaml(path)
        unknown = set(user) - {"max_context", "prefill_chunk", "methods"}
        if unknown:
            raise SpecDeployError(f"config {path}: unknown keys {sorted(unknown)}")
        for key in ("max_context", "prefill_chunk"):
            if key in user:
                base[key] = user[key]
        for method, params in (user.get("methods") or {}).items():
            if not isinstance(params, dict):
                raise SpecDeployError(f"config {path}: methods.{method} must be a mapping")
            base["methods"][method] = {**base["methods"].get(method, {}), **params}
    positive_int(base["max_context"], "max_context", 2)
    positive_int(base["prefill_chunk"], "prefill_chunk")
    return base
