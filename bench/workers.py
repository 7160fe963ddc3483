"""The orchestrator's side of a worker process: start it, ask it, read its answer, stop it."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

from ..runtime.errors import SpecDeployError
from . import llamacpp, peers


class WorkerFailed(SpecDeployError):
    pass


# OpenMP's wait policy, as inherited from whatever started the bench (the Makefile exports PASSIVE for
# training and export, where spinning torch threads fight on shared cores; importing the GGUF converter
# sets it too). A worker runs its library's own default instead: llama.cpp's OpenMP pool, passive, slept
# at every barrier of a decode step and ran at 24 tokens/s, 58 with the default (SmolLM2 float32, chat).
OPENMP_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def thread_env(threads: int) -> dict:
    """Every system gets the same thread budget; these cover the libraries that read env vars."""
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "OPENBLAS_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", **peers.OFFLINE_ENV}
    return env


class Worker:
    def __init__(self, system: str, method: str, setup: dict, log_path: Path, peers_dir: Path):
        self.system, self.method, self.setup = system, method, setup
        self.label = f"{system}/{method}"
        self.log_path = log_path
        if system.startswith("ortgenai"):  # float32 and int4 builds
            self.argv = [str(peers.genai_python(peers_dir)), str(peers.RUNNER)]
            base = peers.genai_env()
        elif system.startswith("llamacpp"):  # the same-weights row and the quantized ones
            self.argv = [str(llamacpp.python(peers_dir)), str(llamacpp.RUNNER)]
            base = llamacpp.runner_env()
        else:
            self.argv = [sys.executable, "-m", "specdeploy.bench.worker"]
            base = dict(os.environ)
        base = {k: v for k, v in base.items() if k not in OPENMP_WAIT_VARS}
        self.env = {**base, **thread_env(setup["threads"])}
        if setup.get("ort_spinning") == "off":
            self.env["OMP_WAIT_POLICY"] = "PASSIVE"  # torch's OpenMP pool: the same policy
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}
        self.peak_rss_mb = 0.0

    def launch(self) -> None:
        """Start the process and send its setup; `ready()` collects the answer (so workers load in parallel)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, env=self.env, bufsize=1)
        self._send({"op": "setup", **self.setup})

    def ready(self, timeout: float) -> None:
        self._receive(timeout)

    def call(self, msg: dict, timeout: float) -> dict:
        self._send(msg)
        return self._receive(timeout)

    def _send(self, msg: dict) -> None:
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise WorkerFailed(self._death()) from None

    def _receive(self, timeout: float) -> dict:
        proc = self.proc
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        if not ready:
            self.kill()
            raise WorkerFailed(f"no answer within {timeout:.0f} s")
        line = proc.stdout.readline()
        if not line:
            raise WorkerFailed(self._death())
        reply = json.loads(line)
        if not reply.get("ok"):
            raise WorkerFailed(reply.get("error") or "failed")
        self.peak_rss_mb = max(self.peak_rss_mb, float(reply.get("peak_rss_mb") or 0))
        self.info.update(reply.get("info") or {})
        return reply

    def _death(self) -> str:
        try:
            rc = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = "killed"
        self._log.flush()
        lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        return f"worker exited ({rc}): {lines[-1][:300] if lines else 'no output'} (log: {self.log_path})"

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        if self.proc and self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        if getattr(self, "_log", None):
            self._log.close()


class MethodView:
    """One row (system, method) served by a worker process that runs several methods of one export
    (our runtime's: bench/worker.py), as a Worker to the orchestrator: its requests name the method;
    its info is the process's with the method's own parameters; the process stops with its last row."""

    def __init__(self, process: Worker, method: str, rows: list):
        self.process, self.method, self.system = process, method, process.system
        self.label = f"{self.system}/{method}"
        self._rows = rows  # every view of the process, this one included, while it runs
        self._rows.append(self)

    @property
    def peak_rss_mb(self) -> float:
        return self.process.peak_rss_mb

    @property
    def info(self) -> dict:
        info = {k: v for k, v in self.process.info.items() if k != "methods"}
        own = (self.process.info.get("methods") or {}).get(self.method, {})
        return {**info, **own, "methods_in_process": sorted((self.process.info.get("methods") or {}))}

    def call(self, msg: dict, timeout: float) -> dict:
        return self.process.call({**msg, "method": self.method}, timeout)

    def _leave(self, stop) -> None:
        if self in self._rows:
            self._rows.remove(self)
            if not self._rows:
                stop()

    def kill(self) -> None:
        """This row failed: the process stays for the others (a timeout has killed it already)."""
        self._leave(self.process.kill)

    def close(self) -> None:
        self._leave(self.process.close)
