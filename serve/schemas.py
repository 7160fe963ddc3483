"""Request bodies of the OpenAI endpoints, validated strictly (a wrong type is a 400, never coerced).

Fields OpenAI defines that this server cannot honour are refused with a 400 when set to a
non-default value rather than silently ignored (`unsupported()`): what changes the output
(the completions' suffix: insertion) or asks for a capability the model
does not have here (tools and the legacy functions/function_call, response_format, audio
output: modalities/audio, web_search_options, reasoning_effort: OpenAI itself refuses it for
a model that does not reason). Accepted and ignored, as they change nothing in the text
generated: `user`, `metadata`, `store`, `service_tier`, `prompt_cache_key`, `prompt_cache_options`,
`prompt_cache_retention`, `safety_identifier`, `parallel_tool_calls` (moot without tools) and
`prediction` (a hint that only speeds up a matching output); each is still type-checked. Any other
field is refused as OpenAI refuses it ("Unrecognized request argument supplied"), in the body and
in `stream_options`: a misspelt `max_token` or another server's extension (vLLM's `min_tokens`,
`stop_token_ids`, `guided_json`) would otherwise change the answer without a word; the OpenAPI
document says so (`additionalProperties: false`). Extensions: `method`, `top_k`, `min_p`, `ignore_eos`, `sampling`,
`repetition_penalty` (HF's, as vLLM takes it); `frequency_penalty`, `presence_penalty` and
`logit_bias` are OpenAI's (runtime/penalties.py).
`logprobs` (completions: alternatives per token; chat: with `top_logprobs`) is served: the
target's own log probabilities, whichever method drafted (runtime/logprobs.py); so is the
completions' `echo` (the prompt's text before the completion's, and with `logprobs` the prompt
tokens' too, the first null: what evaluation harnesses score a text by). So are `n`, the
completions' `best_of` and their list of prompts (serve/choices.py).
"""

from __future__ import annotations

import difflib
import json
import math
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..runtime.logprobs import MAX_TOP
from ..runtime.penalties import MAX_BIASES, REPETITION
from ..runtime.tokenizer import bad_char
from .errors import ApiError, bad_request

EXTENSIONS = ("method", "top_k", "min_p", "repetition_penalty", "ignore_eos", "sampling")  # besides OpenAI's
MAX_JSON_DEPTH = 64  # a real request nests 5 deep; deeper only costs recursion (and a RecursionError)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: Optional[bool] = None
    include_obfuscation: Optional[bool] = None  # random padding of stream events against side channels: ignored


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    max_tokens: Optional[int] = Field(None, ge=0)  # 0: only with a completion's echo and logprobs (scoring)
    temperature: Optional[float] = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: Optional[float] = Field(None, ge=0, le=1, allow_inf_nan=False)  # 0: the most probable token only
    n: Optional[int] = Field(None, ge=1)
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    # Fields typed Any are checked by hand for a clear message; their OpenAPI schema says what is accepted.
    stop: Any = Field(None, json_schema_extra={"anyOf": [{"type": "string"}, {"type": "null"},
                                                          {"type": "array", "items": {"type": "string"}}]})
    # a Philox key (runtime/sampling.py): OpenAI's int64 range, a negative seed taken as its 64 bits
    # (two's complement: -1 is 2**64 - 1), and up to 2**64 - 1, the seeds responses report (serve/choices.py)
    seed: Optional[int] = Field(None, ge=-(2**63), lt=2**64)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2, allow_inf_nan=False)
    logit_bias: Optional[dict] = None
    user: Optional[str] = None
    # OpenAI's, accepted and ignored: they change nothing in the text generated (module docstring)
    metadata: Optional[dict] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_options: Optional[dict] = None
    prompt_cache_retention: Optional[str] = None
    safety_identifier: Optional[str] = None
    parallel_tool_calls: Optional[bool] = None
    prediction: Optional[dict] = None
    # specdeploy extensions (the openai client sends them with extra_body=...)
    method: Optional[str] = None
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0, le=1, allow_inf_nan=False)  # HF's / vLLM's (runtime/sampling.py)
    repetition_penalty: Optional[float] = Field(None, ge=REPETITION[0], le=REPETITION[1], allow_inf_nan=False)
    ignore_eos: Optional[bool] = None
    # how drafts are accepted; None: seeded with a seed, else the method's default (runtime/generate.py)
    sampling: Optional[Literal["seeded", "rejection"]] = None

    def unsupported(self) -> list[tuple[str, bool]]:
        """(field, is set to something this server cannot do)."""
        return []

    def sampling_seed(self) -> int | None:
        """The seed as the sampler keys on it: 64 bits, a negative one in two's complement."""
        return None if self.seed is None else self.seed % 2**64

    def alternatives(self) -> int | None:
        """How many alternatives per token the response's logprobs list; None: no logprobs."""
        return None

    def echoes(self) -> bool:
        """Whether the response begins with the prompt (completions' `echo`)."""
        return False

    def ranked(self) -> int | None:
        """Candidates to rank for the n returned (completions' `best_of`); None: the n choices themselves."""
        return None


class CompletionRequest(_Common):
    prompt: Any = Field(json_schema_extra={"anyOf": [  # a string, token ids, or a list of either (serve/choices.py)
        {"type": "string"}, {"type": "array", "items": {"type": "integer", "minimum": 0}},
        {"type": "array", "items": {"anyOf": [{"type": "string"},
                                              {"type": "array", "items": {"type": "integer", "minimum": 0}}]}}]})
    echo: Optional[bool] = None
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP)  # alternatives per token (OpenAI's legacy API: up to 5)
    best_of: Optional[int] = Field(None, ge=1)  # candidates generated, the n likeliest returned (serve/choices.py)
    suffix: Optional[str] = None

    def alternatives(self) -> int | None:
        return self.logprobs

    def ranked(self) -> int | None:
        return self.best_of

    def echoes(self) -> bool:
        return bool(self.echo)

    def unsupported(self):
        return super().unsupported() + [("suffix", bool(self.suffix))]


# OpenAI's roles (function, deprecated, aside); the chat template decides what it renders of them.
ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal[ROLES]  # type: ignore[valid-type]
    content: Any = Field(None, json_schema_extra={"anyOf": [{"type": "string"}, {"type": "null"}, {
        "type": "array", "items": {"type": "object", "required": ["type", "text"],
                                   "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]})


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP)
    tools: Optional[list] = None
    tool_choice: Any = None
    functions: Optional[list] = None  # OpenAI's deprecated form of tools
    function_call: Any = None  # and of tool_choice
    response_format: Optional[dict] = None
    modalities: Optional[list] = None
    audio: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None  # how long a reasoning model's answer runs: this server has no such knob
    moderation: Any = None  # moderating the input and output: this server runs none

    def alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported(self):
        fmt = (self.response_format or {}).get("type", "text")
        return super().unsupported() + [("tools", bool(self.tools)),
                                        ("tool_choice", self.tool_choice not in (None, "none", "auto")),
                                        ("functions", bool(self.functions)),
                                        ("function_call", self.function_call not in (None, "none", "auto")),
                                        ("response_format", fmt != "text"),
                                        ("modalities", self.modalities not in (None, ["text"])),
                                        ("audio", self.audio is not None),
                                        ("web_search_options", self.web_search_options is not None),
                                        ("reasoning_effort", self.reasoning_effort is not None),
                                        ("verbosity", self.verbosity not in (None, "medium")),
                                        ("moderation", self.moderation is not None)]


# What the OpenAPI document allows for the fields `unsupported()` refuses otherwise.
_NULL = {"type": "null"}
SERVED_VALUES = {
    "logit_bias": {"anyOf": [{"type": "object", "maxProperties": MAX_BIASES, "propertyNames": {"pattern": "^[0-9]+$"},
                              "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}, _NULL]},
    "suffix": {"anyOf": [{"const": ""}, _NULL]},
    "tools": {"anyOf": [{"type": "array", "maxItems": 0}, _NULL]},
    "tool_choice": {"anyOf": [{"enum": ["none", "auto"]}, _NULL]},
    "functions": {"anyOf": [{"type": "array", "maxItems": 0}, _NULL]},
    "function_call": {"anyOf": [{"enum": ["none", "auto"]}, _NULL]},
    "modalities": {"anyOf": [{"type": "array", "items": {"const": "text"}, "minItems": 1, "maxItems": 1}, _NULL]},
    "audio": _NULL,
    "web_search_options": _NULL,
    "reasoning_effort": _NULL,
    "verbosity": {"anyOf": [{"const": "medium"}, _NULL]},
    "moderation": _NULL,
    "response_format": {"anyOf": [{"type": "object", "properties": {"type": {"const": "text"}}}, _NULL]},
}


def served_schema(model_cls: type[_Common]) -> dict:
    """The request body's JSON schema, narrowed to the values this server serves ($defs inline)."""
    schema = model_cls.model_json_schema(ref_template="#/components/schemas/{model}")
    fields = schema["properties"]
    for name, allowed in SERVED_VALUES.items():
        if name in fields:
            fields[name] = allowed
    return schema


def parse_json(raw: bytes) -> Any:
    def no_constants(name):  # NaN / Infinity are not JSON
        raise ValueError(f"{name} is not valid JSON")

    too_deep = bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", None, "invalid_json")
    try:
        data = json.loads(raw, parse_constant=no_constants)
    except RecursionError:
        raise too_deep from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {str(exc)[:200]}", None, "invalid_json") from None
    if _deeper_than(data, MAX_JSON_DEPTH):
        raise too_deep
    _check_text(data)
    return data


def _check_text(data: Any) -> None:
    """Every string of the body (keys included) must be text: JSON can escape a lone surrogate
    ("\\ud800"), which no tokenizer, template process or response can encode. One check here for every
    field, named as validation errors name them."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise bad_request(f"invalid '{path}': not valid UTF-8 text ({bad_char(item[exc.start])} at "
                                  f"character {exc.start})", path or None) from None
        elif isinstance(item, dict):
            for key, value in item.items():
                child = f"{path}.{key}" if path else key
                try:
                    key.encode("utf-8")
                except UnicodeEncodeError:
                    raise bad_request(f"a key of '{path or 'the request body'}' is not valid UTF-8 text",
                                      path or None) from None
                stack.append((value, child))
        elif isinstance(item, list):
            stack.extend((value, f"{path}[{i}]") for i, value in enumerate(item))


def _deeper_than(value: Any, limit: int) -> bool:
    """Without recursion (the point is to refuse what recursion cannot handle)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth >= limit:
                    return True
                stack.append((child, depth + 1))
    return False


def validate(model_cls: type[_Common], data: Any) -> _Common:
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}", None, "invalid_type")
    try:
        body = model_cls.model_validate(data)
    except ValidationError as exc:
        raise _api_error(exc.errors()[0], model_cls) from None
    for field, refused in body.unsupported():
        if refused:
            raise bad_request(f"'{field}' is not supported by this server (value {getattr(body, field)!r})",
                              field, "unsupported_parameter")
    if isinstance(body, ChatRequest) and body.top_logprobs is not None and not body.logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return body


def token_biases(bias: dict | None, vocab: int) -> dict[int, float]:
    """OpenAI's logit_bias ({"token id": -100..100}) as {id: bias}, each entry checked here (400 naming it)."""
    if not bias:
        return {}
    if len(bias) > MAX_BIASES:
        raise bad_request(f"'logit_bias' has {len(bias)} entries; at most {MAX_BIASES} are allowed", "logit_bias")
    out = {}
    for key, value in bias.items():
        digits = key.lstrip("0") or "0"  # int() refuses strings past 4,300 digits (a ValueError): measure first
        if not key.isascii() or not key.isdigit() or len(digits) > len(str(vocab)) or int(digits) >= vocab:
            raise bad_request(f"invalid 'logit_bias': {key[:40]!r} is not a token id of this model (0 to {vocab - 1})",
                              "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad_request(f"invalid 'logit_bias': the bias of token {digits} must be a number from -100 to 100 "
                              f"(got {str(value)[:40]})", "logit_bias")
        out[int(digits)] = float(value)
    return out


def stop_strings(stop: Any, max_count: int, max_chars: int) -> list[str]:
    """The request's stop strings, within the server's limits (streamed text that could begin one waits)."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad_request("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(stop) > max_count:
        raise bad_request(f"'stop' has {len(stop)} strings; at most {max_count} are allowed", "stop")
    longest = max((len(s) for s in stop), default=0)
    if longest > max_chars:
        raise bad_request(f"a stop string has {longest} characters; at most {max_chars} are allowed", "stop")
    return [s for s in stop if s]


def _api_error(err: dict, model_cls: type[BaseModel]) -> ApiError:
    param = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(err["loc"]))
    kind = err["type"]
    if kind == "extra_forbidden":  # OpenAI's own words for it, and what was probably meant
        nested = len(err["loc"]) > 1 and err["loc"][0] == "stream_options"
        name, known = str(err["loc"][-1]), list((StreamOptions if nested else model_cls).model_fields)
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        return bad_request(f"Unrecognized request argument supplied: {param} ({hint}this server's own fields: "
                           f"{', '.join(EXTENSIONS)})", param, "unrecognized_argument")
    if kind == "missing":
        return bad_request(f"missing required parameter: '{param}'", param, "missing_required_parameter")
    got = err.get("input")
    shown = repr(got) if not isinstance(got, float) or math.isfinite(got) else str(got)
    code = "invalid_type" if kind.endswith("_type") or kind.endswith("_parsing") else "invalid_value"
    msg = f"{err['msg'][0].lower()}{err['msg'][1:]}"
    return bad_request(f"invalid '{param}': {msg} (got {shown[:100]})", param or None, code)
