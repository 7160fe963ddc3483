"""Static trees by name (configs/trees/NAME.json), by file, or inline, as lists of paths.

A tree file is either a JSON list of paths of top-k ranks (Medusa's `medusa_choices`
format) or an object with a "paths" key (plus free-form "about"/"source").
Validation of the paths themselves is runtime/tree.Tree.from_paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .config import CONFIG_DIR
from .errors import SpecDeployError
from .tree import Tree

TREE_DIR = CONFIG_DIR / "trees"


def tree_names() -> list[str]:
    return sorted(p.stem for p in TREE_DIR.glob("*.json")) if TREE_DIR.is_dir() else []


def read_tree_file(path: Path) -> list:
    from .manifest import parse_json

    try:
        data = parse_json(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecDeployError(f"could not read tree file {path}: {exc}") from None
    except ValueError as exc:
        raise SpecDeployError(f"tree file {path} is not valid JSON: {exc}") from None
    paths = data.get("paths") if isinstance(data, dict) else data
    if not isinstance(paths, list):
        raise SpecDeployError(f"tree file {path}: expected a list of paths or an object with a 'paths' list")
    return paths


def resolve_tree(spec, what: str = "tree") -> tuple[str, list]:
    """(label, paths) for a tree given as a name, a .json file path, or an inline list of paths."""
    if isinstance(spec, list):
        return "inline", spec
    if not isinstance(spec, str) or not spec:
        raise SpecDeployError(f"config: {what} must be a tree name, a .json file or a list of paths, got {spec!r}")
    named = TREE_DIR / f"{spec}.json"
    if "/" not in spec and not spec.endswith(".json") and named.is_file():
        return spec, read_tree_file(named)
    path = Path(spec).expanduser()
    if path.is_file():
        return str(path), read_tree_file(path)
    raise SpecDeployError(f"config: {what} {spec!r} is neither a tree file nor a known name "
                          f"(known: {', '.join(tree_names()) or 'none'})")


@dataclass(frozen=True)
class TreePaths:
    """A config's tree resolved to its paths; the manifest keeps it, so the runtime needs no tree files."""

    name: str  # the tree's name or file as configured, or "inline"
    paths: tuple[tuple[int, ...], ...]

    def tree(self) -> Tree:
        return Tree.from_paths([list(p) for p in self.paths])

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)


def config_tree(spec, resolved, what: str) -> tuple[str, list | None]:
    """(label, paths) of a config's `tree`: its `resolved` copy (TreePaths or the manifest's
    {"name", "paths"}) when that names the same tree, else resolve_tree(spec). Not yet validated."""
    if isinstance(resolved, TreePaths):
        resolved = {"name": resolved.name, "paths": [list(p) for p in resolved.paths]}
    if isinstance(spec, str) and isinstance(resolved, dict) and resolved.get("name") == spec:
        return spec, resolved.get("paths")
    return resolve_tree(list(spec) if isinstance(spec, tuple) else spec, what)


def frozen_paths(paths: list) -> tuple[tuple[int, ...], ...]:
    """Validated paths as tuples (configs are frozen)."""
    return tuple(tuple(p) for p in paths)
