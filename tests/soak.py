"""Soak test: a real `specdeploy serve` under mixed, partly hostile traffic for minutes.

    python tests/soak.py [--export build/export/default] [--seconds 600] [--clients 16] [--batch N] [--json out.json]
    make soak DURATION=600 [SOAK_ARGS="--batch 8"]

N client threads (httpx, no retries) send requests back to back: chat and completions,
streaming and not, greedy and sampled, every method the export offers; some disconnect
mid-stream or before a non-streaming answer; some send bad requests (unknown method or
model, out-of-range values, prompts past the context, oversized, non-JSON or malformed
bodies), each with the one 4xx it must get. A sampler records the server's RSS, open file
descriptors and threads, the pool's state, the outcome counts and latency percentiles over
time. At the end it asserts: no 5xx and no in-band stream error, no unexpected status or
client error, the pool idle again, anonymous RSS flat after warm-up, fds and threads back to their
idle level, and greedy answers of every method identical to the ones before the soak.
Exit status 0 when every check passes; the report is JSON on stdout (and --json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_test import PROMPTS, percentile  # noqa: E402
from serve_util import ServerProcess  # noqa: E402

from specdeploy.runtime.chat_template import ChatTemplate  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_EXPORT = REPO / "build" / "export" / "default"
MICRO_EXPORT = REPO / "build" / "export" / "micro-soak"
CHAT = ["What should I pack for a weekend camping trip?", "Write a haiku about the sea.",
        "Explain recursion to a child.", "Give me three names for a cat.", "How do I boil an egg?"]
# Anonymous RSS (the process's own memory: what a leak grows; file-backed RSS is mapped weights and
# libraries, which the kernel pages in and out with the machine's memory pressure) may grow after
# warm-up by at most max(RSS_GROWTH_FRACTION of its warm size, RSS_GROWTH_BYTES): ONNX Runtime's
# arenas and glibc's malloc arenas settle at the largest shapes and the most threads seen, which a
# long run reaches late by chance; a leak of 100 KiB per request exceeds it within a few hundred.
RSS_GROWTH_FRACTION = 0.05
RSS_GROWTH_BYTES = 24 << 20
FD_SLACK = 4  # idle fds after the soak vs before: a log rotation, an accepted-but-unread socket
# Threads come and go with the load (a thread per generation, anyio's pool, which prunes idle threads only
# when it is next used): the most seen in the second half after warm-up vs the first, and when idle
# afterwards vs the most seen under load, may differ by this much.
THREAD_SLACK = 8
# Under load a request holds at most a few threads at once (its generation, its stream's iterator in
# anyio's pool): the most seen may exceed the idle count by this many per client (plus THREAD_SLACK);
# a thread leaked per request passes it within a few dozen requests.
THREADS_PER_CLIENT = 3
# The halves of the run after warm-up are compared only with this many samples in each: the thread
# count is a running maximum of concurrent work and ramps up for seconds, so a half of one or two early
# samples reads that ramp as growth (a 12 s run at load 3 did: 13 threads at 3 s, 22 at 6 s).
THREAD_HALF_SAMPLES = 3


# ------------------------------------------------------------------------------ the server process

def proc_stats(pid: int) -> dict:
    """RSS (bytes; all, anonymous, file-backed), threads and open fds of one process, from /proc (Linux)."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    kib = {name: int(fields[name].split()[0]) * 1024 for name in ("VmRSS", "RssAnon", "RssFile")}
    return {"rss": kib["VmRSS"], "rss_anon": kib["RssAnon"], "rss_file": kib["RssFile"],
            "threads": int(fields["Threads"]), "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def children_rss(pid: int) -> int:
    """RSS of the server's child processes (chat template renderers)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except (FileNotFoundError, ProcessLookupError):  # the thread ended since the listing
            continue
        for child in children:
            try:
                total += proc_stats(int(child))["rss"]
            except (FileNotFoundError, ProcessLookupError, KeyError):
                pass
    return total


def ensure_export(path: Path | None) -> Path:
    """The export to soak: the given one, the default SmolLM2 export, else the micro family (built here)."""
    if path is not None:
        return path
    if (DEFAULT_EXPORT / "manifest.json").exists():
        return DEFAULT_EXPORT
    if not (MICRO_EXPORT / "manifest.json").exists():
        print("no default export: soaking the micro family instead", file=sys.stderr)
        from specdeploy.export.exporter import export_all
        from specdeploy.train.family import build_family

        family = REPO / "build" / "family" / "micro"
        build_family("micro", family, progress=lambda msg: None)
        export_all(family / "target", MICRO_EXPORT, draft=family / "draft", progress=lambda msg: None)
    return MICRO_EXPORT


# ------------------------------------------------------------------------------ traffic


@dataclass
class Tally:
    """What the clients saw; every field is guarded by `lock`."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    status: Counter = field(default_factory=Counter)  # HTTP status -> count
    kinds: Counter = field(default_factory=Counter)  # request kind -> count
    latency: list = field(default_factory=list)  # (finished at, seconds, streamed) of good requests
    ttft: list = field(default_factory=list)
    tokens: int = 0
    problems: list = field(default_factory=list)  # anything unexpected, with what was sent

    def problem(self, what: str) -> None:
        with self.lock:
            self.problems.append(what[:300])


def bad_requests(model: str, context: int, chat: bool = True) -> list[tuple[str, dict, int, str | None]]:
    """(name, request kwargs for httpx, expected status, expected error code); `chat`: the export has a
    chat template (without one every chat request is the same 400)."""
    ok = {"model": model, "prompt": "Hello", "max_tokens": 4}
    long_text = "the quick brown fox jumps over the lazy dog " * (context // 4)  # about 2.5x the context
    return [
        ("unknown method", {"json": {**ok, "method": "nope"}}, 400, "unknown_method"),
        ("top_p out of range", {"json": {**ok, "top_p": 5}}, 400, None),
        ("unknown model", {"json": {**ok, "model": "nope"}}, 404, "model_not_found"),
        ("prompt past the context", {"json": {**ok, "prompt": long_text}}, 400, "context_length_exceeded"),
        ("max_tokens past the context", {"json": {**ok, "max_tokens": context}}, 400, "context_length_exceeded"),
        *([("chat past the context", {"json": {"model": model, "messages": [{"role": "user", "content": long_text}]},
                                      "path": "/v1/chat/completions"}, 400, "context_length_exceeded"),
           ("no messages", {"json": {"model": model, "messages": []}, "path": "/v1/chat/completions"}, 400, None)]
          if chat else []),
        ("not JSON", {"content": b"prompt=hi", "headers": {"Content-Type": "text/plain"}}, 415,
         "unsupported_media_type"),
        ("malformed JSON", {"content": b'{"model": "x", "prompt": ', "headers": {"Content-Type": "application/json"}},
         400, None),
        ("oversized body", {"json": {**ok, "prompt": "x" * (1 << 20)}}, 413, "request_too_large"),
        ("too many stop strings", {"json": {**ok, "stop": [str(i) for i in range(100)]}}, 400, None),
    ]


def _events(lines) -> tuple[list[dict], bool]:
    """The JSON events of an SSE stream and whether it ended with [DONE]."""
    events, done = [], False
    for line in lines:
        if not line:
            continue
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            events.append(json.loads(line[6:]))
    return events, done


def _has_text(line: str) -> bool:
    if not line.startswith("data: {"):
        return False
    choices = json.loads(line[6:]).get("choices") or [{}]
    return bool(choices[0].get("text") or (choices[0].get("delta") or {}).get("content"))


class Client:
    def __init__(self, index: int, url: str, model: str, methods: list[str], context: int, tally: Tally,
                 bad_fraction: float, disconnect_fraction: float, chat: bool = True):
        self.rng = random.Random(index)
        self.http = httpx.Client(base_url=url, timeout=httpx.Timeout(300, connect=30))
        self.url, self.model, self.methods, self.tally = url, model, methods, tally
        self.chat_share = 0.5 if chat else 0.0  # of good and disconnecting requests
        self.bad = bad_requests(model, context, chat)
        self.bad_fraction, self.disconnect_fraction = bad_fraction, disconnect_fraction

    def run(self, deadline: float) -> None:
        try:
            while time.monotonic() < deadline:
                roll = self.rng.random()
                try:
                    if roll < self.bad_fraction:
                        self.send_bad()
                    elif roll < self.bad_fraction + self.disconnect_fraction:
                        self.disconnect()
                    else:
                        self.send_good()
                except Exception as exc:  # a client error nobody asked for is a finding
                    self.tally.problem(f"client error: {type(exc).__name__}: {exc}")
        finally:
            self.http.close()

    def _count(self, kind: str, status: int) -> None:
        with self.tally.lock:
            self.tally.kinds[kind] += 1
            self.tally.status[status] += 1

    def good_body(self, chat: bool, stream: bool, max_tokens: int) -> dict:
        rng = self.rng
        body = {"model": self.model, "max_tokens": max_tokens, "stream": stream, "method": rng.choice(self.methods)}
        if rng.random() < 0.5:
            body.update(temperature=0.8, seed=rng.randrange(1 << 30))
        else:
            body["temperature"] = 0
        if chat:
            body["messages"] = [{"role": "user", "content": rng.choice(CHAT)}]
        else:
            body["prompt"] = rng.choice(PROMPTS)
        if stream:
            body["stream_options"] = {"include_usage": True}  # the token count
        if rng.random() < 0.15:
            body["n"] = 2  # two generations under one admission (serve/choices.py): both freed however it ends
        return body

    def send_good(self) -> None:
        chat, stream = self.rng.random() < self.chat_share, self.rng.random() < 0.5
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = self.good_body(chat, stream, self.rng.randint(4, 24))
        t0 = time.perf_counter()
        ttft, tokens = None, 0
        if stream:
            with self.http.stream("POST", path, json=body) as resp:
                if resp.status_code != 200:
                    resp.read()
                    self._unexpected(body, resp)
                    return
                lines = []
                for line in resp.iter_lines():
                    lines.append(line)
                    if ttft is None and _has_text(line):
                        ttft = time.perf_counter() - t0
                events, done = _events(lines)
            errors = [e for e in events if "error" in e]
            finish = [c.get("finish_reason") for e in events for c in e.get("choices", ()) if c.get("finish_reason")]
            if errors or not done or len(finish) != body.get("n", 1) or not set(finish) <= {"length", "stop"}:
                self.tally.problem(f"stream {path} {body['method']}: errors {errors}, done {done}, finish {finish}")
            usage = [e["usage"] for e in events if e.get("usage")]
            tokens = usage[-1]["completion_tokens"] if usage else 0
        else:
            resp = self.http.post(path, json=body)
            if resp.status_code != 200:
                self._unexpected(body, resp)
                return
            answer = resp.json()
            finish = [c["finish_reason"] for c in answer["choices"]]
            if len(finish) != body.get("n", 1) or not set(finish) <= {"length", "stop"}:
                self.tally.problem(f"{path} {body['method']}: finish {finish}")
            tokens = answer["usage"]["completion_tokens"]
        latency = time.perf_counter() - t0
        self._count("stream" if stream else "non-stream", 200)
        with self.tally.lock:
            self.tally.latency.append((time.monotonic(), latency, stream))
            self.tally.tokens += tokens
            if ttft is not None:
                self.tally.ttft.append(ttft)

    def _unexpected(self, body: dict, resp: httpx.Response) -> None:
        self._count("good", resp.status_code)
        self.tally.problem(f"{body.get('method')} {resp.request.url.path}: {resp.status_code} {resp.text[:200]}")

    def disconnect(self) -> None:
        """A client that goes away: mid-stream after a chunk or two, or before a non-streaming answer."""
        chat = self.rng.random() < self.chat_share
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = {**self.good_body(chat, True, 256), "ignore_eos": True}
        if self.rng.random() < 0.7:
            with self.http.stream("POST", path, json=body) as resp:
                lines = resp.iter_lines()
                for _ in range(self.rng.randint(1, 3)):
                    next(lines, None)
                status = resp.status_code
            # leaving the block unread closes the connection: the server sees the disconnect
            self._count("disconnect mid-stream", status)
            if status != 200:
                self.tally.problem(f"disconnect {path}: {status}")
            return
        body["stream"] = False
        try:
            with httpx.Client(base_url=self.url, timeout=httpx.Timeout(30, read=self.rng.uniform(0.05, 1.0))) as c:
                resp = c.post(path, json=body)
        except httpx.ReadTimeout:
            self._count("disconnect waiting", 499)
            return
        self._count("disconnect waiting", resp.status_code)  # answered before the client gave up
        if resp.status_code != 200:
            self.tally.problem(f"disconnect {path}: {resp.status_code} {resp.text[:200]}")

    def send_bad(self) -> None:
        name, kwargs, status, code = self.rng.choice(self.bad)
        kwargs = dict(kwargs)
        path = kwargs.pop("path", "/v1/completions")
        resp = self.http.post(path, **kwargs)
        self._count(f"bad: {name}", resp.status_code)
        try:
            error = resp.json()["error"]
        except (ValueError, KeyError, TypeError):
            error = None
        if resp.status_code != status or error is None or (code is not None and error.get("code") != code):
            self.tally.problem(f"bad request '{name}': expected {status} {code}, got {resp.status_code} "
                               f"{resp.text[:200]}")


# ------------------------------------------------------------------------------ sampling and checks


def status_classes(status: Counter) -> dict:
    out = {"2xx": 0, "4xx": 0, "5xx": 0, "499 (client gave up)": 0}
    for code, n in status.items():
        if code == 499:
            out["499 (client gave up)"] += n
        else:
            out[f"{code // 100}xx"] = out.get(f"{code // 100}xx", 0) + n
    return out


class Sampler(threading.Thread):
    """Every `interval` s: the server's process stats, pool state, load and the outcomes so far."""

    def __init__(self, server: ServerProcess, tally: Tally, interval: float, t0: float):
        super().__init__(daemon=True)
        self.server, self.tally, self.interval, self.t0 = server, tally, interval, t0
        self.samples: list[dict] = []
        self.stop_event = threading.Event()
        self._seen = 0

    def sample(self) -> dict:
        now = time.monotonic()
        stats = proc_stats(self.server.proc.pid)
        health = self.server.health()
        with self.tally.lock:
            window = [lat for _, lat, _ in self.tally.latency[self._seen:]]
            self._seen = len(self.tally.latency)
            classes = status_classes(self.tally.status)
        row = {"t": round(now - self.t0, 1), "rss_mib": round(stats["rss"] / 2**20, 1),
               "anon_mib": round(stats["rss_anon"] / 2**20, 1), "file_mib": round(stats["rss_file"] / 2**20, 1),
               "children_rss_mib": round(children_rss(self.server.proc.pid) / 2**20, 1),
               "threads": stats["threads"], "fds": stats["fds"], "in_flight": health["in_flight"],
               "in_use": health["in_use"], "waiting": health["waiting"], "load1": os.getloadavg()[0],
               **classes, "done_in_window": len(window),
               "p50_s": round(percentile(window, 0.5), 3), "p99_s": round(percentile(window, 0.99), 3)}
        self.samples.append(row)
        return row

    def run(self) -> None:
        while not self.stop_event.wait(self.interval):
            row = self.sample()
            print(" ".join(f"{k}={v}" for k, v in row.items()), file=sys.stderr, flush=True)


def greedy_answers(url: str, model: str, methods: list[str]) -> dict:
    out = {}
    for method in methods:
        body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0, "method": method}
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        resp.raise_for_status()
        out[method] = resp.json()["choices"][0]["text"]
    return out


def wait_idle(server: ServerProcess, timeout: float) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        h = server.health()
        if h["in_use"] == 0 and h["waiting"] == 0 and h["in_flight"] == 0:
            return True
        time.sleep(0.2)
    return False


def rss_check(samples: list[dict], warmup_s: float, key: str = "anon_mib") -> dict:
    """Anonymous RSS after warm-up: growth from the first post-warm-up sample to the end, against the bound
    (`key="rss_mib"`: the same figures for the whole RSS, reported beside it)."""
    after = [s for s in samples if s["t"] >= warmup_s]
    if len(after) < 2:
        return {"ok": False, "why": "too few samples after warm-up (a longer run is needed)"}
    start, end = after[0][key], after[-1][key]
    peak = max(s[key] for s in after)
    bound = max(RSS_GROWTH_FRACTION * start, RSS_GROWTH_BYTES / 2**20)
    mid = after[len(after) // 2]

    def per_100(a: dict, b: dict) -> float | None:  # growth per 100 answered requests between two samples
        done = b["2xx"] - a["2xx"]
        return round(100 * (b[key] - a[key]) / done, 2) if done > 0 else None

    return {"ok": end - start <= bound and peak - start <= 2 * bound, "warm_mib": start, "end_mib": end,
            "peak_after_warmup_mib": peak, "growth_mib": round(end - start, 1), "bound_mib": round(bound, 1),
            "mib_per_100_requests": {"first_half": per_100(after[0], mid), "second_half": per_100(mid, after[-1])}}


def threads_flat(samples: list[dict]) -> bool:
    """The most threads seen in the second half of `samples` vs the first (THREAD_HALF_SAMPLES: too
    few samples judge nothing; `threads bounded under load` still does)."""
    half = len(samples) // 2
    if half < THREAD_HALF_SAMPLES:
        return True
    return max(s["threads"] for s in samples[half:]) <= max(s["threads"] for s in samples[:half]) + THREAD_SLACK


def soak(export: Path, seconds: float, clients: int, pool_size: int, interval: float, warmup_s: float | None,
         settle_s: float = 11.0, bad_fraction: float = 0.12, disconnect_fraction: float = 0.08,
         batch: int = 0) -> dict:
    """`settle_s`: how long the server idles before its last sample (its thread pool's idle threads end
    after 10 s). `batch`: serve with continuous batching (`serve --batch N`) instead of a pool."""
    warmup_s = min(120.0, seconds / 4) if warmup_s is None else warmup_s
    mode = ["--batch", str(batch)] if batch else ["--pool-size", str(pool_size)]
    # Queue room for every client, and a queue timeout past any wait: a 429 or 504 would be a finding.
    with ServerProcess(export, *mode, "--queue", str(2 * clients),
                       "--queue-timeout", "600", "--log-level", "error") as server:
        card = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
        model, methods, context = card["id"], card["methods"], card["max_context"]
        before = greedy_answers(server.url, model, methods)  # also warms every method's graphs
        idle_before = proc_stats(server.proc.pid)
        tally = Tally()
        t0 = time.monotonic()
        sampler = Sampler(server, tally, interval, t0)
        sampler.sample()
        sampler.start()
        chat = ChatTemplate.from_tokenizer_dir(export / "tokenizer") is not None
        pool = [Client(i, server.url, model, methods, context, tally, bad_fraction, disconnect_fraction, chat)
                for i in range(clients)]
        threads = [threading.Thread(target=c.run, args=(t0 + seconds,), daemon=True) for c in pool]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t0
        idle = wait_idle(server, 60)
        sampler.stop_event.set()
        sampler.join()
        time.sleep(max(0.0, settle_s - (time.monotonic() - t0 - elapsed)))
        final = sampler.sample()
        idle_after = proc_stats(server.proc.pid)
        after = greedy_answers(server.url, model, methods)
    log = server.log_path.read_text()

    lat = [x for _, x, _ in tally.latency]
    samples = sampler.samples
    under_load = [s for s in samples[:-1] if s["t"] >= warmup_s] or samples
    checks = {
        "no 5xx": status_classes(tally.status)["5xx"] == 0,
        "no unexpected outcome": not tally.problems,
        "pool idle afterwards": idle,
        "anonymous RSS flat after warm-up": rss_check(samples[:-1], warmup_s)["ok"],
        "fds back to idle": idle_after["fds"] <= idle_before["fds"] + FD_SLACK,
        "threads flat under load": threads_flat(under_load),
        "threads bounded under load": max(s["threads"] for s in samples)
        <= idle_before["threads"] + THREADS_PER_CLIENT * clients + THREAD_SLACK,
        "threads bounded when idle": idle_after["threads"] <= max(s["threads"] for s in under_load) + THREAD_SLACK,
        "greedy answers unchanged": before == after,
        "no traceback in the log": "Traceback" not in log,
    }
    return {
        "export": str(export), "seconds": round(elapsed, 1), "clients": clients,
        **({"batch": batch} if batch else {"pool_size": pool_size}),
        "methods": methods, "warmup_s": warmup_s,
        "requests": sum(tally.kinds.values()), "kinds": dict(tally.kinds),
        "status": {str(k): v for k, v in sorted(tally.status.items())}, "classes": status_classes(tally.status),
        "latency_s": {q: round(percentile(lat, v), 3) for q, v in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
        "ttft_s": {q: round(percentile(tally.ttft, v), 3) for q, v in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
        "tokens_per_s": round(tally.tokens / elapsed, 1),
        "anon_rss": rss_check(samples[:-1], warmup_s), "rss": rss_check(samples[:-1], warmup_s, "rss_mib"),
        "idle_before": idle_before, "idle_after": idle_after,
        "threads_max_under_load": max(s["threads"] for s in under_load), "final_sample": final,
        "load_avg_end": os.getloadavg(), "problems": tally.problems[:20], "problem_count": len(tally.problems),
        "checks": checks, "ok": all(checks.values()), "samples": samples,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--export", type=Path, help="default: build/export/default, else the micro family")
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--pool-size", type=int, default=2)
    p.add_argument("--batch", type=int, default=0, help="serve --batch N (continuous batching) instead of a pool")
    p.add_argument("--interval", type=float, default=10, help="seconds between samples")
    p.add_argument("--warmup", type=float, help="seconds before RSS must stay flat (default: a quarter, <= 120)")
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args(argv)
    report = soak(ensure_export(args.export), args.seconds, args.clients, args.pool_size, args.interval, args.warmup,
                  batch=args.batch)
    text = json.dumps(report, indent=2)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=2))
    failed = [name for name, ok in report["checks"].items() if not ok]
    print("soak: " + ("every check passed" if not failed else "FAILED: " + ", ".join(failed)), file=sys.stderr)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
