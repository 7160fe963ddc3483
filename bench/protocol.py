"""The worker side of the bench protocol: JSON lines on stdin, JSON lines back.

Standard library only, no package-relative imports: onnxruntime-genai's runner
imports this file from its own venv, where specdeploy is not installed.

    -> {"op": "setup", ...}                     <- {"ok": true, "info": {...}}
    -> {"op": "run", "prompt_ids": [...], ...}  <- {"ok": true, "token_ids": [...], "seconds": s, ...}
    -> {"op": "quit"}
Any failure answers {"ok": false, "error": "..."}; the orchestrator reports it.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback


def peak_rss_mb() -> float:
    """This process's peak resident set. VmHWM, not ru_maxrss: Linux carries ru_maxrss over
    fork + exec, so a worker would report its parent's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def _reply_channel():
    # Libraries print to stdout (progress bars, warnings); keep the protocol on a
    # private copy of fd 1 and point fd 1 at stderr so nothing else can corrupt it.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def serve(make_system) -> None:
    """make_system(setup: dict) -> object with .info (dict) and .run(request) -> (token_ids, target_calls).

    The worker times `run` itself, so pipe I/O and JSON never count.
    """
    out = _reply_channel()
    system = None

    def reply(obj):
        out.write(json.dumps(obj) + "\n")

    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            msg = json.loads(line)
            op = msg.get("op")
            if op == "quit":
                break
            if op == "setup":
                system = make_system(msg)
                reply({"ok": True, "info": getattr(system, "info", {}), "peak_rss_mb": peak_rss_mb()})
            elif op == "run":
                if system is None:
                    raise RuntimeError("run before setup")
                if hasattr(system, "prepare"):  # untimed set-up of the run (our worker's suffix caches)
                    system.prepare(msg)
                t0 = time.perf_counter()
                token_ids, target_calls = system.run(msg)
                seconds = time.perf_counter() - t0
                reply({"ok": True, "token_ids": [int(t) for t in token_ids], "seconds": seconds,
                       "target_calls": target_calls, "peak_rss_mb": peak_rss_mb(),
                       "info": getattr(system, "info", {})})
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as exc:  # the orchestrator turns this into a reported reason
            traceback.print_exc(file=sys.stderr)
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
            reply({"ok": False, "error": f"{type(exc).__name__}: {first}"})
