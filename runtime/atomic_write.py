"""Files replaced whole or not at all: a reader (or the next run) never finds half of one."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def replace_text(path: str | Path, text: str) -> None:
    """Write `text` to a temp file beside `path`, then rename it over `path`. A failed write (a full disk, a
    file-size limit) leaves the old file as it was and no temp file behind; its OSError is the caller's."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
