"""Shutting `specdeploy serve` down (SIGINT, SIGTERM) while generations run: every request in flight
is answered at once (a JSON 503; a stream's in-band error, then [DONE]), and the process exits
cleanly — no traceback, and no abort from a worker thread still inside ONNX Runtime."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from serve_util import ServerProcess, clone_export, rewrite_decode_logits

SLOW_SIZE = 1024  # a 1024 x 1024 MatMul per decode step: tens of ms on one thread
MAX_TOKENS = 500  # with the 4-token prompt, about the micro export's whole context (512)


def slow_decode_graphs(export_dir: Path, size: int = SLOW_SIZE) -> None:
    """Make every one-token target graph slow without changing its output: it adds the sum of a
    (size x size) MatMul of a matrix built from position_ids with zeros, which ONNX Runtime cannot
    fold away. The micro model otherwise decodes a token in well under a millisecond, too fast to
    be caught mid-generation, or inside ONNX Runtime, by a signal."""
    from onnx import TensorProto, helper, numpy_helper

    def add_work(graph, raw: str) -> None:
        graph.initializer.extend([numpy_helper.from_array(np.zeros((size, size), np.float32), "slow_weight"),
                                  numpy_helper.from_array(np.array([size, size], np.int64), "slow_shape")])
        graph.node.extend([
            helper.make_node("Cast", ["position_ids"], ["slow_positions"], to=TensorProto.FLOAT),
            helper.make_node("ReduceSum", ["slow_positions"], ["slow_sum"], keepdims=0),
            helper.make_node("Expand", ["slow_sum", "slow_shape"], ["slow_matrix"]),
            helper.make_node("MatMul", ["slow_matrix", "slow_weight"], ["slow_product"]),
            helper.make_node("ReduceSum", ["slow_product"], ["slow_zero"], keepdims=0),
            helper.make_node("Add", [raw, "slow_zero"], ["logits"]),
        ])

    rewrite_decode_logits(export_dir, add_work)


@pytest.fixture(scope="module")
def slow_export(micro_export, tmp_path_factory) -> Path:
    export = clone_export(micro_export, tmp_path_factory.mktemp("slow") / "slow")
    slow_decode_graphs(export)
    return export


class _Client(threading.Thread):
    """One request in a thread: its status, and (streamed) its SSE lines or (not) its JSON body."""

    def __init__(self, url: str, stream: bool):
        super().__init__(daemon=True)
        self.url, self.stream = url, stream
        self.status, self.lines, self.body, self.error = None, [], None, None

    def run(self):
        body = {"model": "slow", "prompt": [5, 6, 7, 8], "max_tokens": MAX_TOKENS, "ignore_eos": True,
                "temperature": 0, "stream": self.stream}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=60) as resp:
                self.status = resp.status_code
                if self.stream:
                    self.lines.extend(line for line in resp.iter_lines() if line)  # appended as they come
                else:
                    self.body = json.loads(resp.read())
        except Exception as exc:  # noqa: BLE001 - what the test reports
            self.error = exc


def _wait(condition, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _assert_ended_by_shutdown(stream: _Client) -> None:
    assert stream.error is None, f"the stream was cut off: {stream.error!r}; last lines {stream.lines[-2:]}"
    assert stream.status == 200
    assert stream.lines[-1] == "data: [DONE]", stream.lines[-3:]
    error = json.loads(stream.lines[-2][len("data: "):])["error"]
    assert error["code"] == "server_shutting_down" and error["type"] == "internal_error", error
    tokens = [json.loads(line[len("data: "):]) for line in stream.lines[:-2]]
    assert tokens and all(t["choices"][0]["finish_reason"] is None for t in tokens)
    assert len(tokens) < MAX_TOKENS  # cut short by the shutdown, not run to its end


def _assert_clean_exit(srv: ServerProcess) -> None:
    log = srv.log()
    for bad in ("Traceback", "terminate called", "Exception in ASGI application", "Aborted"):
        assert bad not in log, log


@pytest.mark.parametrize("pool, signals", [("1", 1), ("2", 1), ("2", 3)])
def test_sigint_mid_generation_answers_everyone_and_exits_cleanly(slow_export, pool, signals):
    """A stream, and a non-streamed request (pool 1: queued; pool 2: running): each gets its 503 at once,
    and the process exits 0 with its workers out of ONNX Runtime (the interpreter finalizing while a
    worker was inside a `run` aborted the process: exit 134, 'terminate called'). Ctrl-C pressed
    three times (uvicorn: force quit) ends the same way."""
    with ServerProcess(slow_export, "--method", "ar", "--threads", "1", "--pool-size", pool, "--queue", "4",
                       "--log-level", "info") as srv:
        stream = _Client(srv.url, stream=True)
        stream.start()
        _wait(lambda: len(stream.lines) >= 3, "the stream's first tokens")
        plain = _Client(srv.url, stream=False)
        plain.start()
        busy = (lambda h: h["waiting"] == 1) if pool == "1" else (lambda h: h["in_use"] == 2)
        _wait(lambda: busy(srv.health()), "the second request to be queued or running")
        time.sleep(0.3)  # well inside ONNX Runtime's steps
        signalled = time.monotonic()
        for _ in range(signals):
            srv.proc.send_signal(signal.SIGINT)
            time.sleep(0.05)
        assert srv.proc.wait(20) == 0, srv.log()
        took = time.monotonic() - signalled
        stream.join(10)
        plain.join(10)
        _assert_ended_by_shutdown(stream)
        assert plain.error is None and plain.status == 503, (plain.status, plain.body, plain.error)
        assert plain.body["error"]["code"] == "server_shutting_down"
        assert took < 5, f"shutdown took {took:.1f} s: it waited for the graceful timeout"  # uvicorn's: 5 s
        _assert_clean_exit(srv)


def test_sigterm_mid_stream_ends_it_in_band_and_exits_as_sigterm(slow_export):
    with ServerProcess(slow_export, "--method", "ar", "--threads", "1", "--log-level", "info") as srv:
        stream = _Client(srv.url, stream=True)
        stream.start()
        _wait(lambda: len(stream.lines) >= 3, "the stream's first tokens")
        srv.proc.send_signal(signal.SIGTERM)
        # uvicorn re-raises SIGTERM once it has shut down: the conventional death by SIGTERM (143)
        assert srv.proc.wait(20) == -signal.SIGTERM, srv.log()
        stream.join(10)
        _assert_ended_by_shutdown(stream)
        _assert_clean_exit(srv)
