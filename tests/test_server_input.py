"""What a client may send, on the real app (in process, over ASGI): text that is not text (a lone
surrogate, valid JSON) is a 400 naming its field wherever it is, chat roles and content are checked,
OpenAI's values (top_p 0, the seed's range) are served as OpenAI defines them, and a fault of ours
is one JSON 500 with one traceback, logged with its status."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
from serve_util import clone_export
from test_chat import CHATML

MODEL = "m"


@pytest.fixture(scope="module")
def app(micro_export, tmp_path_factory):
    from specdeploy.runtime.service import Service
    from specdeploy.serve.app import create_app

    export = clone_export(micro_export, tmp_path_factory.mktemp("input") / "chatml")
    (export / "tokenizer" / "chat_template.jinja").write_text(CHATML)
    app = create_app(Service.load(export, pool_size=1, queue_size=4), model_name=MODEL)

    async def boom():  # stands in for a bug of ours in an endpoint
        raise RuntimeError("a bug of ours")

    app.add_api_route("/v1/boom", boom, methods=["GET"])
    yield app
    app.state.server.chat.close()  # the template's render processes (the lifespan would, under uvicorn)


def call(app, method: str, path: str, body: dict | None = None) -> httpx.Response:
    """One request through the whole ASGI stack; an exception the app lets out fails the test (uvicorn
    would log it a second time as "Exception in ASGI application")."""
    async def go():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=True)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            content = None if body is None else json.dumps(body).encode()  # "\\ud800": escaped, as clients send it
            return await client.request(method, path, content=content, timeout=60,
                                        headers={"content-type": "application/json"})

    return asyncio.run(go())


def _error(resp: httpx.Response, status: int, param, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    assert code is None or err["code"] == code, err
    return err


def _chat(content="hi", role="user", **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": role, "content": content}], "max_tokens": 2, **extra}


SURROGATE = "ok \ud800"
LONE_SURROGATES = [
    ("/v1/completions", {"model": MODEL, "prompt": SURROGATE, "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"model": SURROGATE, "prompt": "hi"}, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["a", SURROGATE]}, "stop[1]"),
    ("/v1/chat/completions", _chat(SURROGATE), "messages[0].content"),
    ("/v1/chat/completions", _chat([{"type": "text", "text": "a"}, {"type": "text", "text": SURROGATE}]),
     "messages[0].content[1].text"),
    ("/v1/chat/completions", _chat(role=SURROGATE), "messages[0].role"),
    ("/v1/chat/completions", _chat(user=SURROGATE), "user"),
]


@pytest.mark.parametrize("path, body, param", LONE_SURROGATES, ids=[p for _, _, p in LONE_SURROGATES])
def test_a_lone_surrogate_anywhere_is_a_400_naming_its_field(app, path, body, param):
    err = _error(call(app, "POST", path, body), 400, param, "invalid_value")
    assert "not valid UTF-8" in err["message"] and "U+D800" in err["message"]


def test_chat_roles_and_content_are_checked(app):
    err = _error(call(app, "POST", "/v1/chat/completions", _chat(role="wizard")), 400, "messages[0].role")
    assert "'user'" in err["message"] and "wizard" in err["message"]
    missing = {"model": MODEL, "messages": [{"role": "user"}], "max_tokens": 2}
    _error(call(app, "POST", "/v1/chat/completions", missing), 400, "messages[0].content",
           "missing_required_parameter")
    _error(call(app, "POST", "/v1/chat/completions", _chat(None, "system")), 400, "messages[0].content",
           "invalid_type")
    # what the template renders keeps working: an assistant turn without content, a developer turn
    ok = {"model": MODEL, "max_tokens": 2, "temperature": 0,
          "messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"},
                       {"role": "assistant", "content": None}, {"role": "user", "content": "again"}]}
    assert call(app, "POST", "/v1/chat/completions", ok).status_code == 200


def test_top_p_zero_is_the_most_probable_token_and_seed_range_names_seed(app):
    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 6, "ignore_eos": True}
    greedy = call(app, "POST", "/v1/completions", {**body, "temperature": 0})
    top = call(app, "POST", "/v1/completions", {**body, "temperature": 1.5, "top_p": 0, "seed": 3})
    assert greedy.status_code == 200 and top.status_code == 200, top.text
    assert top.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    err = _error(call(app, "POST", "/v1/completions", {**body, "seed": 2**64}), 400, "seed", "invalid_value")
    assert "18446744073709551616" in err["message"]
    assert call(app, "POST", "/v1/completions", {**body, "seed": 2**64 - 1}).status_code == 200


def test_a_fault_of_ours_is_one_json_500_one_traceback_and_logged_as_500(app, caplog):
    with caplog.at_level(logging.DEBUG, logger="specdeploy.serve"):
        resp = call(app, "GET", "/v1/boom")
    err = _error(resp, 500, None, "internal_error")
    request_id = resp.headers["x-request-id"]
    assert request_id in err["message"] and "a bug of ours" not in err["message"]
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1 and request_id in tracebacks[0].getMessage()
    assert any(f"request {request_id}: GET /v1/boom -> 500" in r.getMessage() for r in caplog.records)


def test_fields_the_server_does_not_know_are_refused_in_openais_words(app):
    """An unknown field was ignored: a misspelt `max_token` generated to the context end, vLLM's `min_tokens`
    changed nothing unseen. OpenAI's fields that change nothing in the text are accepted, still type-checked;
    the OpenAPI document says no other field is."""
    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 2}
    err = _error(call(app, "POST", "/v1/completions", {**body, "max_token": 8}), 400, "max_token",
                 "unrecognized_argument")
    assert err["message"].startswith("Unrecognized request argument supplied: max_token") \
        and "did you mean 'max_tokens'?" in err["message"]
    _error(call(app, "POST", "/v1/chat/completions", _chat(min_tokens=4)), 400, "min_tokens", "unrecognized_argument")
    _error(call(app, "POST", "/v1/completions", {**body, "stream": True,
                                                 "stream_options": {"continuous_usage_stats": True}}),
           400, "stream_options.continuous_usage_stats", "unrecognized_argument")
    _error(call(app, "POST", "/v1/chat/completions", _chat(moderation={"model": "x"})), 400, "moderation",
           "unsupported_parameter")
    ignored = {"metadata": {"k": "v"}, "store": False, "service_tier": "auto", "prompt_cache_key": "k",
               "prompt_cache_retention": "24h", "prompt_cache_options": {"ttl": "30m"}, "safety_identifier": "s",
               "parallel_tool_calls": True, "prediction": {"type": "content", "content": "hi"}, "user": "u"}
    assert call(app, "POST", "/v1/chat/completions", _chat(**ignored)).status_code == 200
    assert call(app, "POST", "/v1/completions", {**body, "stream_options": {"include_obfuscation": False},
                                                 "stream": True}).status_code == 200
    _error(call(app, "POST", "/v1/completions", {**body, "metadata": 5}), 400, "metadata", "invalid_type")
    schema = call(app, "GET", "/openapi.json").json()["components"]["schemas"]
    assert schema["ChatRequest"]["additionalProperties"] is False
    assert schema["CompletionRequest"]["additionalProperties"] is False


def test_every_field_of_the_openai_clients_create_is_known(app):
    """The official client's parameters are each served, accepted and ignored, or refused by name as unsupported:
    never "unrecognized" (its prompt_cache_retention was, while its sibling prompt_cache_key was accepted)."""
    import inspect

    from openai.resources.chat.completions import Completions as ChatCompletions
    from openai.resources.completions import Completions

    from specdeploy.serve.schemas import ChatRequest, CompletionRequest

    for create, request in ((ChatCompletions.create, ChatRequest), (Completions.create, CompletionRequest)):
        sent = set(inspect.signature(create).parameters) - {"self", "extra_headers", "extra_query", "extra_body",
                                                              "timeout"}
        assert sent <= set(request.model_fields), sorted(sent - set(request.model_fields))
