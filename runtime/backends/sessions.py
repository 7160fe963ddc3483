"""One ONNX Runtime session per distinct graph in the process, shared by all that run it.

A session holds its graph's weights, prepacked for its kernels (ORT's CPU MatMul packs
every weight matrix into a private copy at load: measured 516 MiB per SmolLM2-135M
graph). Opening a graph once per static T, or once per pool instance, multiplies that.
So sessions are looked up here by what they run:

* the graph's bytes (sha256) and the identity of each external-data file it names
  (device, inode, size, mtime), so a re-exported directory never reuses a stale session;
  a fused graph is byte-identical for every static T (export/fused_graph.py), so all
  the T of a model share one session;
* how it runs: backend, provider options, thread count and the process's thread-pool mode.

Sharing a session between callers is safe: `run` and `run_with_iobinding` may be called
concurrently with separate IO bindings (each caller keeps its own, with its own KV
buffers). Sessions are held weakly: one lives while a decoder or graph uses it.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from pathlib import Path

from ..errors import SpecDeployError
from ..onnx_external import external_data_locations

_lock = threading.Lock()
_open_locks: dict[tuple, threading.Lock] = {}
_sessions: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_paths: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # session -> the first path it was opened from
_opened = 0  # sessions created by this process (the tests count them)


def graph_identity(path: Path) -> tuple:
    """What a session of `path` computes: its bytes and the external-data files they name."""
    path = Path(path)
    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        files = []
        for location in sorted(set(external_data_locations(path))):
            st = (path.parent / location).stat()
            files.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    except OSError as exc:
        raise SpecDeployError(f"could not read graph {path}: {exc.strerror or exc}") from None
    return digest, tuple(files)


def shared_session(path: Path, how: tuple, open_session):
    """The live session for `path` run `how` (a hashable description of the options), or a new
    one from `open_session()`, which is then shared with every later caller."""
    global _opened
    key = (graph_identity(path), how)
    with _lock:
        session = _sessions.get(key)
        if session is not None:
            return session
        opening = _open_locks.setdefault(key, threading.Lock())
    with opening:  # one opener per graph; callers of other graphs are not held up
        session = _sessions.get(key)
        if session is None:
            try:
                session = open_session()
            finally:
                with _lock:
                    _open_locks.pop(key, None)
            with _lock:
                _sessions[key] = session
                _paths[session] = Path(path)
                _opened += 1
    return session


def live_sessions() -> list[Path]:
    """The graph file each live shared session was first opened from (for tests and diagnostics)."""
    with _lock:
        return [_paths[s] for s in list(_sessions.values()) if s in _paths]


def sessions_opened() -> int:
    return _opened
