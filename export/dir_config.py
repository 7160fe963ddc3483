"""A model or head directory's JSON config, read with one clear error for each way it can be
missing or broken (no directory, no file, not JSON, not an object)."""

from __future__ import annotations

from pathlib import Path

from ..runtime.errors import SpecDeployError
from ..runtime.manifest import parse_json


def read_dir_config(model_dir: Path, name: str, what: str, hint: str) -> dict:
    """`model_dir`/`name` as a dict; `what` names the directory ("EAGLE head"), `hint` follows
    the missing-file error (": not an EAGLE head directory")."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise SpecDeployError(f"{what} directory not found: {model_dir}")
    path = model_dir / name
    if not path.is_file():
        raise SpecDeployError(f"{model_dir} has no {name}{hint}")
    try:
        cfg = parse_json(path.read_text())
    except ValueError as exc:  # malformed, not UTF-8, or nested past the parser's recursion limit
        raise SpecDeployError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise SpecDeployError(f"{path} must be a JSON object")
    return cfg
