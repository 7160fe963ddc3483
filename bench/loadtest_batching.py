"""Load test of continuous batching against today's pool, on the real server over loopback.

    python -m specdeploy.bench.loadtest_batching build/export/batched --clients 1 4 16 --batch 16

It starts `specdeploy serve` once per server configuration (today's pool of instances;
`--batch N` with load-adaptive speculation; `--batch N` decoding plainly), all at once, then
for each prompt mix, client count and configuration in turn (so the configurations' runs are
minutes apart, not a whole pass: on a shared machine the load drifts) runs that many
closed-loop clients, each sending `--requests` streamed completions (the methods cycled,
greedy and seeded alternately, prompts cycled through the mix), and prints one JSON line:
throughput (completion tokens per second of wall time), time to first token and inter-token
latency p50/p95, tokens per target call (the server's acceptance length, over all requests),
and the load average before and after. `--rounds R` repeats the whole sweep (configurations
in reverse order every other round). `--baseline DIR` also serves every configuration from
another source tree (DIR holds a `specdeploy` package: e.g. `git archive` of the commit before
a change), as `<config>@baseline`, interleaved with the others: an A/B of a change in one
run; `--baseline-export DIR` serves the baseline from another export too (a change to the
batched graph: the baseline tree's runtime runs the graph it was written for). The export
needs the batched graph (python -m specdeploy.export.batched_graph EXPORT).

Mixes (`--mixes`): `toy`, a few short prompts and one long one; `chat`, `grounded` and `code`,
the bench's shipped held-out prompt sets (bench/prompts: chat questions; summarize / correct /
edit a given text or function, the answer mostly in the prompt; Python functions to continue);
`mixed`, those three interleaved (prompts of 20 to 210 tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from .prompts import PROMPT_DIR, load_items

SHORT = ["Once upon a time", "def fibonacci(n):\n    ", "The capital of France is", "List three colors: red,"]
LONG = ("Summarize the following notes. The meeting covered the budget, the hiring plan and the release "
        "schedule. The budget for the next quarter stays flat, the hiring plan adds two engineers, and the "
        "release moves by one week because the test suite found a regression in the parser. ") * 3
SPEC_METHODS = ["prompt-lookup", "suffix", "eagle", "medusa"]
SETS = ("chat", "grounded", "code")


def default_methods(export: Path) -> list[str]:
    """The speculative methods the clients cycle through: the host drafters and heads, and the draft model
    where the export has one (make export's self-draft: the default model's best method on chat)."""
    try:
        models = json.loads((export / "manifest.json").read_text()).get("models", {})
    except (OSError, ValueError):
        models = {}  # the server reports a bad export itself
    return SPEC_METHODS + (["draft"] if "draft" in models else [])


def mix_prompts(mix: str) -> list[dict]:
    """The request bodies' prompt part of a mix, in the order clients cycle through them:
    {"prompt": text} (a completion) or {"messages": [...]} (a chat completion)."""
    if mix == "toy":
        return [{"prompt": p} for p in SHORT[:3]] + [{"prompt": LONG}]
    if mix == "mixed":
        sets = [mix_prompts(name) for name in SETS]
        return [p for group in zip(*sets) for p in group]
    items = load_items(PROMPT_DIR / f"{mix}.jsonl")
    return [{"prompt": item["prompt"]} if "prompt" in item else
            {"messages": ([{"role": "system", "content": item["system"]}] if item.get("system") else [])
             + [{"role": "user", "content": item["chat"]}]} for item in items]


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, export: Path, args: list[str], source: Path | None = None, name: str | None = None):
        """`source`: a directory holding the `specdeploy` package to serve from (None: this one)."""
        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        if source is not None:
            env["PYTHONPATH"] = os.pathsep.join([str(source.resolve()), *filter(None, [env.get("PYTHONPATH")])])
        # served under `name` (the model the clients ask for), whichever export directory it is
        self.proc = subprocess.Popen([sys.executable, "-m", "specdeploy.cli", "serve", str(export.resolve()),
                                      "--port", str(self.port), "--log-level", "warning",
                                      *(["--model-name", name] if name else []), *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                                     cwd=source)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stderr.read() if self.proc.stderr else ''}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("server did not come up")
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def one_request(url: str, model: str, job: dict, out: dict, lock: threading.Lock) -> None:
    import httpx

    t0 = time.perf_counter()
    stamps: list[float] = []
    stats: dict = {}
    path = "/v1/chat/completions" if "messages" in job else "/v1/completions"
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}, **job}
    with httpx.Client(timeout=600) as http:
        with http.stream("POST", f"{url}{path}", json=body) as r:
            if r.status_code != 200:
                with lock:
                    out["errors"] += 1
                return
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("specdeploy"):
                    stats = chunk["specdeploy"]
                choice = chunk["choices"][0] if chunk["choices"] else {}
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    stamps.append(time.perf_counter())
    with lock:
        out["tokens"] += job["max_tokens"]  # ignore_eos: every request runs to max_tokens
        out["target_calls"] += stats.get("target_calls", 0)
        mine = out["by_method"].setdefault(job["method"], {"requests": 0, "seconds": 0.0, "target_calls": 0})
        mine["requests"] += 1
        mine["seconds"] += time.perf_counter() - t0
        mine["target_calls"] += stats.get("target_calls", 0)
        if stamps:
            out["ttft"].append(stamps[0] - t0)
            # a streamed chunk may carry several tokens (a speculative step): spread its gap over them
            gaps = [b - a for a, b in zip(stamps, stamps[1:])]
            per_token = (stamps[-1] - stamps[0]) / max(1, job["max_tokens"] - 1)
            out["itl"].extend(gaps if len(stamps) >= job["max_tokens"] else [per_token] * (job["max_tokens"] - 1))


def gate_ratios(url: str) -> dict[str, float]:
    """A batched server's speculation gate so far (its /metrics): speculating / plain rate by rows."""
    import httpx

    prefix = "specdeploy_speculation_gate_ratio{rows=\""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    return {line[len(prefix):].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(prefix)}


def jobs_for(client: int, requests: int, methods: list[str], max_tokens: int, prompts: list[dict],
             greedy: bool) -> list[dict]:
    jobs = []
    for i in range(requests):
        k = client * requests + i
        sampled = k % 2 == 1 and not greedy
        jobs.append({**prompts[k % len(prompts)], "max_tokens": max_tokens, "method": methods[k % len(methods)],
                     "ignore_eos": True, "temperature": 0.7 if sampled else 0.0, **({"seed": k} if sampled else {})})
    return jobs


def run_load(url: str, model: str, clients: int, requests: int, methods: list[str], max_tokens: int,
             prompts: list[dict], greedy: bool = False) -> dict:
    out: dict = {"tokens": 0, "errors": 0, "target_calls": 0, "ttft": [], "itl": [], "by_method": {}}
    lock = threading.Lock()

    def client(c: int) -> None:
        for job in jobs_for(c, requests, methods, max_tokens, prompts, greedy):
            one_request(url, model, job, out, lock)

    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"clients": clients, "requests": clients * requests, "tokens": out["tokens"], "errors": out["errors"],
            "seconds": round(wall, 2), "tokens_per_s": round(out["tokens"] / wall, 1),
            "ttft_p50_s": round(percentile(out["ttft"], 0.5), 3), "ttft_p95_s": round(percentile(out["ttft"], 0.95), 3),
            "itl_p50_ms": round(1000 * percentile(out["itl"], 0.5), 1),
            "itl_p95_ms": round(1000 * percentile(out["itl"], 0.95), 1),
            "tokens_per_call": round(out["tokens"] / out["target_calls"], 2) if out["target_calls"] else None,
            "load_before": round(load0, 2), "load_after": round(os.getloadavg()[0], 2),
            # per method: mean seconds a request took and its target calls (rows share calls, so a
            # method whose rows' host work makes them miss calls shows here)
            "by_method": {m: {"requests": v["requests"], "seconds_mean": round(v["seconds"] / v["requests"], 2),
                              "calls_mean": round(v["target_calls"] / v["requests"], 1)}
                          for m, v in sorted(out["by_method"].items())}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export", type=Path)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--batch", type=int, default=16, help="rows of the batched server")
    ap.add_argument("--pool-size", type=int, default=2, help="instances of today's pooled server")
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--configs", nargs="+", default=["pool", "batch", "batch-plain"])
    ap.add_argument("--rounds", type=int, default=1, help="sweeps over client counts and configurations")
    ap.add_argument("--methods", nargs="+", help="methods the pool and the adaptive batch cycle through "
                    "(batch-plain: ar); default: prompt-lookup, suffix, eagle, medusa, and draft where the "
                    "export has one")
    ap.add_argument("--mixes", nargs="+", default=["mixed"], choices=["toy", "mixed", *SETS])
    ap.add_argument("--greedy", action="store_true", help="every request greedy (default: every other seeded)")
    ap.add_argument("--baseline", type=Path, help="a directory holding another `specdeploy` package: every "
                    "configuration is also served from it, as <config>@baseline")
    ap.add_argument("--baseline-export", type=Path, help="the export the baseline configurations serve "
                    "(default: the same one)")
    args = ap.parse_args(argv)
    if args.methods is None:  # methods every served export has (a baseline export without a draft model)
        served = [args.export] + ([args.baseline_export] if args.baseline_export else [])
        args.methods = [m for m in default_methods(args.export) if all(m in default_methods(e) for e in served)]
    if args.baseline is not None and not (args.baseline / "specdeploy" / "cli.py").is_file():
        ap.error(f"--baseline {args.baseline}: no specdeploy/cli.py there")
    if args.baseline_export is not None and args.baseline is None:
        ap.error("--baseline-export needs --baseline")
    queue = str(max(args.clients) * 2)
    configs = {"pool": (["--pool-size", str(args.pool_size), "--queue", queue], args.methods),
               "batch": (["--batch", str(args.batch), "--queue", queue], args.methods),
               "batch-plain": (["--batch", str(args.batch), "--queue", queue], ["ar"])}
    names = list(args.configs)
    if args.baseline is not None:
        configs.update({f"{name}@baseline": configs[name] for name in args.configs})
        names = [n for name in args.configs for n in (name, f"{name}@baseline")]
    servers: dict[str, Server] = {}
    try:
        for name in names:
            baseline = "@" in name
            export = args.baseline_export if baseline and args.baseline_export else args.export
            servers[name] = Server(export, configs[name][0], args.baseline if baseline else None, args.export.name)
            methods = configs[name][1]  # warm-up: every method's graphs opened
            run_load(servers[name].url, args.export.name, 1, len(methods), methods, 4, mix_prompts("toy"))
        for round_ in range(args.rounds):
            for mix in args.mixes:
                prompts = mix_prompts(mix)
                for clients in args.clients:
                    for name in names if round_ % 2 == 0 else names[::-1]:
                        server_args, methods = configs[name]
                        row = run_load(servers[name].url, args.export.name, clients, args.requests, methods,
                                       args.max_tokens, prompts, args.greedy)
                        gate = gate_ratios(servers[name].url)
                        print(json.dumps({"config": name, "server": " ".join(server_args), "mix": mix,
                                          "methods": methods, "greedy": args.greedy, "round": round_, **row,
                                          **({"gate": gate} if gate else {})}),
                              flush=True)
    finally:
        for server in servers.values():
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
