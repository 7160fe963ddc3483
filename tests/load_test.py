"""Bounded load test of an OpenAI-compatible specdeploy server on loopback.

    python tests/load_test.py --export build/export/default --clients 16 --seconds 60 --pool-size 2
    python tests/load_test.py --url http://127.0.0.1:8000 --clients 16 --seconds 60

N client threads (the official `openai` client, no retries) send completions back to back
for S seconds — half streaming, mixed greedy/sampled, mixed methods — and every error
counts. Prints p50/p90/p99 latency, time to first token and throughput as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

PROMPTS = ["Once upon a time", "def main():\n    ", "import numpy as np\n", "The weather today is",
           "class Node:\n    def __init__(self", "In the beginning", "for i in range(10):", "Hello, world"]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    xs = sorted(values)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _client_loop(base_url: str, model: str, deadline: float, max_tokens: int, methods: list[str], seed: int,
                 out: dict, lock: threading.Lock) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        prompt, stream = rng.choice(PROMPTS), rng.random() < 0.5
        sampled = rng.random() < 0.5
        extra = {"method": rng.choice(methods), "ignore_eos": True}
        kwargs = dict(model=model, prompt=prompt, max_tokens=rng.randint(max_tokens // 2, max_tokens),
                      temperature=0.8 if sampled else 0.0, seed=rng.randrange(1 << 30) if sampled else None,
                      extra_body=extra)
        t0 = time.perf_counter()
        ttft, tokens = None, 0
        try:
            if stream:
                chunks = client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
                for chunk in chunks:
                    if chunk.choices and chunk.choices[0].text and ttft is None:
                        ttft = time.perf_counter() - t0
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
            else:
                tokens = client.completions.create(**kwargs).usage.completion_tokens
        except Exception as exc:  # every failure is a finding of the load test
            with lock:
                out["errors"].append(f"{type(exc).__name__}: {str(exc)[:200]}")
            continue
        latency = time.perf_counter() - t0
        with lock:
            out["latency"].append(latency)
            out["tokens"] += tokens
            if ttft is not None:
                out["ttft"].append(ttft)


def run_load(base_url: str, model: str, clients: int = 4, seconds: float = 10.0, max_tokens: int = 32,
             methods: list[str] | None = None) -> dict:
    out = {"latency": [], "ttft": [], "tokens": 0, "errors": []}
    lock = threading.Lock()
    start = time.monotonic()
    deadline = start + seconds
    threads = [threading.Thread(target=_client_loop, daemon=True,
                                args=(base_url, model, deadline, max_tokens, methods or ["ar"], i, out, lock))
               for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    lat = out["latency"]
    return {
        "clients": clients, "seconds": round(elapsed, 2), "requests": len(lat), "errors": len(out["errors"]),
        "error_samples": out["errors"][:5],
        "latency_s": {"p50": percentile(lat, 0.5), "p90": percentile(lat, 0.9), "p99": percentile(lat, 0.99),
                      "max": max(lat, default=0.0)},
        "ttft_s": {"p50": percentile(out["ttft"], 0.5), "p90": percentile(out["ttft"], 0.9),
                   "p99": percentile(out["ttft"], 0.99)},
        "requests_per_s": len(lat) / elapsed, "tokens": out["tokens"], "tokens_per_s": out["tokens"] / elapsed,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    src.add_argument("--export", type=Path, help="start `specdeploy serve` on this export for the test")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--methods", default="", help="comma-separated; default: every method the server offers")
    p.add_argument("--pool-size", type=int, default=2, help="with --export")
    p.add_argument("--queue", type=int, help="with --export (default: clients, so that nothing is refused)")
    args = p.parse_args(argv)

    import httpx

    server = None
    try:
        if args.export is not None:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from serve_util import ServerProcess

            server = ServerProcess(args.export, "--pool-size", str(args.pool_size),
                                   "--queue", str(args.queue if args.queue is not None else args.clients))
            url = server.url
        else:
            url = args.url.rstrip("/")
        card = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
        methods = [m for m in args.methods.split(",") if m] or card.get("methods") or ["ar"]
        report = run_load(url, card["id"], args.clients, args.seconds, args.max_tokens, methods)
        report["methods"] = methods
        report["server"] = httpx.get(f"{url}/health", timeout=10).json()
    finally:
        if server is not None:
            server.stop()
    print(json.dumps(report, indent=2))
    return 0 if report["errors"] == 0 and report["requests"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
