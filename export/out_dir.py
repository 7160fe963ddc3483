"""Where `specdeploy export` writes: a staging directory beside --out, swapped in whole.

Nothing under --out changes until the new export is complete and checked, so a failure,
a Ctrl-C or a kill -9 at any point leaves the previous export as it was and loadable.
Beside OUT, in the same parent (renames there are atomic on one filesystem):

    .OUT.staging/  the export being written (no manifest until the end, `check: pending`
                   while it is checked: the loader refuses it either way); the next run removes it
    .OUT.old/      the previous export during the swap; the next run restores it if OUT is gone
    .OUT.lock      held (flock) by `export` and `engines`: one writer per export directory
                   (`build_lock`: the same lock, waited for, around builds of other directories)

Torch-free: engines/builder.py takes the same lock.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from ..runtime.containment import is_within
from ..runtime.errors import SpecDeployError
from ..runtime.manifest import MANIFEST_NAME

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; one writer at a time is then the user's job
    fcntl = None


def beside(out: Path, what: str) -> Path:
    return out.parent / f".{out.name}.{what}"


def checked_out_dir(out: Path, inputs: dict[str, Path | None]) -> Path:
    """The real --out path, or a SpecDeployError before anything is loaded or written: an export
    replaces its --out whole, so --out must not hold, be, or lie inside an input (`inputs`: what
    names it, e.g. "--target", -> its path), and an existing non-empty --out must be an export (it
    has a manifest)."""
    real = Path(os.path.realpath(out))
    if real.parent == real:
        raise SpecDeployError(f"--out {out} is a filesystem root; choose a directory for the export")
    for flag, path in inputs.items():
        if path is None:
            continue
        source = os.path.realpath(path)
        if is_within(source, real):
            relation = "is" if os.path.normpath(source) == str(real) else "contains"
            raise SpecDeployError(f"--out {out} {relation} the {flag} input {path}: an export replaces its --out "
                                  "directory whole; choose another --out")
        if is_within(real, source):
            raise SpecDeployError(f"--out {out} is inside the {flag} input {path}; choose a directory outside it")
    if real.exists():
        if not real.is_dir():
            raise SpecDeployError(f"--out {out} exists and is not a directory")
        if not (real / MANIFEST_NAME).is_file() and any(real.iterdir()):
            raise SpecDeployError(f"--out {out} exists and is not an export directory (no {MANIFEST_NAME}); "
                                  "refusing to replace it: choose a new or empty directory")
    return real


@contextmanager
def export_lock(out: Path, required: bool = True):
    """Hold .OUT.lock while writing `out`; another holder is one clear error, not a wait.
    `required=False` (engines) goes on unlocked where the parent is read-only: no export can
    swap a directory there either."""
    path = beside(Path(os.path.realpath(out)), "lock")
    try:
        if required:
            path.parent.mkdir(parents=True, exist_ok=True)  # --out's parent may not exist yet
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        if required:
            raise SpecDeployError(f"cannot create {path}: {exc.strerror or exc}") from None
        yield
        return
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise SpecDeployError(f"another `specdeploy export` or `specdeploy engines` is writing {out} "
                                      f"(it holds {path}); wait for it to finish") from None
        yield
    finally:
        os.close(fd)  # releases the lock; the empty lock file stays (removing it would race)


@contextmanager
def build_lock(out: Path):
    """Hold .OUT.lock, waiting while another process holds it: builds that reuse a finished `out`
    (the test family, its trained heads, a converted model; parallel test sessions share build/)
    wait for the one under way instead of failing."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(beside(out, "lock"), "w") as handle:
        if fcntl is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


def _sync_dir(path: Path) -> None:
    """Make a rename in `path` durable (a crash after publish keeps the new export)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# Marks .OUT.staging and .OUT.old as this tool's: an interrupted run's leftovers are removed, a
# directory of the same name that holds neither an export nor this file is the user's and stays.
OWNED = ".specdeploy-scratch"


class Staging:
    """`with Staging(out, progress) as stage:` write into `stage.path`, then `stage.publish()`.
    Leaving the block without publishing (any error) removes the staging directory."""

    def __init__(self, out: Path, progress=print):
        self.out, self.progress = Path(out), progress
        self.path = beside(self.out, "staging")
        self.old = beside(self.out, "old")
        self.published = False
        self._lock = export_lock(self.out)

    def __enter__(self) -> Staging:
        self._lock.__enter__()
        try:
            self._recover()
            self.path.mkdir(parents=True)
            (self.path / OWNED).touch()
        except BaseException:
            self._lock.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            if not self.published:
                shutil.rmtree(self.path, ignore_errors=True)
        finally:
            self._lock.__exit__(*exc)

    def _recover(self) -> None:
        """Undo what an interrupted run left (we hold the lock, so nothing else is writing); a
        directory of those names that is not ours is refused, never removed."""
        for leftover in (self.old, self.path):
            if leftover.exists() and not (leftover.is_dir() and any(
                    (leftover / name).is_file() for name in (MANIFEST_NAME, OWNED))):
                raise SpecDeployError(f"{leftover} is in the way of exporting to {self.out}, and it is not a "
                                      "directory an interrupted export left (no manifest): move it or remove it")
        if self.old.exists():
            if not self.out.exists() and (self.old / MANIFEST_NAME).is_file():
                os.rename(self.old, self.out)
                self.progress(f"restored the previous export to {self.out} (a run was interrupted while swapping)")
            else:
                shutil.rmtree(self.old)
        if self.path.exists():
            shutil.rmtree(self.path)
            self.progress(f"removed {self.path}, left by an interrupted export")

    def publish(self) -> None:
        """The swap: previous export aside, the new one in, the previous one removed."""
        (self.path / OWNED).unlink()
        if self.out.exists():
            os.rename(self.out, self.old)
            (self.old / OWNED).touch()  # its removal below may be cut short
        os.rename(self.path, self.out)
        self.published = True
        _sync_dir(self.out.parent)
        shutil.rmtree(self.old, ignore_errors=True)
