"""Whose fault: internal faults are 5xx (`internal_error`), the client's are 4xx; streams always end
with [DONE]; /metrics counts errors as errors; serve-time limits; request ids."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest
from conftest import run_cli
from serve_util import ServerProcess, break_decode_graphs, clone_export, metric_value

PROMPT_IDS = [5, 6, 7, 8]
FIRST_BAD_POSITION = 10  # the broken export decodes positions 3..9 (7 tokens), then ONNX Runtime fails


@pytest.fixture(scope="module")
def broken_server(micro_export, tmp_path_factory):
    export = clone_export(micro_export, tmp_path_factory.mktemp("broken") / "broken")
    break_decode_graphs(export, FIRST_BAD_POSITION)
    # ar: the broken graphs are the one-token ones, which a speculative default would call only in plain steps
    with ServerProcess(export, "--method", "ar", "--pool-size", "1", "--queue", "4", "--log-level", "info") as srv:
        yield srv


def _post(srv, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30, **kw)


def _delta(before: str, after: str, name: str, **labels) -> float:
    return metric_value(after, name, **labels) - metric_value(before, name, **labels)


def test_internal_fault_is_a_500_and_counted_as_an_error(broken_server):
    before = broken_server.metrics()
    resp = _post(broken_server, {"model": "broken", "prompt": PROMPT_IDS, "max_tokens": 40, "temperature": 0},
                 headers={"X-Request-Id": "fault-1"})
    assert resp.status_code == 500, resp.text
    assert resp.headers["x-request-id"] == "fault-1"
    err = resp.json()["error"]
    assert err["type"] == "internal_error" and err["code"] == "internal_error"
    assert "fault-1" in err["message"]  # what an operator greps the log for
    assert "Gather" not in err["message"] and "Traceback" not in err["message"]
    short = _post(broken_server, {"model": "broken", "prompt": PROMPT_IDS, "max_tokens": 3, "temperature": 0})
    assert short.status_code == 200  # the same request, short enough to avoid the fault, is fine
    after = broken_server.metrics()
    assert _delta(before, after, "specdeploy_requests_total", endpoint="/v1/completions", status="500") == 1
    assert _delta(before, after, "specdeploy_requests_total", endpoint="/v1/completions", status="400") == 0
    assert _delta(before, after, "specdeploy_generations_total", finish_reason="error") == 1
    assert _delta(before, after, "specdeploy_generations_total", finish_reason="cancelled") == 0
    assert _delta(before, after, "specdeploy_request_latency_seconds_count", endpoint="/v1/completions") == 1
    log = broken_server.log()
    assert "fault-1" in log and "Traceback" in log and "indices element out of data bounds" in log


def test_stream_fault_is_reported_in_band_and_still_ends_with_done(broken_server):
    before = broken_server.metrics()
    body = {"model": "broken", "prompt": PROMPT_IDS, "max_tokens": 40, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{broken_server.url}/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200  # headers went out before the fault
        events = [line for line in resp.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert error["type"] == "internal_error" and error["code"] == "internal_error"
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-2])
    assert text  # tokens before the fault were delivered
    after = broken_server.metrics()
    assert _delta(before, after, "specdeploy_requests_total", endpoint="/v1/completions", status="500") == 1
    assert _delta(before, after, "specdeploy_requests_total", endpoint="/v1/completions", status="200") == 0
    assert _delta(before, after, "specdeploy_request_latency_seconds_count", endpoint="/v1/completions") == 0
    assert _delta(before, after, "specdeploy_generations_total", finish_reason="error") == 1
    # the official client surfaces the in-band error as an exception
    client = openai.OpenAI(base_url=f"{broken_server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIError, match="internal error"):
        list(client.completions.create(model="broken", prompt=PROMPT_IDS, max_tokens=40, temperature=0, stream=True))
    assert broken_server.health()["in_use"] == 0


def test_deeply_nested_json_is_the_clients_fault(broken_server):
    for depth in (65, 100_000):
        raw = b'{"model": ' + b"[" * depth + b"]" * depth + b"}"
        resp = httpx.post(f"{broken_server.url}/v1/completions", content=raw, timeout=30,
                          headers={"content-type": "application/json"})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["code"] == "invalid_json"
    assert "RecursionError" not in broken_server.log()


def test_request_ids_are_accepted_returned_and_logged(broken_server):
    body = {"model": "broken", "prompt": PROMPT_IDS, "max_tokens": 2}
    given = _post(broken_server, body, headers={"X-Request-Id": "client-id.42"})
    assert given.headers["x-request-id"] == "client-id.42"
    made = _post(broken_server, body).headers["x-request-id"]
    assert len(made) == 32
    odd = _post(broken_server, body, headers={"X-Request-Id": "bad id\twith spaces"}).headers["x-request-id"]
    assert odd != "bad id\twith spaces" and len(odd) == 32  # replaced, never echoed into our logs
    error = _post(broken_server, {"model": "broken", "prompt": "x", "top_p": 5}, headers={"X-Request-Id": "bad-1"})
    assert error.status_code == 400 and error.headers["x-request-id"] == "bad-1"
    time.sleep(0.2)
    log = broken_server.log()
    assert "request client-id.42: POST /v1/completions -> 200" in log and "request bad-1: POST" in log


# ------------------------------------------------------------------------------ serve-time limits


@pytest.fixture(scope="module")
def limited_server(micro_export):
    with ServerProcess(micro_export, "--max-model-len", "64", "--max-tokens", "8", "--max-stop", "2",
                       "--max-stop-chars", "8", "--max-body-bytes", "4096", "--body-timeout", "1",
                       "--max-header-bytes", "8192", "--header-timeout", "2") as srv:
        yield srv


@pytest.mark.parametrize("body, param, code", [
    ({"prompt": [5] * 64}, "prompt", "context_length_exceeded"),
    ({"prompt": [5] * 60, "max_tokens": 5}, "max_tokens", "context_length_exceeded"),
    ({"prompt": "x", "max_tokens": 9}, "max_tokens", "invalid_value"),
    ({"prompt": "x", "stop": ["a", "b", "c"]}, "stop", "invalid_value"),
    ({"prompt": "x", "stop": "123456789"}, "stop", "invalid_value"),
])
def test_limits_refuse_with_400(limited_server, body, param, code):
    resp = _post(limited_server, {"model": "micro", **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param and resp.json()["error"]["code"] == code


def test_limits_shape_what_is_served(limited_server):
    client = openai.OpenAI(base_url=f"{limited_server.url}/v1", api_key="unused", max_retries=0)
    assert client.models.retrieve("micro").model_extra["max_context"] == 64
    resp = client.completions.create(model="micro", prompt="Once upon a time", temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 8  # the default is capped by --max-tokens
    resp = client.completions.create(model="micro", prompt="Once", max_tokens=8, stop=["12345678", "\x00"])
    assert resp.usage.completion_tokens <= 8
    big = json.dumps({"model": "micro", "prompt": "a" * 5000}).encode()
    resp = httpx.post(f"{limited_server.url}/v1/completions", content=big, timeout=30,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"


def test_slow_body_times_out(limited_server):
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", limited_server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\":")
        answer = b""
        while b"request_timeout" not in answer and (chunk := sock.recv(4096)):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
    assert time.monotonic() - t0 < 5


def _closing_answer(srv, request: bytes) -> tuple[bytes, bytes]:
    """(head, body) of what the server answers `request` sent raw, read until it closes."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return head, body


def test_slow_head_times_out(limited_server):
    t0 = time.monotonic()
    head, body = _closing_answer(limited_server, b"GET /health HTTP/1.1\r\nHost")
    assert head.startswith(b"HTTP/1.1 408") and json.loads(body)["error"]["code"] == "request_timeout"
    assert 1.5 < time.monotonic() - t0 < 8


def test_idle_connections_do_not_shut_out_clients(limited_server):
    """Sockets that send nothing (or half a request line) used to stay open for good, and past uvicorn's
    connection limit (92 here) every client, /health included, got a plain-text 503."""
    idle = [socket.create_connection(("127.0.0.1", limited_server.port), timeout=10) for _ in range(150)]
    try:
        for sock in idle[::2]:
            sock.sendall(b"POST /v1/compl")
        time.sleep(0.3)
        assert httpx.get(f"{limited_server.url}/health", timeout=10).status_code == 200
        assert _post(limited_server, {"model": "micro", "prompt": "x", "max_tokens": 2}).status_code == 200
        for sock in idle:  # each closed after --header-timeout: a 408 where it had begun a head
            answer = b""
            while chunk := sock.recv(4096):
                answer += chunk
            assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer[:80]
    finally:
        for sock in idle:
            sock.close()


@pytest.mark.parametrize("size", [9000, 300_000, 4_000_000])
def test_oversized_headers_get_a_431_not_a_reset(limited_server, size):
    """Over --max-header-bytes, whether the parser took the head whole (9 KB) or gave up while the
    client was still sending (300 KB, 4 MB: it used to close at once, and the client read a reset)."""
    body = {"model": "micro", "prompt": "x", "max_tokens": 2}
    resp = _post(limited_server, body, headers={"X-Big": "a" * size})
    assert resp.status_code == 431, resp.text
    assert resp.json()["error"]["code"] == "headers_too_large" and "8192" in resp.json()["error"]["message"]
    assert _post(limited_server, body, headers={"X-Fine": "a" * 4000}).status_code == 200


def test_malformed_request_gets_a_json_400(limited_server):
    head, body = _closing_answer(limited_server, b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and json.loads(body)["error"]["code"] == "invalid_http_request"


def test_max_model_len_beyond_the_export_is_refused_at_start(micro_export):
    proc = run_cli("serve", micro_export, "--port", "0", "--max-model-len", "100000", timeout=120)
    assert proc.returncode == 2 and "max context" in proc.stderr and "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------ what the server cannot honour

CHAT = {"model": "micro", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("fields, param", [
    ({"functions": [{"name": "f", "parameters": {}}], "function_call": {"name": "f"}}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
])
def test_chat_fields_it_cannot_honour_are_refused(limited_server, fields, param):
    """Legacy function calling, audio output and the like used to be ignored: a 200 with plain text."""
    resp = httpx.post(f"{limited_server.url}/v1/chat/completions", json={**CHAT, **fields}, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "unsupported_parameter"
    assert error["param"] == param and f"'{param}'" in error["message"]


@pytest.mark.parametrize("fields", [
    {"functions": [], "function_call": "none"}, {"modalities": ["text"]}, {"function_call": "auto"},
    {"user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "parallel_tool_calls": True,
     "prediction": {"type": "content", "content": "hi"}},
])
def test_chat_fields_that_change_nothing_are_accepted(limited_server, fields):
    # past validation, this export's missing chat template is what answers
    resp = httpx.post(f"{limited_server.url}/v1/chat/completions", json={**CHAT, **fields}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "no_chat_template", resp.text


def test_completion_suffix_is_refused(limited_server):
    resp = _post(limited_server, {"model": "micro", "prompt": "x", "suffix": "end"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "suffix", resp.text


@pytest.mark.parametrize("encoding", ["gzip", "br", "deflate, gzip"])
def test_compressed_body_gets_a_415(limited_server, encoding):
    import gzip

    raw = gzip.compress(json.dumps({"model": "micro", "prompt": "x", "max_tokens": 2}).encode())
    resp = httpx.post(f"{limited_server.url}/v1/completions", content=raw, timeout=30,
                      headers={"content-type": "application/json", "content-encoding": encoding})
    assert resp.status_code == 415, resp.text
    error = resp.json()["error"]
    assert error["code"] == "unsupported_content_encoding" and error["type"] == "invalid_request_error"
    assert f"Content-Encoding {encoding} is not supported; send the body uncompressed" == error["message"]
    plain = json.dumps({"model": "micro", "prompt": "x", "max_tokens": 2}).encode()
    resp = httpx.post(f"{limited_server.url}/v1/completions", content=plain, timeout=30,
                      headers={"content-type": "application/json", "content-encoding": "identity"})
    assert resp.status_code == 200, resp.text
