"""Prometheus metrics of one server (its own registry: several apps can live in one process)."""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ACCEPT_BUCKETS = (1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 8, 12, 16)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, service):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("specdeploy_requests", "HTTP requests by endpoint and outcome (the status code; "
                                "a stream that failed after its headers counts with its error's status)",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("specdeploy_request_latency_seconds",
                                 "End-to-end latency of successful generation requests (to the last byte)",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("specdeploy_time_to_first_token_seconds", "Time to the first streamed token",
                              ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("specdeploy_queue_wait_seconds", "Time a request waited for a free worker",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.generated = Counter("specdeploy_generated_tokens", "Tokens generated", ["method"], registry=r)
        self.prompt = Counter("specdeploy_prompt_tokens", "Prompt tokens processed", ["method"], registry=r)
        self.acceptance = Histogram("specdeploy_acceptance_length",
                                    "Tokens committed per target call, one observation per request",
                                    ["method"], buckets=ACCEPT_BUCKETS, registry=r)
        self.finished = Counter("specdeploy_generations", "Finished generations by finish reason",
                                ["method", "finish_reason"], registry=r)
        Gauge("specdeploy_queue_depth", "Requests waiting for a free worker", registry=r).set_function(
            lambda: service.pool.waiting)
        Gauge("specdeploy_workers_busy", "Workers (export instances) serving a request", registry=r).set_function(
            lambda: service.pool.in_use)
        Gauge("specdeploy_workers", "Workers (export instances) in the pool", registry=r).set(service.pool.size)
        # a batched service: the speculation gate's measured speculating / plain rate per batch size
        self.gate = getattr(service.pool.exports[0], "gate", None) if service.pool.exports else None
        self.gate_ratio = Gauge("specdeploy_speculation_gate_ratio",
                                "Batched serving: tokens per row-second speculating over decoding plainly, as "
                                "measured by the speculation gate, by batch size (rows, a power-of-two range)",
                                ["rows"], registry=r)

    def render(self) -> bytes:
        if self.gate is not None:
            for bits, entry in self.gate.state().items():
                self.gate_ratio.labels(rows=f"{1 << (bits - 1)}-{(1 << bits) - 1}").set(entry["ratio"])
        return generate_latest(self.registry)

    def observe_generation(self, request) -> None:
        """Called from the worker thread once a request has released its worker."""
        s = request.stats
        method = request.method
        self.finished.labels(method, request.finish_reason).inc()
        if s.get("queue_s") is not None:
            self.queue_wait.observe(s["queue_s"])
        self.generated.labels(method).inc(s.get("new_tokens", 0))
        self.prompt.labels(method).inc(s.get("prompt_processed", 0))  # a cancelled prefill counts its part
        if s.get("target_calls"):
            self.acceptance.labels(method).observe(s.get("acceptance_length", 0.0))


class MetricsMiddleware:
    """Counts every HTTP response by endpoint and outcome; times successful generation requests.

    The outcome is the HTTP status, except for a stream that ended badly after its headers
    went out as 200: the app records that outcome (an in-band error's status, or 499 when
    the client went away) in `scope["state"]["outcome"]`.
    """

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS or path.startswith("/v1/models/") else "other"
        endpoint = "/v1/models" if endpoint.startswith("/v1/models/") else endpoint
        state = scope.setdefault("state", {})
        start = time.perf_counter()
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            outcome = state.get("outcome") or status[0]
            self.metrics.requests.labels(endpoint, str(outcome)).inc()
            if outcome == 200 and endpoint in ("/v1/completions", "/v1/chat/completions"):
                self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)
