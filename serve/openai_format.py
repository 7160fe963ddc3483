"""Response and stream-chunk bodies in OpenAI's shapes (completions and chat completions)."""

from __future__ import annotations

import json
import time
import uuid


class Shape:
    """One response's id, timestamps and model; builds its full body and its stream chunks."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    def response(self, text: str, finish_reason: str, usage: dict, stats: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            return self._envelope("chat.completion", [choice], usage=usage, specdeploy=stats)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice], usage=usage, specdeploy=stats)

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False) -> str:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return sse(self._envelope("chat.completion.chunk", [choice]))
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return sse(self._envelope("text_completion", [choice]))

    def usage_chunk(self, usage: dict, stats: dict) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse(self._envelope(obj, [], usage=usage, specdeploy=stats))


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def public_stats(stats: dict) -> dict:
    """The per-request numbers worth showing a client (an extension field OpenAI clients ignore)."""
    keys = ("method", "acceptance_length", "target_calls", "tokens_per_s", "queue_s", "seconds")
    return {k: (round(stats[k], 6) if isinstance(stats[k], float) else stats[k]) for k in keys if k in stats}


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"
