"""`specdeploy serve` end to end: a real server process, the official `openai` client, raw HTTP where needed."""

from __future__ import annotations

import json
import random
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from conftest import run_cli
from load_test import run_load
from serve_util import ServerProcess, metric_value

# A small template in the usual HF style: BOS, one tagged line per message, a generation prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported role ' + m['role']) }}{% endif %}"
    "[{{ m['role'] | upper }}] {{ m['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT] {% endif %}"
)
CONTEXT = 8192
LONG = 8000  # tokens of a request that keeps its worker busy for seconds (max_context is CONTEXT below)


@pytest.fixture(scope="module")
def chat_export(micro_family, tmp_path_factory) -> Path:
    """The micro family with a chat template in its tokenizer_config, exported with an 8192-token context.

    The long context lets a request keep its worker busy for seconds (the micro model decodes
    thousands of tokens a second), so tests can disconnect it mid-generation without a race.
    """
    from specdeploy.export.exporter import export_all

    root = tmp_path_factory.mktemp("serve")
    for name in ("target", "draft"):
        shutil.copytree(micro_family / name, root / name)
        config = json.loads((root / name / "config.json").read_text())
        config["max_position_embeddings"] = CONTEXT  # RoPE extends; the output is nonsense, the server does not care
        (root / name / "config.json").write_text(json.dumps(config, indent=2))
    cfg_path = root / "target" / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2))
    (root / "config.yaml").write_text(f"max_context: {CONTEXT}\n")
    return export_all(root / "target", root / "micro-chat", draft=root / "draft", config=root / "config.yaml",
                      progress=lambda msg: None)


@pytest.fixture(scope="module")
def server(chat_export):
    with ServerProcess(chat_export, "--pool-size", "2", "--queue", "16") as srv:
        yield srv


@pytest.fixture(scope="module")
def tight_server(chat_export):
    """One worker, one queue slot: a third concurrent request is refused."""
    with ServerProcess(chat_export, "--pool-size", "1", "--queue", "1") as srv:
        yield srv


def make_client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture()
def client(server):
    return make_client(server)


MODEL = "micro-chat"


def cli_generate(export: Path, *args) -> dict:
    proc = run_cli("generate", export, *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def stream_text(chunks, chat: bool = False) -> tuple[str, str | None]:
    text, finish = [], None
    for chunk in chunks:
        for choice in chunk.choices:
            piece = choice.delta.content if chat else choice.text
            text.append(piece or "")
            finish = choice.finish_reason or finish
    return "".join(text), finish


# ------------------------------------------------------------------------------ basics


def test_health_and_models(server, client):
    health = server.health()
    assert health["status"] == "ok" and health["pool_size"] == 2 and health["queue_size"] == 16
    assert health["chat_template"] is True and {"ar", "draft", "prompt-lookup"} <= set(health["methods"])
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def stop_inside(text: str) -> str:
    """A stop string the greedy answer is sure to contain (taken from its middle)."""
    middle = text[len(text) // 2:].lstrip()
    assert len(middle) >= 3, text
    return middle[:3]


@pytest.mark.parametrize("method, prompt, with_stop", [
    ("ar", "Once upon a time", False),
    ("draft", "def main():\n    ", False),
    ("prompt-lookup", "Once upon a time", True),
    ("auto", "def main():\n    ", False),  # the export's recommended method, on both sides
])
def test_greedy_completion_equals_cli(server, client, chat_export, method, prompt, with_stop):
    args = ["--method", method, "--prompt", prompt, "--max-new-tokens", "40"]
    stop = stop_inside(cli_generate(chat_export, *args)["text"]) if with_stop else None
    args += ["--stop", stop] if stop else []
    expected = cli_generate(chat_export, *args)
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                     stop=stop, extra_body={"method": method})
    assert resp.object == "text_completion" and resp.model == MODEL
    assert resp.choices[0].text == expected["text"]
    assert resp.choices[0].finish_reason == expected["finish_reason"]
    assert resp.usage.completion_tokens == len(expected["token_ids"])
    assert resp.usage.prompt_tokens == expected["stats"]["prompt_tokens"]
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    if stop:  # the case must exercise the stop string, or it tests nothing
        assert expected["finish_reason"] == "stop" and stop not in resp.choices[0].text


def test_completion_with_token_id_prompt(server, client, chat_export):
    expected = cli_generate(chat_export, "--prompt-ids", "5,6,7,8", "--max-new-tokens", "12")
    resp = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=12, temperature=0)
    assert resp.choices[0].text == expected["text"] and resp.usage.prompt_tokens == 4


def test_chat_completion_uses_the_tokenizer_template(server, client, chat_export):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Print hello."}]
    # The reference rendering: transformers' own apply_chat_template on the exported tokenizer.
    ids = AutoTokenizer.from_pretrained(str(chat_export / "tokenizer")).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    expected = cli_generate(chat_export, "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", "30")
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected["text"]
    assert resp.choices[0].finish_reason == expected["finish_reason"]
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == len(expected["token_ids"])
    # content as a list of text parts renders the same prompt
    system_parts = [{"type": "text", "text": "You write "}, {"type": "text", "text": "Python."}]
    parts = [{"role": "system", "content": system_parts}, messages[1]]
    resp2 = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=30, temperature=0)
    assert resp2.choices[0].message.content == expected["text"] and resp2.usage.prompt_tokens == len(ids)


def test_chat_template_refusal_is_400(server, client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "tool", "content": "x"}], max_tokens=4)
    assert "unsupported role tool" in err.value.body["message"] and err.value.body["param"] == "messages"


def test_chat_without_template_is_400(micro_export):
    with ServerProcess(micro_export) as srv:
        with pytest.raises(openai.BadRequestError) as err:
            make_client(srv).chat.completions.create(model="micro", messages=[{"role": "user", "content": "hi"}])
        assert err.value.body["code"] == "no_chat_template"
        assert make_client(srv).completions.create(model="micro", prompt="hi", max_tokens=3).usage.completion_tokens


# ------------------------------------------------------------------------------ streaming


@pytest.mark.parametrize("options", [
    {"temperature": 0},
    {"temperature": 0.8, "seed": 7, "extra_body": {"method": "draft", "top_k": 50}},
    {"temperature": 0, "stop": "FROM_OUTPUT", "extra_body": {"method": "prompt-lookup"}},
    {"temperature": 0.7, "top_p": 0.9, "seed": 3, "extra_body": {"ignore_eos": True}},
])
def test_streaming_concatenation_equals_non_streaming(server, client, options):
    prompt = "Once upon a time"
    if options.get("stop") == "FROM_OUTPUT":  # stop strings are held back while streaming: make one hit
        plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0).choices[0].text
        options = {**options, "stop": ["\x00never", stop_inside(plain)]}
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, **options)
    text, finish = stream_text(client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, stream=True,
                                                         **options))
    assert full.choices[0].text and text == full.choices[0].text
    assert finish == full.choices[0].finish_reason

    messages = [{"role": "user", "content": prompt}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, **options)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, stream=True,
                                                 stream_options={"include_usage": True}, **options))
    assert chunks[0].choices[0].delta.role == "assistant"
    text, finish = stream_text(chunks, chat=True)
    assert text == full.choices[0].message.content and finish == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


@pytest.mark.parametrize("options", [
    {"temperature": 0, "extra_body": {"method": "draft", "ignore_eos": True}},
    {"temperature": 0.9, "seed": 5, "extra_body": {"method": "prompt-lookup", "ignore_eos": True}},
])
def test_logprobs_are_the_targets_in_both_apis_streamed_or_not(server, client, chat_export, options):
    """Logprobs in OpenAI's shapes: the same numbers as the runtime's `ar` for the same seed, whichever
    method drafted, streamed or not; each token's bytes are its piece of the text."""
    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.loaded_export import LoadedExport
    from specdeploy.runtime.sampling import SamplingParams

    prompt, n = "Once upon a time", 24
    export = LoadedExport(chat_export)
    ar = generate(export, export.tokenizer.encode(prompt), method="ar", max_new_tokens=n, ignore_eos=True,
                  params=SamplingParams(options["temperature"], seed=options.get("seed")), logprobs=3)
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, logprobs=3, **options).choices[0]
    lp = full.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == full.text and lp.text_offset[0] == 0
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    assert lp.token_logprobs == pytest.approx([t.logprob for t in ar.logprobs], abs=1e-4)
    # the 3 likeliest, and the sampled token among them when it is not one of those (OpenAI's N + 1)
    assert all(3 <= len(top) <= 4 and top[t] == v for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, logprobs=3, stream=True, **options)
    streamed = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert sum((s.token_logprobs for s in streamed), []) == lp.token_logprobs
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset  # offsets run on across chunks

    messages = [{"role": "user", "content": prompt}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=n, logprobs=True,
                                          top_logprobs=2, **options).choices[0]
    content = chat.logprobs.content
    assert len(content) == n and all(len(t.top_logprobs) == 2 for t in content)
    assert bytes(b for t in content for b in t.bytes).decode("utf-8") == chat.message.content
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob and t.logprob <= t.top_logprobs[0].logprob
               for t in content)
    if not options["temperature"]:
        assert all(t.token == t.top_logprobs[0].token and t.logprob == t.top_logprobs[0].logprob for t in content)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=n, logprobs=True,
                                                 top_logprobs=2, stream=True, **options))
    streamed_content = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob, t.bytes) for t in streamed_content] == [(t.token, t.logprob, t.bytes) for t in content]
    # not asked for: none, as before
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, **options).choices[0]
    assert plain.logprobs is None


def test_penalties_are_served_as_the_runtime_applies_them(server, client, chat_export):
    """OpenAI's frequency and presence penalties and logit_bias, and the repetition_penalty extension: the
    runtime's tokens for the same settings, whichever method drafts (they were a 400 before)."""
    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.loaded_export import LoadedExport
    from specdeploy.runtime.penalties import Penalties

    prompt, n = "Once upon a time", 32
    export = LoadedExport(chat_export)
    ids = export.tokenizer.encode(prompt)
    plain = generate(export, ids, method="ar", max_new_tokens=n, ignore_eos=True).token_ids
    banned = {plain[0]: -100.0, plain[1]: -100.0}
    cases = [(Penalties(1.3), {"extra_body": {"repetition_penalty": 1.3}}),
             (Penalties(frequency=0.9, presence=0.6), {"frequency_penalty": 0.9, "presence_penalty": 0.6}),
             (Penalties(logit_bias=banned), {"logit_bias": {str(t): b for t, b in banned.items()}})]
    for penalties, body in cases:
        want = generate(export, ids, method="ar", max_new_tokens=n, ignore_eos=True, penalties=penalties).text
        assert want != generate(export, ids, method="ar", max_new_tokens=n, ignore_eos=True).text
        for method in ("ar", "prompt-lookup", "draft"):
            extra = {**body.get("extra_body", {}), "method": method, "ignore_eos": True}
            got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                            **{k: v for k, v in body.items() if k != "extra_body"}, extra_body=extra)
            assert got.choices[0].text == want, (method, penalties)


def test_streamed_logprobs_never_run_ahead_of_their_text(server, client):
    """Text that could start a stop string is held back; its tokens' logprobs are held with it, and a
    token's text_offset points at its text in the completion, streamed or not."""
    prompt = "Once upon a time"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0).choices[0].text
    options = dict(model=MODEL, prompt=prompt, max_tokens=48, temperature=0, logprobs=1,
                   stop=["\x00never", stop_inside(plain)])  # 6 characters held back while streaming
    full = client.completions.create(**options).choices[0]
    assert full.finish_reason == "stop"
    lp = full.logprobs
    for token, offset in zip(lp.tokens, lp.text_offset):
        assert offset <= len(full.text)
        if offset + len(token) <= len(full.text):  # tokens before the stop string: their text is there
            assert full.text[offset:offset + len(token)] == token
    chunks = [c.choices[0] for c in client.completions.create(**options, stream=True) if c.choices]
    carrying = [i for i, c in enumerate(chunks) if c.logprobs and c.logprobs.tokens]
    shown = listed = 0
    for i, chunk in enumerate(chunks):
        shown += len(chunk.text or "")
        if chunk.logprobs:
            listed += sum(len(t) for t in chunk.logprobs.tokens)
        if i < carrying[-1]:  # the last one also brings the tokens past the stop string
            assert listed <= shown, (i, listed, shown)
    streamed = [c.logprobs for c in chunks if c.logprobs]
    assert sum((c.tokens for c in streamed), []) == lp.tokens
    assert sum((c.text_offset for c in streamed), []) == lp.text_offset


def test_echo_scores_a_text_as_generation_scored_it(server, client):
    """`echo` with `logprobs` (how evaluation harnesses score a text): the prompt's tokens get the logprobs
    the target gave them when it generated them, the first null; streamed, the prompt comes first."""
    prompt, n = "def add(a, b):", 12
    gen = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True}).choices[0]
    scored = client.completions.create(model=MODEL, prompt=prompt + gen.text, max_tokens=1, temperature=0,
                                       logprobs=2, echo=True).choices[0]
    lp = scored.logprobs
    assert scored.text.startswith(prompt + gen.text)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert all(scored.text[o:o + len(t)] == t for t, o in zip(lp.tokens, lp.text_offset))
    tail = slice(-1 - n, -1)  # the generated tokens, now in the prompt (the last entry: the new token)
    assert lp.tokens[tail] == gen.logprobs.tokens
    assert lp.token_logprobs[tail] == pytest.approx(gen.logprobs.token_logprobs, abs=1e-4)
    stream = client.completions.create(model=MODEL, prompt=prompt + gen.text, max_tokens=1, temperature=0,
                                       logprobs=2, echo=True, stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert chunks[0].text == prompt + gen.text and chunks[0].logprobs.token_logprobs[0] is None
    assert "".join(c.text for c in chunks) == scored.text
    assert sum((c.logprobs.token_logprobs for c in chunks if c.logprobs), []) == lp.token_logprobs
    assert sum((c.logprobs.text_offset for c in chunks if c.logprobs), []) == lp.text_offset
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, echo=True,
                                      extra_body={"ignore_eos": True}).choices[0]
    assert plain.text == prompt + gen.text and plain.logprobs is None
    # max_tokens 0: the prompt scored, nothing generated, streamed or not
    only = client.completions.create(model=MODEL, prompt=prompt + gen.text, max_tokens=0, logprobs=2, echo=True)
    assert only.choices[0].text == prompt + gen.text and only.usage.completion_tokens == 0
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[:-1]
    chunks = [c.choices[0] for c in client.completions.create(model=MODEL, prompt=prompt + gen.text, max_tokens=0,
                                                              logprobs=2, echo=True, stream=True) if c.choices]
    assert chunks[0].text == prompt + gen.text and chunks[0].logprobs.token_logprobs == lp.token_logprobs[:-1]
    with pytest.raises(openai.BadRequestError) as err:  # 0 generates nothing: only to score a prompt
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True)
    assert err.value.body["param"] == "max_tokens"


def test_a_whole_context_window_can_be_scored(server, client):
    """Scoring alone (echo, logprobs, max_tokens 0) reads the prefill's rows, which stop before the last token:
    a prompt as long as the context is scored (a perplexity window), and its tokens get the numbers the same
    text one token shorter gets; generating after it is refused."""
    window = [(7 * i) % 500 + 3 for i in range(CONTEXT)]
    whole = client.completions.create(model=MODEL, prompt=window, max_tokens=0, logprobs=0, echo=True).choices[0]
    shorter = client.completions.create(model=MODEL, prompt=window[:-1], max_tokens=0, logprobs=0,
                                        echo=True).choices[0]
    assert len(whole.logprobs.token_logprobs) == CONTEXT and whole.logprobs.token_logprobs[0] is None
    assert whole.logprobs.token_logprobs[:-1] == shorter.logprobs.token_logprobs
    for body in (dict(max_tokens=1, logprobs=0, echo=True), dict(max_tokens=0, echo=True), dict(max_tokens=None)):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt=window, **body)
        assert err.value.body["code"] == "context_length_exceeded"


def test_raw_sse_format(server):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in events[:-1]]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_sampling_scheme_is_chosen_per_request(client):
    """Seeded (seed-exact) drafting prints ar's tokens for the same seed; rejection sampling is selectable."""
    def text(method, sampling=None, **extra):
        extra = {"method": method, "ignore_eos": True, **({"sampling": sampling} if sampling else {}), **extra}
        return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0.9,
                                         seed=21, extra_body=extra).choices[0].text

    assert text("draft", "seeded") == text("ar") == text("draft")  # a seed asks for a replay: seeded by default
    # the response says which scheme drew the tokens, and the seed that replays them (here: a drawn one)
    unseeded = httpx.post(f"{client.base_url}completions", json={"model": MODEL, "prompt": "Once upon a time",
                                                                 "max_tokens": 8, "temperature": 0.9}, timeout=60)
    stats = unseeded.json()["specdeploy"]
    assert stats["sampling"] in ("seeded", "rejection") and isinstance(stats["seed"], int)
    assert isinstance(text("draft", "rejection"), str)
    # min_p (an extension, HF's): 1.0 keeps only the likeliest token, so sampling is greedy decoding
    greedy = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    assert text("draft", min_p=1.0) == text("ar", min_p=1.0) == greedy


# ------------------------------------------------------------------------------ n and best_of


def _completion(srv, **body) -> dict:
    resp = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", **body},
                      timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_a_negative_seed_is_its_64_bits(server):
    """OpenAI's seed is an int64: a negative one (some clients send -1) samples as its two's complement, the
    seed the response reports, which replays it."""
    common = dict(max_tokens=12, temperature=1.0, ignore_eos=True)
    negative = _completion(server, seed=-1, **common)
    assert negative["specdeploy"]["seed"] == 2**64 - 1
    assert _completion(server, seed=2**64 - 1, **common)["choices"][0]["text"] == negative["choices"][0]["text"]
    assert _completion(server, seed=-(2**63), **common)["specdeploy"]["seed"] == 2**63


@pytest.mark.parametrize("method", ["ar", "draft"])
def test_n_sampled_choices_each_replay_their_own_seed(server, method):
    """Choice 0 is the request's answer for its seed, choice i the answer for candidate i's derived seed,
    whatever the method; the request replays exactly."""
    from specdeploy.serve.choices import candidate_seed

    seed, common = 31, dict(max_tokens=16, temperature=1.5, top_k=40, ignore_eos=True, method=method, sampling="seeded")
    out = _completion(server, n=3, seed=seed, **common)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    texts = [c["text"] for c in out["choices"]]
    seeds = [candidate_seed(seed, i) for i in range(3)]
    assert seeds[0] == seed and len(set(seeds)) == 3
    alone = [_completion(server, seed=s, **{**common, "method": "ar"})["choices"][0]["text"] for s in seeds]
    assert texts == alone
    assert len(set(texts)) > 1  # different seeds, different samples (16 tokens at temperature 1.5)
    assert out["usage"]["completion_tokens"] == 48 and out["usage"]["prompt_tokens"] == \
        _completion(server, seed=seed, **common)["usage"]["prompt_tokens"]
    assert [c["text"] for c in _completion(server, n=3, seed=seed, **common)["choices"]] == texts


def test_greedy_n_generates_once(server):
    one = _completion(server, max_tokens=12, temperature=0, method="draft")
    many = _completion(server, n=4, max_tokens=12, temperature=0, method="draft")
    assert [c["text"] for c in many["choices"]] == [one["choices"][0]["text"]] * 4
    assert many["usage"]["completion_tokens"] == 4 * one["usage"]["completion_tokens"]
    assert many["specdeploy"]["target_calls"] == one["specdeploy"]["target_calls"]  # one generation, shown 4 times


def test_n_streams_each_choice_as_it_answers_alone(server, client):
    messages = [{"role": "user", "content": "Tell me a story"}]
    common = dict(model=MODEL, messages=messages, max_tokens=20, temperature=0.9, seed=8, n=3,
                  extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**common, logprobs=True)
    chunks = list(client.chat.completions.create(**common, logprobs=True, stream=True,
                                                 stream_options={"include_usage": True}))
    for i, choice in enumerate(full.choices):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].delta.role == "assistant"  # each choice opens with its role, and ends with its finish
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason] == ["length"]
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        assert [t.logprob for c in mine if c.logprobs for t in c.logprobs.content] == \
            [t.logprob for t in choice.logprobs.content]
    assert all(len(c.choices) == 1 for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 60
    assert len({c.message.content for c in full.choices}) > 1


def test_a_list_of_prompts_answers_each_in_turn_as_alone(server, client):
    """Completions' batch of prompts (strings or token ids): choice prompt x n + j is what that prompt's
    request alone answers for candidate j, streamed or not, echoed each with its own prompt."""
    from specdeploy.serve.choices import candidate_seed

    ids = client.completions.create(model=MODEL, prompt="x", max_tokens=1, echo=True, logprobs=0)
    prompts = ["Once upon a time", "def main():", [int(t) for t in (5, 17, 42)]]
    common = dict(model=MODEL, max_tokens=10, temperature=0.9, seed=4, n=2, extra_body={"ignore_eos": True})
    both = client.completions.create(prompt=prompts, **common)
    assert [c.index for c in both.choices] == list(range(6))
    alone = [client.completions.create(prompt=p, **{**common, "n": 1, "seed": candidate_seed(4, j)})
             for p in prompts for j in range(2)]
    assert [c.text for c in both.choices] == [a.choices[0].text for a in alone]
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone[::2])
    assert both.usage.completion_tokens == 60
    streamed = [""] * 6
    for chunk in client.completions.create(prompt=prompts, stream=True, **common):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in both.choices]
    echoed = client.completions.create(prompt=prompts[:2], echo=True, model=MODEL, max_tokens=4, temperature=0)
    assert [c.text[:len(p)] for c, p in zip(echoed.choices, prompts)] == prompts[:2]
    assert ids.choices  # a scoring call of one token id prompt still answers


def test_best_of_returns_the_likeliest_candidates(server):
    """best_of candidates are ranked by their mean token logprob; logprobs are shown only if asked for."""
    from specdeploy.serve.choices import candidate_seed

    seed, common = 12, dict(max_tokens=10, temperature=1.2, ignore_eos=True)
    candidates = [_completion(server, seed=candidate_seed(seed, i), logprobs=0, **common)["choices"][0]
                  for i in range(4)]
    means = [sum(c["logprobs"]["token_logprobs"]) / 10 for c in candidates]
    ranked = [candidates[i]["text"] for i in sorted(range(4), key=lambda i: -means[i])]
    best = _completion(server, seed=seed, best_of=4, n=2, **common)
    assert [c["text"] for c in best["choices"]] == ranked[:2] and [c["index"] for c in best["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in best["choices"])
    assert best["usage"]["completion_tokens"] == 40  # every candidate was generated
    shown = _completion(server, seed=seed, best_of=4, logprobs=1, **common)["choices"]
    assert len(shown) == 1 and shown[0]["text"] == ranked[0] and len(shown[0]["logprobs"]["tokens"]) == 10


def test_n_past_the_servers_generations_is_refused(tight_server):
    """A request of n generations holds n places: past the limit a 400, while others hold them a 429."""
    client = make_client(tight_server)  # one worker and one queue slot: 2 generations at once
    _wait_idle(tight_server)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=3, temperature=0)
    assert err.value.body["param"] == "n" and "at most 2" in err.value.body["message"]
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=LONG, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    with pytest.raises(openai.RateLimitError) as busy:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=2, temperature=0.5)
    assert "needs 2 generations" in busy.value.body["message"]
    stream.close()
    _wait_idle(tight_server)
    two = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, n=2, temperature=0.5, seed=1)
    assert len(two.choices) == 2 and two.usage.completion_tokens == 6
    # a streamed n=2 (one choice generating, one queued behind it) that its client drops frees both places
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=LONG, n=2, temperature=0.5,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    assert tight_server.health()["waiting"] == 1
    stream.close()
    _wait_idle(tight_server)
    assert tight_server.health()["in_flight"] == 0


def test_choices_wait_for_each_other_past_the_queue_limit_and_a_refused_one_ends_them_at_once(chat_export):
    """One worker, a 1 s queue limit: n=2 generations of seconds each still answer (the second waits for the
    first, not for a busy server); with the worker held and the one queue slot taken by the request's
    first choice, its second is refused and the request gets its 429 at once, the first withdrawn."""
    with ServerProcess(chat_export, "--pool-size", "1", "--queue", "1", "--queue-timeout", "1",
                       "--max-concurrent-requests", "4") as srv:
        client = make_client(srv)
        both = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=LONG, n=2,
                                         temperature=0.9, seed=3, extra_body={"ignore_eos": True})
        assert [c.finish_reason for c in both.choices] == ["length", "length"]
        assert both.usage.completion_tokens == 2 * LONG
        stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=LONG, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        t0 = time.perf_counter()
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt="hi", max_tokens=LONG, n=2, temperature=0.9)
        assert time.perf_counter() - t0 < 5  # not after the held worker's generation
        assert srv.health()["waiting"] == 0  # the queued first choice left the queue
        stream.close()
        _wait_idle(srv)
        assert srv.health()["in_flight"] == 0


# ------------------------------------------------------------------------------ concurrency


def test_concurrent_clients_each_get_their_own_answer(server, client):
    jobs = [dict(prompt=p, max_tokens=40, temperature=t, seed=s, extra_body={"method": m, "ignore_eos": True})
            for p, t, s, m in [("Once upon a time", 0, None, "ar"), ("def main():", 0, None, "draft"),
                               ("import numpy", 0.9, 11, "draft"), ("The weather", 0.9, 12, "ar"),
                               ("class Foo:", 0, None, "prompt-lookup"), ("for i in", 1.0, 13, "prompt-lookup"),
                               ("Hello, world", 0.5, 14, "ar"), ("In the beginning", 0, None, "draft")]]
    sequential = [client.completions.create(model=MODEL, **job).choices[0].text for job in jobs]
    assert len(set(sequential)) > 4  # different prompts really give different answers

    health_latency, stop = [], threading.Event()

    def probe():  # the event loop must stay responsive while generations run in worker threads
        while not stop.is_set():
            t0 = time.perf_counter()
            httpx.get(f"{server.url}/health", timeout=10)
            health_latency.append(time.perf_counter() - t0)
            time.sleep(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        with ThreadPoolExecutor(len(jobs)) as pool:
            parallel = list(pool.map(lambda job: make_client(server).completions.create(model=MODEL, **job)
                                     .choices[0].text, jobs * 2))
    finally:
        stop.set()
        prober.join()
    assert parallel == sequential * 2
    assert health_latency and max(health_latency) < 2.0


# ------------------------------------------------------------------------------ bad input


BAD = [
    (b"{not json", 400, None, "invalid_json"),
    (b"[1, 2]", 400, None, "invalid_type"),
    (b"", 400, None, "invalid_json"),
    ({"prompt": "x"}, 400, "model", "missing_required_parameter"),
    ({"model": MODEL}, 400, "prompt", "missing_required_parameter"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "model", "model_not_found"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature", "invalid_type"),
    ({"model": MODEL, "prompt": "x", "top_p": 2}, 400, "top_p", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "top_p": -0.1}, 400, "top_p", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "invalid_type"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 2.5}, 400, "max_tokens", "invalid_type"),
    ({"model": MODEL, "prompt": "x", "max_tokens": CONTEXT + 100}, 400, "max_tokens", "context_length_exceeded"),
    ({"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream", "invalid_type"),
    ({"model": MODEL, "prompt": "x", "stop": 5}, 400, "stop", "invalid_type"),
    ({"model": MODEL, "prompt": "x", "stop": ["a"] * 40}, 400, "stop", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "seed": -(2**63) - 1}, 400, "seed", "invalid_value"),  # past OpenAI's int64
    ({"model": MODEL, "prompt": "x", "max_token": 8}, 400, "max_token", "unrecognized_argument"),  # a typo
    ({"model": MODEL, "prompt": "x", "min_tokens": 8}, 400, "min_tokens", "unrecognized_argument"),  # vLLM's
    ({"model": MODEL, "prompt": "x", "seed": 2**64}, 400, "seed", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "sampling": "lucky"}, 400, "sampling", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "min_p": 1.5}, 400, "min_p", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "min_p": "0.1"}, 400, "min_p", "invalid_type"),
    ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "n": 10**6}, 400, "n", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "n": "2"}, 400, "n", "invalid_type"),
    ({"model": MODEL, "prompt": "x", "best_of": 0}, 400, "best_of", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "n": 3, "best_of": 2}, 400, "best_of", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "best_of": 2, "stream": True}, 400, "best_of", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "best_of": 10**6, "temperature": 0}, 400, "best_of", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "frequency_penalty": 2.5}, 400, "frequency_penalty", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": "high"}, 400, "presence_penalty", "invalid_type"),
    ({"model": MODEL, "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"5": "1"}}, 400, "logit_bias", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}}, 400, "logit_bias",
     "invalid_value"),
    ({"model": MODEL, "prompt": "x", "logit_bias": [1]}, 400, "logit_bias", "invalid_type"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"9" * 5000: 1}}, 400, "logit_bias", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "repetition_penalty": 1e-300}, 400, "repetition_penalty", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "repetition_penalty": 1e300}, 400, "repetition_penalty", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "logprobs": -1}, 400, "logprobs", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "logprobs": True}, 400, "logprobs", "invalid_type"),
    ({"model": MODEL, "prompt": "x", "echo": "yes"}, 400, "echo", "invalid_type"),
    ({"model": MODEL, "prompt": "x", "method": "nope"}, 400, "method", "unknown_method"),
    ({"model": MODEL, "prompt": "x", "top_k": -3}, 400, "top_k", "invalid_value"),
    ({"model": MODEL, "prompt": 123}, 400, "prompt", "invalid_type"),
    ({"model": MODEL, "prompt": [["a"]]}, 400, "prompt", "invalid_type"),
    ({"model": MODEL, "prompt": ["a", [True]]}, 400, "prompt", "invalid_type"),
    ({"model": MODEL, "prompt": ["a", []]}, 400, "prompt", "invalid_value"),
    ({"model": MODEL, "prompt": ["a"] * 10, "n": 2}, 400, "n", "invalid_value"),
    ({"model": MODEL, "prompt": ["a"] * 19}, 400, "prompt", "invalid_value"),  # 2 workers + a queue of 16
    ({"model": MODEL, "prompt": [1, 99999]}, 400, "prompt", "invalid_value"),
    ({"model": MODEL, "prompt": []}, 400, "prompt", "invalid_value"),
    ({"model": MODEL, "prompt": "word " * (3 * CONTEXT)}, 400, "prompt", "context_length_exceeded"),
    ({"model": MODEL, "prompt": [5] * (CONTEXT + 100)}, 400, "prompt", "context_length_exceeded"),
]
BAD_CHAT = [
    ({"model": MODEL, "messages": []}, 400, "messages", "invalid_value"),
    ({"model": MODEL, "messages": "hi"}, 400, "messages", "invalid_type"),
    ({"model": MODEL, "messages": [{"content": "hi"}]}, 400, "messages[0].role", "missing_required_parameter"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "invalid_type"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[0].content[0]", "unsupported_content"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     400, "tools", "unsupported_parameter"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "verbosity": "low"},
     400, "verbosity", "unsupported_parameter"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "guided_json": {"type": "object"}},
     400, "guided_json", "unrecognized_argument"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     400, "max_completion_tokens", "invalid_value"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs",
     "invalid_value"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     400, "top_logprobs", "invalid_value"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, 400, "logprobs",
     "invalid_type"),
]


def _check_error(resp: httpx.Response, status: int, param, code) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and "Traceback" not in err["message"]
    assert err["param"] == param and err["code"] == code


@pytest.mark.parametrize("body, status, param, code", BAD, ids=lambda x: None)
def test_bad_completion_request(server, body, status, param, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(f"{server.url}/v1/completions", content=content, timeout=30,
                      headers={"content-type": "application/json"})
    _check_error(resp, status, param, code)


@pytest.mark.parametrize("body, status, param, code", BAD_CHAT, ids=lambda x: None)
def test_bad_chat_request(server, body, status, param, code):
    _check_error(httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30), status, param, code)


def test_bad_requests_through_the_openai_client(server, client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert err.value.status_code == 400 and err.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", extra_body={"method": "medusa-does-not-exist"})
    with pytest.raises(openai.BadRequestError) as err:  # also refused before a stream starts
        client.completions.create(model=MODEL, prompt="x", top_p=2, stream=True)
    assert err.value.body["param"] == "top_p"


def test_http_level_errors(server):
    _check_error(httpx.get(f"{server.url}/v1/nothing"), 404, None, "not_found")
    _check_error(httpx.get(f"{server.url}/v1/completions"), 405, None, "method_not_allowed")
    big = b'{"model": "x", "prompt": "' + b"a" * (2 << 20) + b'"}'
    _check_error(httpx.post(f"{server.url}/v1/completions", content=big, timeout=30,
                            headers={"content-type": "application/json"}), 413, None, "request_too_large")
    assert server.health()["status"] == "ok"


# ------------------------------------------------------------------------------ capacity and disconnects


def _wait_for(condition, timeout: float = 15.0) -> None:
    t0 = time.monotonic()
    while not condition():
        assert time.monotonic() - t0 < timeout, "timed out waiting for the server's state"
        time.sleep(0.01)


def _wait_idle(srv: ServerProcess) -> None:
    _wait_for(lambda: srv.health()["in_use"] == 0 and srv.health()["waiting"] == 0)


def test_full_queue_is_429_and_disconnects_free_their_place(tight_server):
    client = make_client(tight_server)
    _wait_idle(tight_server)
    before = tight_server.metrics()

    # A: generating, holding the only worker
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=LONG, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    assert next(chunks).choices[0].text is not None
    assert tight_server.health()["in_use"] == 1
    # B: waiting in the one queue slot, on a raw connection this test can drop at will
    body = json.dumps({"model": MODEL, "prompt": "queued", "max_tokens": 8}).encode()
    queued = socket.create_connection(("127.0.0.1", tight_server.port))
    queued.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    _wait_for(lambda: tight_server.health()["waiting"] == 1)
    # C: pool and queue are full
    for call in (lambda: client.completions.create(model=MODEL, prompt="hi", max_tokens=4),
                 lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=4, stream=True)):
        with pytest.raises(openai.RateLimitError) as err:
            call()
        assert err.value.status_code == 429 and err.value.body["code"] == "server_busy"
        assert err.value.response.headers.get("retry-after")
    # D: pool and queue are full, so it is refused before its body is even read
    with socket.create_connection(("127.0.0.1", tight_server.port), timeout=10) as unsent:
        unsent.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 1000\r\n\r\n")
        assert unsent.recv(4096).startswith(b"HTTP/1.1 429")
    queued.close()  # B goes away while queued: its place is freed, it never runs
    _wait_for(lambda: tight_server.health()["waiting"] == 0)
    stream.close()  # A goes away mid-stream: its worker is freed
    _wait_idle(tight_server)

    after = tight_server.metrics()
    def delta(name, **labels):
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)
    assert delta("specdeploy_generations_total") == 1  # A only: B never got a worker
    assert delta("specdeploy_generations_total", finish_reason="cancelled") == 1
    assert delta("specdeploy_generated_tokens_total") < LONG  # A really stopped early
    assert delta("specdeploy_requests_total", status="429") == 3
    assert delta("specdeploy_requests_total", status="499") == 2  # A and B: "client closed request"
    assert delta("specdeploy_request_latency_seconds_count") == 0  # neither finished
    resp = client.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=0)
    assert resp.usage.completion_tokens == 4


def test_disconnect_of_a_non_streaming_request_frees_the_worker(tight_server):
    _wait_idle(tight_server)
    cancelled0 = metric_value(tight_server.metrics(), "specdeploy_generations_total", finish_reason="cancelled")
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": LONG, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before the answer
        httpx.post(f"{tight_server.url}/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.05))
    _wait_idle(tight_server)
    assert metric_value(tight_server.metrics(), "specdeploy_generations_total",
                        finish_reason="cancelled") == cancelled0 + 1
    assert make_client(tight_server).completions.create(model=MODEL, prompt="hi", max_tokens=2).usage


def test_disconnect_during_prefill_frees_the_worker(tight_server):
    """A near-full-context prompt: its client gives up during prefill, and the worker stops partway
    through the prompt (the prompt-token counter counts what prefill reached) instead of finishing it."""
    client = make_client(tight_server)
    _wait_idle(tight_server)
    prompt = [5 + i % 97 for i in range(LONG)]
    t0 = time.monotonic()
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    whole_prefill = time.monotonic() - t0
    before = metric_value(tight_server.metrics(), "specdeploy_prompt_tokens_total")
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # gives up a fifth of the way through (timed on this machine)
        httpx.post(f"{tight_server.url}/v1/completions", json=body,
                   timeout=httpx.Timeout(10, read=max(0.01, whole_prefill / 5)))
    _wait_idle(tight_server)  # the counter moves just after the worker is freed
    _wait_for(lambda: metric_value(tight_server.metrics(), "specdeploy_prompt_tokens_total") > before)
    processed = metric_value(tight_server.metrics(), "specdeploy_prompt_tokens_total") - before
    assert 0 < processed < 0.75 * LONG, processed


@pytest.fixture(scope="module")
def deadline_server(chat_export):
    with ServerProcess(chat_export, "--pool-size", "1", "--request-timeout", "0.5") as srv:
        yield srv


def test_request_deadline(deadline_server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": LONG, "temperature": 0, "ignore_eos": True}
    t0 = time.monotonic()
    resp = httpx.post(f"{deadline_server.url}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 504 and time.monotonic() - t0 < 5
    assert resp.json()["error"]["code"] == "deadline_exceeded" and resp.json()["error"]["type"] == "internal_error"
    with httpx.stream("POST", f"{deadline_server.url}/v1/completions", json={**body, "stream": True},
                      timeout=30) as stream:
        events = [line for line in stream.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["error"]["code"] == "deadline_exceeded"
    _wait_idle(deadline_server)
    assert httpx.post(f"{deadline_server.url}/v1/completions", json={**body, "max_tokens": 4},
                      timeout=30).status_code == 200


def _held_request(srv: ServerProcess) -> socket.socket:
    """A request in progress until the test closes it: headers sent, the promised body never comes."""
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n")
    return sock


def test_past_max_connections_is_a_json_503(chat_export):
    """Past --max-connections the app answers an OpenAI-style 503 (uvicorn's own plain-text 503 is only a
    backstop further up, which idle connections alone do not reach); /health stays answerable."""
    with ServerProcess(chat_export, "--pool-size", "1", "--max-connections", "3") as srv:
        held = [_held_request(srv) for _ in range(3)]
        idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(4)]
        _wait_for(lambda: srv.health()["in_flight"] == 3)
        resp = httpx.get(f"{srv.url}/v1/models", timeout=10)
        assert resp.status_code == 503 and resp.headers["content-type"] == "application/json", resp.text
        error = resp.json()["error"]
        assert error["code"] == "too_many_connections" and error["type"] == "internal_error"
        assert "--max-connections" in error["message"] and resp.headers["retry-after"] == "1"
        assert resp.headers["x-request-id"]
        with pytest.raises(openai.InternalServerError) as err:
            make_client(srv).completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert err.value.status_code == 503 and err.value.body["code"] == "too_many_connections"
        assert metric_value(srv.metrics(), "specdeploy_requests_total", status="503") == 2
        for sock in held + idle:
            sock.close()
        _wait_for(lambda: srv.health()["in_flight"] == 0)
        assert make_client(srv).completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2
        assert "Traceback" not in srv.log()


def test_tokenizer_timeout_is_answered_and_frees_everything(chat_export):
    """A prompt that takes the tokenizer far longer than --tokenize-timeout: a 500 `tokenize_timeout` at
    the limit (not once the tokenizer is done), the request's admission freed when the tokenizer's thread
    ends, the server serving throughout."""
    from tokenizers import Tokenizer

    rng = random.Random(0)
    words = ("alpha", "brown", "quick", "lazy", "river", "stone", "zeta", "kettle")
    prompt = " ".join(f"{rng.choice(words)}{rng.randrange(1000)}" for _ in range(120_000))[:900_000]
    tokenizer = Tokenizer.from_file(str(chat_export / "tokenizer" / "tokenizer.json"))
    t0 = time.perf_counter()
    tokenizer.encode(prompt)
    whole = time.perf_counter() - t0  # what the server's tokenizer needs for it, on this machine now
    limit = min(0.25, whole / 4)
    with ServerProcess(chat_export, "--pool-size", "1", "--tokenize-timeout", str(limit)) as srv:
        t0 = time.perf_counter()
        resp = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
                          timeout=60)
        elapsed = time.perf_counter() - t0
        assert resp.status_code == 500, resp.text
        error = resp.json()["error"]
        assert error["code"] == "tokenize_timeout" and error["type"] == "internal_error"
        assert f"{limit:g} s" in error["message"]
        assert elapsed < whole, (elapsed, whole)  # did not wait for the tokenizer (it used to hold the GIL)
        health = srv.health()
        if time.perf_counter() - t0 < whole / 2:  # the tokenizer's thread runs on, holding its admission
            assert health["in_flight"] == 1, health
        assert health["in_use"] == 0 and health["waiting"] == 0
        _wait_for(lambda: srv.health()["in_flight"] == 0, timeout=30 + 2 * whole)
        _wait_for(lambda: make_client(srv).completions.create(model=MODEL, prompt="Hello", max_tokens=2,
                                                              temperature=0).usage.completion_tokens == 2)
        assert metric_value(srv.metrics(), "specdeploy_requests_total", status="500") == 1
        assert "Traceback" not in srv.log()


def test_short_soak(chat_export):
    """tests/soak.py for seconds: mixed methods, streams, disconnects and bad requests on a fresh server;
    every bad request gets its 4xx, nothing 5xx, the pool idles, fds return to their idle level, threads
    stay bounded, greedy answers unchanged.
    (RSS flatness needs minutes: `make soak`.)"""
    from soak import soak

    report = soak(chat_export, seconds=12, clients=8, pool_size=2, interval=3, warmup_s=None, settle_s=1,
                  bad_fraction=0.25, disconnect_fraction=0.15)
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=2))
    checks = {k: v for k, v in report["checks"].items() if k != "anonymous RSS flat after warm-up"}
    assert all(checks.values()), (checks, report["problems"])
    kinds = report["kinds"]
    assert kinds.get("stream", 0) and kinds.get("non-stream", 0) and report["classes"]["4xx"] >= 3
    assert any(k.startswith("disconnect") for k in kinds)


# ------------------------------------------------------------------------------ observability and load


def test_metrics(server, client):
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=10, temperature=0, extra_body={"method": "draft"})
    list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=10, stream=True))
    httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x", "top_p": 5})
    resp = httpx.get(f"{server.url}/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    text = resp.text
    assert metric_value(text, "specdeploy_requests_total", endpoint="/v1/completions", status="200") >= 2
    assert metric_value(text, "specdeploy_requests_total", endpoint="/v1/completions", status="400") >= 1
    assert metric_value(text, "specdeploy_generated_tokens_total", method="draft") >= 10
    assert metric_value(text, "specdeploy_acceptance_length_count", method="draft") >= 1
    assert metric_value(text, "specdeploy_acceptance_length_sum", method="draft") >= 1  # >= 1 token per call
    assert metric_value(text, "specdeploy_request_latency_seconds_count", endpoint="/v1/completions") >= 2
    assert metric_value(text, "specdeploy_time_to_first_token_seconds_count") >= 1
    assert "specdeploy_queue_depth 0.0" in text and "specdeploy_workers 2.0" in text


def test_short_load(server):
    report = run_load(server.url, MODEL, clients=4, seconds=8, max_tokens=24, methods=["ar", "draft", "prompt-lookup"])
    print(json.dumps(report, indent=2))
    assert report["errors"] == 0, report["error_samples"]
    assert report["requests"] >= 8 and report["tokens"] > 0
    assert report["latency_s"]["p50"] <= report["latency_s"]["p99"]
    assert server.health()["in_use"] == 0
