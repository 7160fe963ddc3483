"""Response and stream-chunk bodies in OpenAI's shapes (completions and chat completions).

Logprobs, when asked for, in each API's own shape: chat's `logprobs.content` (a token's text, its
UTF-8 `bytes`, its log probability and `top_logprobs`), the legacy completions' parallel lists
(`tokens`, `token_logprobs`, `top_logprobs` as {token: logprob} with the sampled token always
among them, as OpenAI's, so up to N + 1; `text_offset`: where each token's text starts in the
completion's text). A token's text is its bytes decoded alone; a token that holds part of a UTF-8
character is written "bytes:\\xe2\\x80" (OpenAI's form), so no two tokens share a text.
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from collections.abc import Callable, Sequence

from ..runtime.logprobs import TokenLogprob


class Shape:
    """One response's id, timestamps and model; builds its full body and its stream chunks."""

    def __init__(self, chat: bool, model: str, token_bytes: Callable[[int], bytes] | None = None,
                 echo: str | None = None):
        """`token_bytes`: the tokenizer's (TextTokenizer.token_bytes), for responses with logprobs; `echo`: the
        prompt's text a completion begins with (its tokens' text offsets are then past it)."""
        self.chat, self.model, self.token_bytes, self.echo = chat, model, token_bytes, echo
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def echoing(self, echo: str) -> "Shape":
        """This response's shape for the choices of a prompt it echoes (a completion's list of prompts: each
        its own text), under the same id."""
        shape = copy.copy(self)
        shape.echo = echo
        return shape

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    def choice(self, index: int, text: str, finish_reason: str, logprobs: Sequence[TokenLogprob] | None = None,
               prompt: tuple | None = None) -> dict:
        """One choice of a full response; `prompt`: (its token ids, their logprobs) for an echo with logprobs."""
        shown = self.logprobs(logprobs)
        if self.echo is not None:
            text = self.echo + text
            before = self.prompt_logprobs(*prompt) if prompt is not None else None
            if shown is not None and before is not None:
                shown = {key: before[key] + shown[key] for key in shown}
        if self.chat:
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": shown,
                    "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": shown, "finish_reason": finish_reason}

    def response(self, choices: list[dict], usage: dict, stats: dict) -> dict:
        obj = "chat.completion" if self.chat else "text_completion"
        return self._envelope(obj, choices, usage=usage, specdeploy=stats)

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False,
              logprobs: Sequence[TokenLogprob] | None = None, index: int = 0) -> str:
        """One stream chunk of choice `index`; `logprobs`: those of the tokens whose text it carries (None: not
        asked for)."""
        shown = self.logprobs(logprobs)
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": shown, "finish_reason": finish_reason}
            return sse(self._envelope("chat.completion.chunk", [choice]))
        choice = {"index": index, "text": text or "", "logprobs": shown, "finish_reason": finish_reason}
        return sse(self._envelope("text_completion", [choice]))

    def echo_chunk(self, prompt: tuple | None, index: int = 0) -> str:
        """A stream's first chunk of choice `index` when it echoes: the prompt's text (and its logprobs: `prompt`
        as in choice)."""
        choice = {"index": index, "text": self.echo, "logprobs": self.prompt_logprobs(*prompt) if prompt else None,
                  "finish_reason": None}
        return sse(self._envelope("text_completion", [choice]))

    def prompt_logprobs(self, ids: Sequence[int], logprobs: Sequence[TokenLogprob | None]) -> dict:
        """The legacy lists for the prompt's tokens: the first token's logprob and alternatives null."""
        first = self.logprobs([TokenLogprob(ids[0], 0.0)], shift=0)
        rest = self.logprobs([lp for lp in logprobs[1:] if lp is not None], shift=0)
        assert first is not None and rest is not None
        first.update(token_logprobs=[None], top_logprobs=[None])
        return {key: first[key] + rest[key] for key in first}

    def logprobs(self, tokens: Sequence[TokenLogprob] | None, shift: int | None = None) -> dict | None:
        """The `logprobs` of a choice (or of a chunk's tokens, in order; a stream's offsets run on)."""
        if tokens is None:
            return None
        assert self.token_bytes is not None, "a Shape that shows logprobs needs the tokenizer's token_bytes"

        token_bytes = self.token_bytes

        def text(token_id: int) -> str:
            return token_text(token_bytes(token_id))

        if self.chat:
            def entry(token_id: int, logprob: float) -> dict:
                raw = token_bytes(token_id)
                return {"token": token_text(raw), "logprob": logprob, "bytes": list(raw)}

            return {"content": [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, v) for i, v in t.top]}
                               for t in tokens], "refusal": None}

        def top(t: TokenLogprob) -> dict:
            out: dict[str, float] = {}
            for i, v in (*t.top, (t.token_id, t.logprob)):  # the sampled token too, if not among the top
                out.setdefault(text(i), v)
            return out

        if shift is None:  # a completion's own tokens: past an echoed prompt
            shift = len(self.echo or "")
        return {"tokens": [text(t.token_id) for t in tokens], "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [top(t) for t in tokens], "text_offset": [shift + t.text_offset for t in tokens]}

    def usage_chunk(self, usage: dict, stats: dict) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse(self._envelope(obj, [], usage=usage, specdeploy=stats))


def token_text(raw: bytes) -> str:
    """A token's text: its bytes as UTF-8, or OpenAI's "bytes:\\xNN..." where they are part of a character."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def public_stats(stats: dict) -> dict:
    """The per-request numbers worth showing a client (an extension field OpenAI clients ignore)."""
    # sampling and seed: which scheme drew the tokens, and the seed that replays them where it is seeded
    keys = ("method", "acceptance_length", "target_calls", "tokens_per_s", "queue_s", "seconds", "sampling", "seed")
    return {k: (round(stats[k], 6) if isinstance(stats[k], float) else stats[k]) for k in keys if k in stats}


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"
