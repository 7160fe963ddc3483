"""ray_failover.ReplicaFailover as a plain ASGI middleware (no Ray): what the proxy sees when a replica dies.
The last test puts the real app (micro export) behind it."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from specdeploy.serve.ray_failover import PROXY_BODY_KEY, ReplicaFailover

BODY = [{"type": "http.request", "body": b'{"prompt": ', "more_body": True},
        {"type": "http.request", "body": b'"hi"}', "more_body": False}]


def run(app, path="/v1/completions", disconnect_after_body=False, body=BODY, chunk_delay_s=0.0, **failover):
    incoming = list(body)
    sent = []

    async def receive():
        if incoming:
            if len(incoming) < len(body):
                await asyncio.sleep(chunk_delay_s)  # a slow client: each chunk after the first comes late
            return incoming.pop(0)
        if disconnect_after_body:
            return {"type": "http.disconnect"}
        await asyncio.sleep(3600)  # the client waits for its answer

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": []}
    asyncio.run(ReplicaFailover(app, retry_delay_s=0.01, **failover)(scope, receive, send))
    return sent


class Replicas:
    """Each call is one attempt: `fail` attempts return without a response (a dead replica), the rest answer."""

    def __init__(self, fail: int, stream=False):
        self.fail, self.stream, self.bodies = fail, stream, []

    async def __call__(self, scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.bodies.append(body)
        try:  # Ray's proxy listens for the client's disconnect while the request runs
            await asyncio.wait_for(receive(), 0.01)
        except asyncio.TimeoutError:
            pass
        if len(self.bodies) <= self.fail:
            return
        headers = [(b"content-type", b"text/event-stream" if self.stream else b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if self.stream:  # a stream whose replica dies after its first event
            await send({"type": "http.response.body", "body": b'data: {"choices": []}\n\n', "more_body": True})
            return
        await send({"type": "http.response.body", "body": b'{"ok": true}', "more_body": False})


def test_a_request_without_response_is_resent_with_its_body():
    app = Replicas(fail=2)
    sent = run(app)
    assert app.bodies == [b'{"prompt": "hi"}'] * 3
    assert sent[0]["status"] == 200 and sent[-1]["body"] == b'{"ok": true}'


def test_after_every_attempt_failed_the_client_gets_503():
    sent = run(Replicas(fail=10))
    assert sent[0]["status"] == 503
    assert json.loads(sent[1]["body"])["error"]["code"] == "replica_unavailable"


def test_a_stream_cut_after_its_headers_ends_with_an_error_event_and_done():
    app = Replicas(fail=0, stream=True)
    sent = run(app)
    assert len(app.bodies) == 1, "never resent once headers went out"
    tail = sent[-1]
    assert tail["more_body"] is False
    events = [e for e in tail["body"].decode().split("\n\n") if e]
    assert json.loads(events[0][len("data: "):])["error"]["code"] == "replica_failed"
    assert events[-1] == "data: [DONE]"


def test_a_client_that_left_is_not_resent_and_other_paths_pass_through():
    app = Replicas(fail=1)
    assert run(app, disconnect_after_body=True) == [] and len(app.bodies) == 1
    app = Replicas(fail=1)
    assert run(app, path="/health") == [] and len(app.bodies) == 1


class RayRetry:
    """Ray's own retry: the first replica pulled the body from the proxy's queue (each message is given once)
    and died before its acceptance arrived, so the router sent the same request to `app` on a second
    replica, whose receive channel never delivers a body again."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        while (await receive()).get("more_body"):
            pass

        async def drained():
            await asyncio.sleep(3600)

        await self.app(scope, drained, send)


async def answer_from_scope(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": scope[PROXY_BODY_KEY], "more_body": False})


def test_the_body_travels_in_the_scope_so_a_retried_replica_has_it():
    sent = run(RayRetry(answer_from_scope))
    assert sent[0]["status"] == 200 and sent[1]["body"] == b'{"prompt": "hi"}'


@pytest.mark.parametrize("slow", [{"preread_bytes": 8}, {"preread_timeout_s": 0.05, "chunk_delay_s": 0.2}],
                         ids=["over the size", "over the time"])
def test_a_body_past_the_preread_limits_goes_the_usual_way(slow):
    app = Replicas(fail=1)
    sent = run(app, **slow)
    assert app.bodies == [b'{"prompt": "hi"}'] * 2 and sent[0]["status"] == 200


@pytest.fixture(scope="module")
def service(micro_export):
    from specdeploy.runtime.service import Service

    return Service.load(micro_export, pool_size=1, queue_size=1)


def test_the_real_app_answers_a_request_ray_retried(service):
    """Regression: a request Ray retried on a second replica got 408 ('the request body did not arrive')."""
    from specdeploy.serve.app import create_app
    from specdeploy.serve.limits import ServeLimits

    app = create_app(service, model_name="m", limits=ServeLimits(body_timeout_s=1.0))
    body = {"model": "m", "prompt": "def main():", "max_tokens": 4, "temperature": 0}

    async def post(asgi):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://t") as client:
            return await client.post("/v1/completions", json=body)

    direct = asyncio.run(post(app))
    retried = asyncio.run(post(ReplicaFailover(RayRetry(app))))
    assert direct.status_code == 200 and retried.status_code == 200, retried.text
    assert retried.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]
