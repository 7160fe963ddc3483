"""The same small load on `specdeploy serve`, its Ray Serve replicas and Triton, on loopback.

    python tests/engines_load.py --export OUT [--clients 16 --requests 8 --max-tokens 256] [--only ray2,triton1]

Each setup is started on its own (N workers, N ONNX Runtime threads in all), loaded, stopped:
C clients each send R greedy, non-streaming completions of M tokens (EOS ignored) at once, then
one client sends P short ones (8 tokens) one after another, for the engine hop's cost per
request. Prints one JSON object per setup.
Triton runs in `$SPECDEPLOY_TRITON_PYTHON` or build/triton-venv (see README, Scaling out).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from load_test import percentile  # noqa: E402
from serve_util import REPO, free_port, interrupt  # noqa: E402

PROMPT = "def main():"


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not up in {timeout} s")


def start(cmd: list[str], python: str = sys.executable, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([python, "-m", "specdeploy.cli", *cmd], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})})


def stop(proc: subprocess.Popen) -> None:
    interrupt(proc, 90)


def openai_call(url: str, model: str):
    client = httpx.Client(timeout=300)

    def call(max_tokens: int) -> int:
        r = client.post(f"{url}/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                                                       "temperature": 0, "ignore_eos": True})
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    return call


def triton_call(url: str, model: str):
    import tritonclient.grpc as tg

    client = tg.InferenceServerClient(url)

    def call(max_tokens: int) -> int:
        text = tg.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([PROMPT.encode()], dtype=np.object_))
        limit = tg.InferInput("max_tokens", [1], "INT32")
        limit.set_data_from_numpy(np.array([max_tokens], dtype=np.int32))
        eos = tg.InferInput("ignore_eos", [1], "BOOL")
        eos.set_data_from_numpy(np.array([True]))
        return len(client.infer(model, [text, limit, eos]).as_numpy("output_ids"))

    return call


def measure(make_call, clients: int, requests: int, max_tokens: int, probes: int) -> dict:
    calls = [make_call() for _ in range(clients)]
    calls[0](8)  # warm
    latencies, tokens = [], 0

    def client(i):
        out = []
        for _ in range(requests):
            t0 = time.perf_counter()
            n = calls[i](max_tokens)
            out.append((time.perf_counter() - t0, n))
        return out

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for result in pool.map(client, range(clients)):
            latencies += [lat for lat, _ in result]
            tokens += sum(n for _, n in result)
    elapsed = time.perf_counter() - t0
    single = []
    for _ in range(probes):
        t = time.perf_counter()
        calls[0](8)
        single.append(time.perf_counter() - t)
    return {"requests": len(latencies), "seconds": round(elapsed, 2),
            "requests_per_s": round(len(latencies) / elapsed, 2), "tokens_per_s": round(tokens / elapsed, 1),
            "latency_p50_s": round(percentile(latencies, 0.5), 3),
            "latency_p90_s": round(percentile(latencies, 0.9), 3),
            "single_8_tokens_p50_ms": round(1000 * percentile(single, 0.5), 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--export", type=Path, required=True)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--probes", type=int, default=20)
    p.add_argument("--only", default="runtime,plain1,plain2,ray1,ray2,triton1,triton2")
    args = p.parse_args(argv)
    export, model = str(args.export.resolve()), "bench"
    triton_python = os.environ.get("SPECDEPLOY_TRITON_PYTHON") or str(REPO / "build/triton-venv/bin/python")
    ray_env = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    queue = str(args.clients)
    for name in args.only.split(","):
        if name == "runtime":  # no server at all: the floor for the 8-token latency
            from specdeploy.runtime import Service

            svc = Service.load(export, warmup=False, threads=1)
            times = []
            for _ in range(args.probes + 1):
                t = time.perf_counter()
                svc.generate(PROMPT, max_new_tokens=8, ignore_eos=True)
                times.append(time.perf_counter() - t)
            print(json.dumps({"setup": name, "single_8_tokens_p50_ms": round(1000 * percentile(times[1:], 0.5), 1)}))
            continue
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        common = [export, "--model-name", model, "--port", str(port), "--queue", queue, "--log-level", "warning"]
        n = name[-1]
        # Every setup N gets N ONNX Runtime threads in all: N workers share them, or one each.
        if name.startswith("plain"):  # one process, N workers: the baseline
            proc = start(["serve", *common, "--pool-size", n, "--threads", n])
        elif name.startswith("ray"):  # N replicas of one worker each, a local cluster
            proc = start(["serve", *common, "--ray", "--replicas", n, "--replica-cpus", "1"], env=ray_env)
        else:  # N Triton instances of one worker each
            grpc = free_port()
            proc = start(["serve", export, "--model-name", model, "--port", str(port), "--grpc-port", str(grpc),
                          "--metrics-port", str(free_port()), "--queue", queue, "--triton-instances", n,
                          "--threads", "1",
                          "--triton-repo", f"/tmp/specdeploy-bench-repo-{port}"], python=triton_python)
        try:
            wait_http(f"{url}/v2/health/ready" if name.startswith("triton") else f"{url}/health", proc)
            time.sleep(2 if name.startswith("plain") else 10)  # every replica/instance up and warm
            make = ((lambda: triton_call(f"127.0.0.1:{grpc}", model)) if name.startswith("triton")
                    else (lambda: openai_call(url, model)))
            report = measure(make, args.clients, args.requests, args.max_tokens, args.probes)
        finally:
            stop(proc)
        load = os.getloadavg()[0]
        print(json.dumps({"setup": name, **report, "load_avg_1m": round(load, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
