"""A real `specdeploy serve` process on a free loopback port (used by test_server.py and load_test.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def interrupt(proc: subprocess.Popen, grace: float) -> None:
    """SIGINT (a server's graceful shutdown) to a process still running, then SIGKILL after `grace` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, export_dir: Path, *args: str, startup_timeout: float = 90.0, env: dict | None = None,
                 headers: dict | None = None):
        """`env`: extra environment variables; `headers`: what the readiness probe sends (e.g. an API key)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"specdeploy-serve-{self.port}.log"
        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "specdeploy.cli", "serve", str(export_dir), "--port", str(self.port),
               "--log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO,
                                     env={**os.environ, **(env or {})})
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1, headers=headers).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not come up in {startup_timeout} s:\n{self.log()}")
            time.sleep(0.1)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def metrics(self, headers: dict | None = None) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10, headers=headers).text

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-5000:]

    def stop(self) -> None:
        interrupt(self.proc, 10)  # uvicorn's graceful shutdown
        self._log.close()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def metric_value(text: str, name: str, **labels) -> float:
    """The value of one sample in Prometheus text format (0 if absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def clone_export(src: Path, dst: Path) -> Path:
    """A copy of an export that a test may change: graphs and weights hard-linked (never written in
    place), manifest and tokenizer files copied."""
    shutil.copytree(src, dst, copy_function=os.link, ignore=shutil.ignore_patterns("manifest.json", "tokenizer"))
    shutil.copy(src / "manifest.json", dst / "manifest.json")
    shutil.copytree(src / "tokenizer", dst / "tokenizer")
    return dst


def break_decode_graphs(export_dir: Path, first_bad_position: int) -> None:
    """Make the target's one-token graphs fail inside ONNX Runtime from `first_bad_position` on.

    A real run-time fault of the kind a broken export or accelerator produces: each graph keeps
    its inputs and outputs but adds `logits += table[position_ids]` with a table that short, so a
    later position is an out-of-bounds Gather. Prefill (larger graphs) and the first steps work.
    """
    from onnx import TensorProto, helper

    def add_fault(graph, raw: str) -> None:
        table = helper.make_tensor("position_table", TensorProto.FLOAT, [first_bad_position],
                                   [0.0] * first_bad_position)
        axes = helper.make_tensor("position_axes", TensorProto.INT64, [1], [2])
        graph.initializer.extend([table, axes])
        graph.node.extend([
            helper.make_node("Gather", ["position_table", "position_ids"], ["position_bias"]),
            helper.make_node("Unsqueeze", ["position_bias", "position_axes"], ["position_bias3"]),
            helper.make_node("Add", [raw, "position_bias3"], ["logits"]),
        ])

    rewrite_decode_logits(export_dir, add_fault)


def rewrite_decode_logits(export_dir: Path, rewrite) -> None:
    """In each one-token target graph of a cloned export, the logits renamed to a raw name and
    `rewrite(graph, raw_name)` adding the nodes that compute `logits` from it; checksums updated."""
    import onnx

    manifest = json.loads((export_dir / "manifest.json").read_text())
    graphs = [g for g in manifest["graphs"].values()
              if g.get("model") == "target" and g.get("kind") == "decoder" and g.get("tokens") == 1]
    assert graphs, "the export has no one-token target graph"
    for spec in graphs:
        path = export_dir / spec["file"]
        model = onnx.load(str(path), load_external_data=False)
        for node in model.graph.node:
            node.output[:] = ["logits_raw" if name == "logits" else name for name in node.output]
        rewrite(model.graph, "logits_raw")
        path.unlink()  # a hard link (clone_export): never write through it
        onnx.save(model, str(path))
        if spec["file"] in manifest.get("files", {}):
            manifest["files"][spec["file"]] = hashlib.sha256(path.read_bytes()).hexdigest()
    (export_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
