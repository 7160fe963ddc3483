"""ONNX Runtime sessions: providers, the process-wide thread pool, plain and in-place bound graphs.

Sessions are shared by every graph object that runs the same graph the same way
(backends/sessions.py): a graph object owns only its IO binding and arrays.
"""

from __future__ import annotations

import numbers
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import SpecDeployError
from ..graph_contract import LOGIT_ROWS, LOGITS, TOKENS_DIM, GraphRecord, decoder_mismatch, parse_kv_name, present_of
from .sessions import shared_session

ORT_PROVIDERS = {
    "ort-cpu": ["CPUExecutionProvider"],
    "ort-cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "ort-trt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
}


MAX_THREADS_PER_CPU = 8  # past it ONNX Runtime's spinning threads only slow each other; 99999 hung at pool creation


def check_threads(threads) -> int | None:
    """A thread count as given (None: ORT's default, the physical cores), or one clear error."""
    most = MAX_THREADS_PER_CPU * (os.cpu_count() or 1)
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, numbers.Integral)
                                or not 1 <= int(threads) <= most):
        raise SpecDeployError(f"threads must be an integer from 1 to {most} ({MAX_THREADS_PER_CPU} per logical CPU "
                              f"of this machine), got {threads!r}")
    return None if threads is None else int(threads)


def thread_count(text: str) -> int:
    """--threads of the CLI's commands and of serve: an argparse type (a bad value is argparse's one-line
    error, exit 2)."""
    import argparse

    try:
        count = check_threads(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    except SpecDeployError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    assert count is not None
    return count


def use_shared_threads(threads: int | None = None) -> bool:
    """Run every ONNX Runtime session of this process on one shared (global) thread pool.

    Each static-T graph is its own session. With a pool per session (the default
    for a library), the pools must sleep when idle, or spinning pools fight each
    other (and the draft's) for the cores; sleeping pays a wake-up per call. One
    shared spinning pool has neither cost: ~1.3x faster decode on 2 cores.
    ORT fixes its pools when it creates its environment, at the first session, and
    afterwards requires *every* session of the process to use the shared pool, so
    this is opt-in: specdeploy's own processes (CLI, server, bench) call it first
    thing; a host embedding the runtime may call it at start-up if all its sessions
    can share. `threads` (default: ORT's, the physical cores) sizes the pool.
    Returns whether the shared pool is in use (False once sessions were opened
    per-session).
    """
    global _THREADING
    check_threads(threads)
    if _THREADING is None:
        import onnxruntime.capi._pybind_state as ort_state

        ort_state.set_global_thread_pool_sizes(threads or 0, 1)
        _THREADING = "shared"
    return _THREADING == "shared"


def use_per_session_threads() -> None:
    """Keep the default: each session its own pool, sleeping when idle."""
    global _THREADING
    if _THREADING is None:
        _THREADING = "per-session"


def thread_pool_mode() -> str:
    """"shared" (one process-wide pool) or "per-session"."""
    return _THREADING or "per-session"


def session_options(threads: int | None):
    """ORT options every session of ours uses (see use_shared_threads for the thread pools)."""
    import onnxruntime as ort

    check_threads(threads)
    use_per_session_threads()  # no-op when the shared pool was chosen first
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    if _THREADING == "shared":
        opts.use_per_session_threads = False
        return opts
    if threads:
        opts.intra_op_num_threads = threads
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return opts


_THREADING: str | None = None  # fixed by the first session this process opens


def open_session(path: Path, backend: str, threads: int | None, providers: list | None = None):
    """The process's session of the graph at `path` on `backend` (opened on first use, then shared).

    `providers` overrides the backend's provider list (with options, e.g. TensorRT-EP profiles)."""
    import onnxruntime as ort

    # Under "trt", graphs that have no engine (drafter heads) run on ORT's CUDA provider.
    providers = providers or (ORT_PROVIDERS["ort-cuda"] if backend == "trt" else ORT_PROVIDERS[backend])
    use_per_session_threads()  # fixes the thread-pool mode (a no-op once chosen): it is part of the key

    def new_session():
        try:
            return ort.InferenceSession(str(path), session_options(threads), providers=providers)
        except Exception as exc:  # corrupt or truncated graph / external data
            raise SpecDeployError(f"could not load graph {path}: {str(exc).splitlines()[0][:300]}") from None

    return shared_session(path, (repr(providers), threads, _THREADING), new_session)


def open_decoder_session(manifest, record: GraphRecord, backend: str, threads: int | None,
                         providers: list | None = None, path: Path | None = None):
    """`open_session` for a decoder graph the manifest describes (at `path`: the record's file by default),
    checked against that description when it opens (session metadata only: its KV inputs and logits width)."""
    path = path or manifest.graph_path(record)
    session = open_session(path, backend, threads, providers)
    logits = next((o.shape for o in session.get_outputs() if o.name == LOGITS), [None])
    problem = decoder_mismatch(path.name, manifest.models[record.model], session.get_inputs(), logits[-1],
                               manifest.dtype)
    if problem:
        raise SpecDeployError(problem)
    return session


class OrtGraph:
    """One ONNX graph in one ORT session; inputs wrap numpy memory without copying."""

    def __init__(self, path: Path, backend: str = "ort-cpu", threads: int | None = None):
        self.session = open_session(path, backend, threads)
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.input_names = {i.name for i in self.session.get_inputs()}

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self.output_names, self.session.run(self.output_names, feeds)))


class InPlaceGraph:
    """A fused decoder graph bound once to host arrays: its KV buffers (past and
    present are the same memory, so the graph writes new rows in place), its small
    inputs and its outputs. A call only fills the input arrays and runs; inputs
    with a dynamic dimension (the EAGLE head's mask width) are bound per call.

    `tokens` sizes a dynamic-T graph (dimension graph_contract.TOKENS_DIM): each static T
    is its own binding over the one shared session, so the weights are held once.
    `output_rows` (optional, shared by the bindings of one caller, whose calls never overlap):
    per output name a [1, rows, ...] array at least `tokens` rows long; this binding writes its
    first `tokens` rows, so bindings at many T hold one set of output buffers.
    `logit_rows` (a decoder graph with that input: graph_contract.LOGIT_ROWS): how many of the
    last rows get logits (default: all `tokens`). `shared_inputs`: input arrays to bind instead
    of new ones (another binding's at the same T, so one fill serves both). `session`: the graph's
    session when the caller holds it (another binding's), so it is not looked up again (which
    hashes the graph file and reads its external-data locations: ~15 ms on SmolLM2's).
    """

    def __init__(self, path: Path, threads: int | None, kv_buffers: dict[str, np.ndarray],
                 tokens: int | None = None, output_rows: dict[str, np.ndarray] | None = None,
                 logit_rows: int | None = None, shared_inputs: dict[str, np.ndarray] | None = None,
                 session=None):
        import onnxruntime as ort

        self.path = Path(path)
        self.session = session if session is not None else open_session(path, "ort-cpu", threads)
        self.binding = self.session.io_binding()
        self.inputs: dict[str, np.ndarray] = {}
        self.outputs: dict[str, np.ndarray] = {}
        self._keep: list[Any] = []  # OrtValues must outlive the binding
        types = {"tensor(int64)": np.int64, "tensor(bool)": np.bool_, "tensor(float)": np.float32}

        rows = {TOKENS_DIM: tokens, LOGIT_ROWS: tokens if logit_rows is None else logit_rows}

        def shape_of(arg) -> list:
            return [rows[d] if isinstance(d, str) and rows.get(d) is not None else d for d in arg.shape]

        def bind(name: str, array: np.ndarray, output: bool) -> None:
            value = ort.OrtValue.ortvalue_from_numpy(array)  # shares the array's memory
            self._keep.append(value)
            (self.binding.bind_ortvalue_output if output else self.binding.bind_ortvalue_input)(name, value)

        for name, buf in kv_buffers.items():
            bind(name, buf, False)
            bind(present_of(name), buf, True)
        # The graph takes any token count (the caller may bind it at T it has no record of).
        self.any_tokens = any(TOKENS_DIM in i.shape for i in self.session.get_inputs())
        self.dynamic: set[str] = set()
        for i in self.session.get_inputs():
            if i.name in kv_buffers:
                continue
            shape = shape_of(i)
            if i.name == LOGIT_ROWS:
                self.inputs[i.name] = np.array([rows[LOGIT_ROWS]], np.int64)
                bind(i.name, self.inputs[i.name], False)
            elif shared_inputs is not None and i.name in shared_inputs:
                self.inputs[i.name] = shared_inputs[i.name]
                bind(i.name, self.inputs[i.name], False)
            elif all(isinstance(d, int) for d in shape):
                self.inputs[i.name] = np.zeros(shape, types[i.type])
                bind(i.name, self.inputs[i.name], False)
            else:
                self.dynamic.add(i.name)
        for o in self.session.get_outputs():
            if parse_kv_name(o.name) is None:
                shape = shape_of(o)
                if not all(isinstance(d, int) for d in shape):
                    raise SpecDeployError(f"{Path(path).name}: output {o.name} has shape {o.shape}; "
                                          f"a dynamic-T graph needs its static T to be bound in place")
                shared = None if output_rows is None else output_rows.get(o.name)
                if shared is not None and shared.shape[0] == 1 and shared.shape[1] >= shape[1] \
                        and list(shared.shape[2:]) == shape[2:] and shared.dtype == types[o.type]:
                    self.outputs[o.name] = shared[:, : shape[1]]  # a contiguous prefix: no copy
                else:
                    self.outputs[o.name] = np.zeros(shape, types[o.type])
                bind(o.name, self.outputs[o.name], True)

    def run(self, feeds: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Run on the bound arrays, after copying `feeds` into them (dynamic-shape ones are bound)."""
        for name, value in (feeds or {}).items():
            if name in self.dynamic:
                self.binding.bind_cpu_input(name, np.ascontiguousarray(value))
            else:
                self.inputs[name][...] = value
        self.session.run_with_iobinding(self.binding)
        return self.outputs
