"""Triton Inference Server model (Python backend) over specdeploy's runtime: decoupled, streams tokens.

Copied as `model.py` into the `<name>_stream` model of a repository written by
`specdeploy serve OUT --triton-repo DIR` (triton_repo.py writes its config.pbtxt). Each
Triton instance of it loads one Service (a pool of export instances); `execute` hands every
request to a thread of its own and returns at once, so one instance serves as many requests
at a time as its pool (the Service's queue holds more, up to its limit).

Inputs follow Triton's LLM backends (TensorRT-LLM, vLLM): `text_input` or `input_ids`;
optional `max_tokens`, `temperature` (default 0: greedy), `top_k`, `top_p`, `min_p`, `random_seed`,
`stop_words`, `repetition_penalty`, `presence_penalty`, `frequency_penalty` (runtime/penalties.py),
`return_log_probs`, `stream` (default false), and the extensions `method` and `ignore_eos`.
Outputs: `text_output` and `output_ids` (with `stream`, one response per token, then a last
one with empty text and ids), and in the last response `finish_reason` and `stats` (JSON).
With `return_log_probs`, `output_log_probs` (each of `output_ids`' log probability, the target's:
runtime/logprobs.py; streamed, each response's with its id) and, last, `cum_log_probs` (their sum).
A bad request gets one error response (Triton's INVALID_ARG; UNAVAILABLE when full).
"""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # imported outside Triton (documentation, linters): nothing to run
    pb_utils = None

DEFAULT_MAX_TOKENS = 64
CANCEL_CHECK_S = 0.05  # how often a generation asks whether its client cancelled


class BadInput(ValueError):
    pass


def parameters(model_config: dict) -> dict[str, str]:
    return {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}


def _tensor(request, name: str):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _scalar(request, name: str, kind, default):
    value = _tensor(request, name)
    if value is None:
        return default
    if value.size != 1:
        raise BadInput(f"'{name}' takes one value, got {value.size}")
    value = value.reshape(-1)[0]
    if kind is str:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)
    return kind(value)


def request_options(request) -> tuple[dict, bool]:
    """Service.request() keywords and whether to stream, from one Triton request."""
    text, ids = _tensor(request, "text_input"), _tensor(request, "input_ids")
    if (text is None) == (ids is None):
        raise BadInput("give exactly one of 'text_input' or 'input_ids'")
    options: dict = {}
    if text is not None:
        if text.size != 1:
            raise BadInput(f"'text_input' takes one string, got {text.size}")
        raw = text.reshape(-1)[0]
        try:
            options["prompt"] = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
        except UnicodeDecodeError:
            raise BadInput("'text_input' is not UTF-8") from None
    else:
        options["prompt_ids"] = [int(t) for t in ids.reshape(-1)]
        if not options["prompt_ids"]:
            raise BadInput("'input_ids' is empty")
    options["max_new_tokens"] = _scalar(request, "max_tokens", int, DEFAULT_MAX_TOKENS)
    options["temperature"] = _scalar(request, "temperature", float, 0.0)
    options["top_k"] = _scalar(request, "top_k", int, 0)
    options["top_p"] = _scalar(request, "top_p", float, 1.0)
    options["min_p"] = _scalar(request, "min_p", float, 0.0)
    options["seed"] = _scalar(request, "random_seed", int, None)
    options["ignore_eos"] = _scalar(request, "ignore_eos", bool, False)
    options["method"] = _scalar(request, "method", str, None) or None
    options["repetition_penalty"] = _scalar(request, "repetition_penalty", float, 1.0)
    options["presence_penalty"] = _scalar(request, "presence_penalty", float, 0.0)
    options["frequency_penalty"] = _scalar(request, "frequency_penalty", float, 0.0)
    options["logprobs"] = 0 if _scalar(request, "return_log_probs", bool, False) else None
    stop = _tensor(request, "stop_words")
    if stop is not None:
        options["stop"] = [s.decode("utf-8") if isinstance(s, bytes) else str(s) for s in stop.reshape(-1) if s]
    return options, _scalar(request, "stream", bool, False)


def _response(text: str, ids: list[int], finish_reason: str | None = None, stats: dict | None = None,
              logprobs: list[float] | None = None, cumulative: float | None = None):
    """`logprobs`: output_log_probs (asked for: return_log_probs); `cumulative`: cum_log_probs (the last response)."""
    tensors = [pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
               pb_utils.Tensor("output_ids", np.array(ids, dtype=np.int32))]
    if logprobs is not None:
        tensors.append(pb_utils.Tensor("output_log_probs", np.array(logprobs, dtype=np.float32)))
    if cumulative is not None:
        tensors.append(pb_utils.Tensor("cum_log_probs", np.array([cumulative], dtype=np.float32)))
    if finish_reason is not None:
        tensors.append(pb_utils.Tensor("finish_reason", np.array([finish_reason.encode()], dtype=np.object_)))
        tensors.append(pb_utils.Tensor("stats", np.array([json.dumps(stats or {}).encode()], dtype=np.object_)))
    return pb_utils.InferenceResponse(output_tensors=tensors)


def _error(message: str, code_name: str, tagged: bool = False):
    """An error response; `tagged` (a request from the plain model, triton_front.py): the code's name leads
    the message too, since Triton's BLS call hands that model every error as INTERNAL."""
    code = getattr(pb_utils.TritonError, code_name, None)
    message = f"[{code_name}] {message}" if tagged else message
    error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
    return pb_utils.InferenceResponse(error=error)


def _tagged(request) -> bool:
    """Whether the request came from the plain model asking for its errors' codes (triton_front.CODES_PARAMETER)."""
    from specdeploy.serve.triton_front import CODES_PARAMETER  # this file runs as Triton's copy: no relative import

    try:
        return bool(json.loads(request.parameters() or "{}").get(CODES_PARAMETER))
    except (AttributeError, TypeError, ValueError):
        return False


def public_stats(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = parameters(config)
        from specdeploy.runtime import Service
        from specdeploy.runtime.backends import use_shared_threads
        from specdeploy.runtime.errors import SpecDeployError
        from specdeploy.runtime.pool import BusyError

        self.SpecDeployError, self.BusyError = SpecDeployError, BusyError
        # Each Triton instance is a process of its own: by default they split the cores, as replicas do.
        instances = sum(int(group.get("count", 1)) for group in config.get("instance_group", [])) or 1
        threads = int(params.get("threads") or 0) or max(1, (os.cpu_count() or 1) // instances)
        use_shared_threads(threads)  # this stub process: one ORT pool for all its workers
        self.service = Service.load(params["export_dir"], pool_size=int(params.get("pool_size") or 1),
                                    queue_size=int(params.get("queue_size") or 8),
                                    queue_timeout=float(params.get("queue_timeout") or 30.0),
                                    method=params.get("method") or None, backend=params.get("backend") or "auto",
                                    threads=threads)
        self._lock = threading.Lock()
        self._running: set = set()

    def execute(self, requests):
        for request in requests:
            sender, tagged = request.get_response_sender(), _tagged(request)
            try:
                options, stream = request_options(request)
                req = self.service.request(**options, request_id=request.request_id() or None)
            except (BadInput, self.SpecDeployError, ValueError, OverflowError) as exc:
                final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
                sender.send(_error(str(exc), "INVALID_ARG", tagged), flags=final)
                continue
            thread = threading.Thread(target=self._run, args=(req, sender, stream, tagged), daemon=True,
                                      name=f"specdeploy-{req.id[:8]}")
            with self._lock:
                self._running.add((req, thread))
            thread.start()
        # Decoupled: nothing to return, the responses go out through each request's sender.

    def _run(self, req, sender, stream: bool, tagged: bool = False) -> None:
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        checked = time.monotonic()
        wants = req.top_logprobs is not None  # return_log_probs
        ids: list[int] = []
        logprobs: list[float] = []  # each of ids' own, as it comes (TokenEvent.logprob)
        try:
            with req:  # frees the worker however this ends
                for event in req:
                    if time.monotonic() - checked > CANCEL_CHECK_S:  # asking the server costs a round trip
                        checked = time.monotonic()
                        if _cancelled(sender):  # the client went away or cancelled its stream
                            req.cancel()
                            break
                    new = [event.token_id] if event.token_id >= 0 else []  # -1: the text held to the end
                    own = [event.logprob] if wants and new else []
                    ids += new
                    logprobs += own
                    if stream:
                        sender.send(_response(event.text, new, logprobs=own if wants else None))
                text = "" if stream else req.text
                shown = None if not wants else [] if stream else logprobs
                sender.send(_response(text, [] if stream else ids, req.finish_reason, public_stats(req.stats),
                                      shown, float(sum(logprobs)) if wants else None), flags=final)
        except self.BusyError as exc:
            _send_quietly(sender, _error(str(exc), "UNAVAILABLE", tagged), final)
        except Exception as exc:
            _send_quietly(sender, _error(f"generation failed: {exc}", "INTERNAL", tagged), final)
        finally:
            with self._lock:
                self._running = {item for item in self._running if item[0] is not req}

    def finalize(self):
        """Unloading or shutting down: cancel what still runs; each thread ends within one step."""
        with self._lock:
            running = list(self._running)
        for req, _ in running:
            req.cancel()
        for _, thread in running:
            thread.join(timeout=10)


def _cancelled(sender) -> bool:
    is_cancelled = getattr(sender, "is_cancelled", None)
    return bool(is_cancelled()) if is_cancelled is not None else False


def _send_quietly(sender, response, flags) -> None:
    try:
        sender.send(response, flags=flags)
    except Exception:  # the stream is gone already
        pass
