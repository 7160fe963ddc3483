"""Who may call the server and what a request may cost it: API key, browser origins, Content-Type,
the bind warning, and chat templates that try to take the server down."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from conftest import run_cli
from serve_util import ServerProcess, clone_export, metric_value

KEY = "s3cret-key"
EVIL = "http://evil.example"
APP = "http://app.example"


@pytest.fixture(scope="module")
def keyed_server(micro_export):
    """API key from the environment variable."""
    with ServerProcess(micro_export, env={"SPECDEPLOY_API_KEY": KEY},
                       headers={"Authorization": f"Bearer {KEY}"}) as srv:
        yield srv


@pytest.fixture(scope="module")
def cors_server(micro_export):
    """API key from the option, one allowed browser origin."""
    with ServerProcess(micro_export, "--api-key", KEY, "--allowed-origins", APP) as srv:
        yield srv


@pytest.fixture(scope="module")
def open_server(micro_export):
    """The defaults: loopback, no key, no CORS."""
    with ServerProcess(micro_export) as srv:
        yield srv


def _completion(srv, headers: dict | None = None, **kw) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/completions", json={"model": "micro", "prompt": "hi", "max_tokens": 2},
                      headers=headers, timeout=30, **kw)


def test_api_key_is_required(keyed_server):
    for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic " + KEY}):
        resp = _completion(keyed_server, headers)
        assert resp.status_code == 401, headers
        assert resp.json()["error"]["code"] == "invalid_api_key" and resp.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{keyed_server.url}/v1/models").status_code == 401
    assert httpx.get(f"{keyed_server.url}/metrics").status_code == 401
    assert httpx.get(f"{keyed_server.url}/health").status_code == 200  # probes need no credentials
    client = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model="micro", prompt="hi", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key="nope", max_retries=0).models.list()
    metrics = keyed_server.metrics(headers={"Authorization": f"Bearer {KEY}"})
    assert metric_value(metrics, "specdeploy_requests_total", endpoint="/v1/completions", status="401") == 4


def test_no_cors_by_default_and_foreign_origins_are_refused(open_server):
    # a page on another origin: its "simple" POST (no preflight) must not run a generation
    plain = httpx.post(f"{open_server.url}/v1/completions", content=b'{"model": "micro", "prompt": "hi"}',
                       headers={"Origin": EVIL, "Content-Type": "text/plain"}, timeout=30)
    assert plain.status_code == 403 and plain.json()["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in plain.headers
    preflight = httpx.options(f"{open_server.url}/v1/completions", headers={
        "Origin": EVIL, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
    assert preflight.status_code >= 400 and "access-control-allow-origin" not in preflight.headers
    # DNS rebinding makes the page "same-origin"; its Origin header still names it
    assert _completion(open_server, {"Origin": f"http://127.0.0.1:{open_server.port}"}).status_code == 403
    assert _completion(open_server).status_code == 200  # non-browser clients send no Origin


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_json_content_type_is_required(open_server, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    resp = httpx.post(f"{open_server.url}/v1/chat/completions", timeout=30, headers=headers,
                      content=b'{"model": "micro", "messages": [{"role": "user", "content": "hi"}]}')
    assert resp.status_code == 415 and resp.json()["error"]["code"] == "unsupported_media_type"


def test_allowed_origins_get_cors(cors_server):
    preflight = httpx.options(f"{cors_server.url}/v1/chat/completions", headers={
        "Origin": APP, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == APP
    resp = _completion(cors_server, {"Origin": APP, "Authorization": f"Bearer {KEY}"})
    assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == APP
    assert "x-request-id" in resp.headers["access-control-expose-headers"].lower()
    assert _completion(cors_server, {"Origin": APP}).status_code == 401  # an allowed origin still needs the key
    assert _completion(cors_server, {"Origin": EVIL, "Authorization": f"Bearer {KEY}"}).status_code == 403


def test_binding_beyond_loopback_without_a_key_warns(micro_export):
    # --max-model-len past the export stops the server before it binds anything
    proc = run_cli("serve", micro_export, "--host", "0.0.0.0", "--port", "0", "--max-model-len", "999999",
                   env={"SPECDEPLOY_API_KEY": ""}, timeout=120)
    assert "warning: serving on 0.0.0.0" in proc.stderr and "--api-key" in proc.stderr
    quiet = run_cli("serve", micro_export, "--host", "0.0.0.0", "--port", "0", "--max-model-len", "999999",
                    env={"SPECDEPLOY_API_KEY": KEY}, timeout=120)
    assert "warning" not in quiet.stderr and quiet.returncode == 2
    from specdeploy.serve.main import is_loopback

    assert all(map(is_loopback, ["127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "192.168.1.5", "example.com"]))


# ------------------------------------------------------------------------------ hostile chat templates

# One template, four behaviours picked by the message: spin for hours, allocate gigabytes, refuse, or echo.
HOSTILE_TEMPLATE = (
    "{% set text = messages[0]['content'] %}"
    "{% if text == 'spin' %}{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    "{% elif text == 'hog' %}{{ ('a' * 3000000000) | length }}"
    "{% elif text == 'refuse' %}{{ raise_exception('this template refuses') }}"
    "{% else %}{{ ('a' * 10**7) | length }} {{ text }}{% endif %}"
)


@pytest.fixture(scope="module")
def hostile_server(micro_export, tmp_path_factory):
    export = clone_export(micro_export, tmp_path_factory.mktemp("hostile") / "hostile")
    (export / "tokenizer" / "chat_template.jinja").write_text(HOSTILE_TEMPLATE)
    with ServerProcess(export, "--template-timeout", "1") as srv:
        yield srv


def _chat(srv, text: str) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/chat/completions", timeout=30, json={
        "model": "hostile", "messages": [{"role": "user", "content": text}], "max_tokens": 2})


def test_a_template_that_spins_is_stopped_and_the_server_stays_responsive(hostile_server):
    latencies, done = [], threading.Event()

    def probe():
        while not done.is_set():
            t0 = time.perf_counter()
            assert httpx.get(f"{hostile_server.url}/health", timeout=10).status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.05)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        t0 = time.monotonic()
        spun = _chat(hostile_server, "spin")
        took = time.monotonic() - t0
    finally:
        done.set()
        prober.join()
    assert spun.status_code == 500 and spun.json()["error"]["code"] == "chat_template_timeout", spun.text
    assert spun.json()["error"]["type"] == "internal_error" and took < 5
    assert len(latencies) >= 5 and max(latencies) < 0.5  # /health answered all along
    assert _chat(hostile_server, "spin").status_code == 500  # again: the killed renderer was replaced
    assert _chat(hostile_server, "fine").status_code == 200


def test_a_template_that_hogs_memory_or_refuses(hostile_server):
    hog = _chat(hostile_server, "hog")
    assert hog.status_code == 500 and hog.json()["error"]["code"] == "chat_template_failed", hog.text
    refused = _chat(hostile_server, "refuse")
    assert refused.status_code == 400 and "this template refuses" in refused.json()["error"]["message"]
    ok = _chat(hostile_server, "fine")
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] > 3
    assert hostile_server.health()["status"] == "ok"
