"""Keep an export's file references inside its directory.

A manifest, engines.json or an ONNX graph names files by relative path; a hostile or
damaged export could name `../../etc/passwd`, an absolute path, or a symlink that leads
out. Every such reference goes through `inside` before anything opens it.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import SpecDeployError


def is_within(path: str | Path, root: str | Path) -> bool:
    """Whether `path` is `root` or below it (both taken as given: resolve them first)."""
    path, root = os.path.abspath(path), os.path.abspath(root)
    return path == root or os.path.commonpath([path, root]) == root


def inside(root: str | Path, rel, what: str) -> Path:
    """`root / rel`, refused unless it resolves (symlinks followed) inside `root`.

    `what` names the reference in the message ("graph target_t1", "manifest files entry"...).
    The returned path is the plain join, so messages keep naming the file as the export does.
    """
    if not isinstance(rel, str) or not rel or "\x00" in rel:
        raise SpecDeployError(f"{what}: {rel!r} is not a file name")
    if os.path.isabs(rel) or rel.startswith("\\") or (len(rel) > 1 and rel[1] == ":"):
        raise SpecDeployError(f"{what}: {rel!r} is an absolute path; an export names only files inside its directory")
    real_root = os.path.realpath(root)
    if not is_within(os.path.realpath(os.path.join(real_root, rel)), real_root):
        raise SpecDeployError(f"{what}: {rel!r} leads outside the export directory {root} (refused)")
    return Path(root) / rel
