"""What one server accepts: sizes, counts and times, set by `specdeploy serve` options."""

from __future__ import annotations

from dataclasses import dataclass

from ..runtime.errors import SpecDeployError

CONNECTION_HEADROOM = 64  # requests in progress beyond the admitted generations: /v1/models, refusals
MAX_TIMEOUT_S = 86400  # a day: past it a timeout is a typo, or meant as none (the template and tokenize
#                         timeouts wait on threads, whose waits past time_t raise OverflowError)


@dataclass(frozen=True)
class ServeLimits:
    max_model_len: int | None = None  # prompt + completion tokens; None: the export's max_context
    max_tokens: int | None = None  # completion tokens per request; None: what the context leaves
    max_concurrent_requests: int | None = None  # generation requests admitted at once; None: workers + queue
    max_connections: int | None = None  # HTTP requests in progress; None: concurrent + CONNECTION_HEADROOM
    max_body_bytes: int = 1 << 20
    max_header_bytes: int = 64 << 10  # request line and headers (serve/header_limit.py)
    body_timeout_s: float = 30.0  # to receive the whole body
    header_timeout_s: float = 10.0  # from a connection's opening (or last response) to a whole request head
    max_stop: int = 16  # stop strings per request (OpenAI allows 4)
    max_stop_chars: int = 256  # a stop string's length: text that may still become one is held back
    request_timeout_s: float | None = 600.0  # arrival to last token, queue included; None: no deadline
    template_timeout_s: float = 2.0  # rendering one chat prompt
    tokenize_timeout_s: float = 10.0  # tokenizing one prompt (a body-limited one takes well under a second)
    template_processes: int = 2

    def __post_init__(self):
        for name in ("max_model_len", "max_tokens", "max_concurrent_requests", "max_connections"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise SpecDeployError(f"{_option(name)} must be an integer >= 1, got {value!r}")
        for name in ("max_body_bytes", "max_header_bytes", "max_stop", "max_stop_chars", "template_processes"):
            if getattr(self, name) < 1:
                raise SpecDeployError(f"{_option(name)} must be >= 1, got {getattr(self, name)!r}")
        for name in ("body_timeout_s", "header_timeout_s", "request_timeout_s", "template_timeout_s",
                     "tokenize_timeout_s"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= MAX_TIMEOUT_S:  # 1e300: a thread's wait overflows (OverflowError)
                raise SpecDeployError(f"{_option(name)} must be > 0 and at most {MAX_TIMEOUT_S} seconds, got {value!r}")

    def model_len(self, max_context: int) -> int:
        """The context a request may use; more than the export holds is refused at start-up."""
        if self.max_model_len is None:
            return max_context
        if self.max_model_len > max_context:
            raise SpecDeployError(f"--max-model-len {self.max_model_len} is over the export's max context "
                                  f"({max_context} tokens)")
        return self.max_model_len

    def concurrent(self, pool_size: int, queue_size: int) -> int:
        return self.max_concurrent_requests or pool_size + queue_size

    def connections(self, concurrent: int) -> int:
        """HTTP requests in progress at once (generation requests past `concurrent` get 429 first)."""
        return self.max_connections or concurrent + CONNECTION_HEADROOM


API_ONLY = {"template_processes"}  # limits `serve` has no option for


def _option(field: str) -> str:
    """A limit as `serve` spells it, and as the embedding API does: --template-timeout (template_timeout_s)."""
    return field if field in API_ONLY else f"--{field.removesuffix('_s').replace('_', '-')} ({field})"
