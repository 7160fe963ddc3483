"""How every trainer's command line reports: progress lines as they come, then the result's summary
as one JSON line (exit 0), or `error: <message>` for a SpecDeployError (exit 2), no traceback."""

from __future__ import annotations

import json
import sys
from typing import Callable

from ..runtime.errors import SpecDeployError


def say(message: str) -> None:
    print(message, flush=True)


def finish(run: Callable[[], dict], *keys: str) -> int:
    """Run `run()`; print its result's `keys` (one key: its value; keys it lacks are left out) as JSON.
    Returns the exit code."""
    try:
        meta = run()
    except SpecDeployError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(meta[keys[0]] if len(keys) == 1 else {k: meta[k] for k in keys if k in meta}))
    return 0
