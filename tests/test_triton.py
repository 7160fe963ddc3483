"""Triton Inference Server end to end, on loopback: `specdeploy serve OUT --triton-repo DIR` writes the model
repository and starts the real tritonserver (from the nvidia-pytriton wheel); `tritonclient` over HTTP and
gRPC, streaming through the decoupled model.

The server's models run in a Python environment with numpy<2 (Triton's Python-backend stub does not work
with numpy 2): $SPECDEPLOY_TRITON_PYTHON, or build/triton-venv from `make serve-deps`.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

tritonclient = pytest.importorskip("tritonclient", reason="the Triton tests need tritonclient: "
                                   "pip install 'tritonclient[http,grpc]' (or make serve-deps)")
# after importorskip: without tritonclient the module is skipped before these imports run
import tritonclient.grpc as tgrpc  # noqa: E402
import tritonclient.http as thttp  # noqa: E402
from conftest import REPO  # noqa: E402
from serve_util import free_port  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

PROMPT = "def main():"
MAX_TOKENS = 24


def triton_python() -> str | None:
    """A Python with specdeploy, numpy<2 and the Triton server, or None."""
    python = os.environ.get("SPECDEPLOY_TRITON_PYTHON") or str(REPO / "build" / "triton-venv" / "bin" / "python")
    if not Path(python).is_file():
        return None
    check = ("import numpy, pytriton, specdeploy.runtime; "
             "assert int(numpy.__version__.split('.')[0]) < 2, 'numpy 2'")
    ok = subprocess.run([python, "-c", check], capture_output=True, timeout=120).returncode == 0
    return python if ok else None


@pytest.fixture(scope="module")
def triton(micro_export, tmp_path_factory):
    python = triton_python()
    if python is None:
        pytest.skip("no Triton serving environment (numpy<2, nvidia-pytriton, specdeploy): run `make serve-deps` "
                    "or set SPECDEPLOY_TRITON_PYTHON")
    root = tmp_path_factory.mktemp("triton")
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    log_path = root / "triton.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([python, "-m", "specdeploy.cli", "serve", str(micro_export), "--triton-repo",
                             str(root / "repo"), "--model-name", "micro", "--pool-size", "2",
                             "--port", str(http_port), "--grpc-port", str(grpc_port),
                             "--metrics-port", str(metrics_port)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"tritonserver exited:\n{log_path.read_text()[-4000:]}"
            try:
                if httpx.get(f"http://{url}/v2/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"tritonserver not ready:\n{log_path.read_text()[-4000:]}"
            time.sleep(0.5)
        yield {"http": url, "grpc": f"127.0.0.1:{grpc_port}", "metrics": f"http://127.0.0.1:{metrics_port}/metrics",
               "proc": proc, "log": log_path}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # forwarded to tritonserver: it drains, unloads, exits
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        log.close()


@pytest.fixture(scope="module")
def expected(micro_export):
    from specdeploy.runtime import Service

    svc = Service.load(micro_export, warmup=False)
    greedy = svc.generate(PROMPT, max_new_tokens=MAX_TOKENS, temperature=0)
    sampled = svc.generate(PROMPT, max_new_tokens=MAX_TOKENS, temperature=0.8, top_k=20, seed=7)
    penalized = svc.generate(PROMPT, max_new_tokens=MAX_TOKENS, temperature=0, logprobs=0, **PENALTIES)
    return {"greedy": greedy, "sampled": sampled, "prompt_ids": svc.tokenizer.encode(PROMPT), "penalized": penalized}


# float32 on the wire, as Triton's tensors carry them
PENALTIES = dict(repetition_penalty=float(np.float32(1.3)), presence_penalty=float(np.float32(0.5)),
                 frequency_penalty=float(np.float32(0.25)))


def inputs(module, prompt: str | None = PROMPT, ids: list[int] | None = None, stream: bool | None = None, **params):
    """Triton inputs as Triton's LLM backends name them."""
    types = {"max_tokens": ("INT32", np.int32), "temperature": ("FP32", np.float32), "top_k": ("INT32", np.int32),
             "top_p": ("FP32", np.float32), "random_seed": ("UINT64", np.uint64),
             "repetition_penalty": ("FP32", np.float32), "presence_penalty": ("FP32", np.float32),
             "frequency_penalty": ("FP32", np.float32), "return_log_probs": ("BOOL", bool),
             "min_p": ("FP32", np.float32)}
    out = []

    def add(name, dtype, value):
        tensor = module.InferInput(name, list(value.shape), dtype)
        tensor.set_data_from_numpy(value)
        out.append(tensor)

    if prompt is not None:
        add("text_input", "BYTES", np.array([prompt.encode()], dtype=np.object_))
    if ids is not None:
        add("input_ids", "INT32", np.array(ids, dtype=np.int32))
    params.setdefault("max_tokens", MAX_TOKENS)
    for name, value in params.items():
        if name == "stop_words":
            add(name, "BYTES", np.array([s.encode() for s in value], dtype=np.object_))
        else:
            dtype, kind = types[name]
            add(name, dtype, np.array([value], dtype=kind))
    if stream is not None:
        add("stream", "BOOL", np.array([stream]))
    return out


def text_of(result) -> str:
    return result.as_numpy("text_output")[0].decode()


def test_http_infer_equals_the_runtime(triton, expected):
    c = thttp.InferenceServerClient(triton["http"])
    assert c.is_model_ready("micro") and c.is_model_ready("micro_stream")
    result = c.infer("micro", inputs(thttp, temperature=0.0))
    assert text_of(result) == expected["greedy"].text
    assert result.as_numpy("output_ids").tolist() == expected["greedy"].token_ids
    assert result.as_numpy("finish_reason")[0] == b"length"
    stats = json.loads(result.as_numpy("stats")[0])
    assert stats["new_tokens"] == MAX_TOKENS and stats["prompt_tokens"] == len(expected["prompt_ids"])
    by_ids = c.infer("micro", inputs(thttp, prompt=None, ids=expected["prompt_ids"]))  # greedy by default
    assert by_ids.as_numpy("output_ids").tolist() == expected["greedy"].token_ids


def test_grpc_infer_and_sampling_parameters(triton, expected):
    c = tgrpc.InferenceServerClient(triton["grpc"])
    assert text_of(c.infer("micro", inputs(tgrpc))) == expected["greedy"].text
    sampled = c.infer("micro", inputs(tgrpc, temperature=0.8, top_k=20, random_seed=7))
    assert sampled.as_numpy("output_ids").tolist() == expected["sampled"].token_ids  # seeded: reproducible
    only_top = c.infer("micro", inputs(tgrpc, temperature=0.8, min_p=1.0, random_seed=7))  # min_p 1: the likeliest
    assert only_top.as_numpy("output_ids").tolist() == expected["greedy"].token_ids
    greedy = expected["greedy"].text
    stop = greedy.split()[0][:4]  # a piece of the first word: the text stops right before it
    stopped = c.infer("micro", inputs(tgrpc, stop_words=[stop]))
    assert stopped.as_numpy("finish_reason")[0] == b"stop"
    assert text_of(stopped) == greedy[:greedy.index(stop)]


def test_grpc_streaming_through_the_decoupled_model(triton, expected):
    c = tgrpc.InferenceServerClient(triton["grpc"])
    events: queue.Queue = queue.Queue()
    c.start_stream(callback=lambda result, error: events.put((result, error)))
    try:
        c.async_stream_infer("micro_stream", inputs(tgrpc, stream=True), request_id="s1")
        pieces, ids, final = [], [], None
        while final is None:
            result, error = events.get(timeout=60)
            assert error is None, error
            pieces.append(text_of(result))
            ids += result.as_numpy("output_ids").tolist()
            if result.as_numpy("finish_reason") is not None:
                final = result
    finally:
        c.stop_stream()
    assert len(pieces) == MAX_TOKENS + 1, "one response per token, then the last one"
    assert "".join(pieces) == expected["greedy"].text and ids == expected["greedy"].token_ids
    assert final.as_numpy("finish_reason")[0] == b"length"
    assert final.get_response().parameters["triton_final_response"].bool_param
    assert json.loads(final.as_numpy("stats")[0])["new_tokens"] == MAX_TOKENS


def test_penalties_and_log_probs_are_the_runtimes(triton, expected):
    """TensorRT-LLM's penalty inputs and return_log_probs, plain and streamed: the runtime's tokens and numbers."""
    want = expected["penalized"]
    assert want.token_ids != expected["greedy"].token_ids  # the penalties change this answer
    logprobs = [t.logprob for t in want.logprobs]
    result = thttp.InferenceServerClient(triton["http"]).infer("micro", inputs(thttp, return_log_probs=True,
                                                                                 **PENALTIES))
    assert result.as_numpy("output_ids").tolist() == want.token_ids
    assert result.as_numpy("output_log_probs").tolist() == pytest.approx(logprobs, abs=1e-5)
    assert result.as_numpy("cum_log_probs")[0] == pytest.approx(sum(logprobs), abs=1e-4)
    plain = thttp.InferenceServerClient(triton["http"]).infer("micro", inputs(thttp))
    assert plain.as_numpy("output_log_probs") is None and plain.as_numpy("cum_log_probs") is None

    c = tgrpc.InferenceServerClient(triton["grpc"])
    events: queue.Queue = queue.Queue()
    c.start_stream(callback=lambda result, error: events.put((result, error)))
    try:
        c.async_stream_infer("micro_stream", inputs(tgrpc, stream=True, return_log_probs=True, **PENALTIES))
        ids, streamed, final = [], [], None
        while final is None:
            result, error = events.get(timeout=60)
            assert error is None, error
            ids += result.as_numpy("output_ids").tolist()
            streamed += result.as_numpy("output_log_probs").tolist()
            # each response pairs its ids with their numbers (as TensorRT-LLM's backend does)
            assert len(result.as_numpy("output_log_probs")) == len(result.as_numpy("output_ids"))
            if result.as_numpy("finish_reason") is not None:
                final = result
    finally:
        c.stop_stream()
    assert ids == want.token_ids and streamed == pytest.approx(logprobs, abs=1e-5)
    assert final.as_numpy("cum_log_probs")[0] == pytest.approx(sum(logprobs), abs=1e-4)


@pytest.mark.parametrize("bad, message", [
    (dict(prompt=None), "give exactly one of 'text_input' or 'input_ids'"),
    (dict(temperature=-1.0), "temperature must be"),
    (dict(max_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(ids=[1, 2]), "give exactly one of"),  # both text and ids
    (dict(repetition_penalty=0.0), "repetition_penalty must be"),
])
def test_bad_inputs_get_a_clear_error(triton, bad, message):
    # a user's error, as Triton says it (HTTP 400, gRPC INVALID_ARGUMENT): through the plain model it was a 500
    with pytest.raises(InferenceServerException, match=message) as http_error:
        thttp.InferenceServerClient(triton["http"]).infer("micro", inputs(thttp, **bad))
    assert str(http_error.value.status()) == "400" and not http_error.value.message().startswith("[")
    with pytest.raises(InferenceServerException, match=message) as grpc_error:
        tgrpc.InferenceServerClient(triton["grpc"]).infer("micro", inputs(tgrpc, **bad))
    assert grpc_error.value.status() == "StatusCode.INVALID_ARGUMENT"
    events: queue.Queue = queue.Queue()
    c = tgrpc.InferenceServerClient(triton["grpc"])
    c.start_stream(callback=lambda result, error: events.put((result, error)))
    try:
        c.async_stream_infer("micro_stream", inputs(tgrpc, stream=True, **bad))
        result, error = events.get(timeout=30)
    finally:
        c.stop_stream()
    assert result is None and message in str(error)


def test_metrics_endpoint_counts_the_requests(triton):
    thttp.InferenceServerClient(triton["http"]).infer("micro", inputs(thttp, max_tokens=4))
    text = httpx.get(triton["metrics"], timeout=10).text
    counts = {line.split("{")[1].split(",")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("nv_inference_request_success{")}
    assert counts['model="micro"'] >= 1 and counts['model="micro_stream"'] >= 1
