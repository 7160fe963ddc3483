"""A request's choices: OpenAI's `n` (several answers to one prompt) and the completions' `best_of`
(that many candidates generated server-side, the `n` likeliest returned).

Each candidate is a generation of its own in the Service (an instance of the pool, or a row of
the batch), so a request of `n` costs what n requests cost, and admission counts it so: asking
for more candidates than the server runs generations at once is a 400, finding too few free a 429.

Seeds: candidate 0 samples with the request's seed, so `n: 1` and the first choice of `n: 4`
answer alike; candidate i with a 64-bit hash of (seed, i), so the choices differ and the request
still replays exactly. Without a seed each draws its own (runtime/sampling.py). Greedy candidates
(temperature 0) would be identical: the request generates once and repeats it.

`best_of` ranks the candidates by their mean token log probability (OpenAI's "highest log
probability per token"), the target's own (runtime/logprobs.py), asked of every candidate and
shown only where the request asked for logprobs. It cannot be streamed (as OpenAI's), since the
ranking needs every candidate whole.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from dataclasses import dataclass

from ..runtime.aio import AsyncRequest
from .errors import bad_request
from .openai_format import public_stats


def candidate_seed(seed: int | None, index: int) -> int | None:
    """The seed candidate `index` samples with: the request's for the first, a hash of (seed, index) after."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8, person=b"specdeploy-n").digest()
    return int.from_bytes(digest, "little")


@dataclass(frozen=True)
class Plan:
    """How many choices a request returns (`n`), candidates it asks for (`best_of`, else n), and generations
    it runs (one when greedy: its candidates would be identical)."""

    n: int
    candidates: int
    runs: int
    shows_logprobs: bool  # the request asked for logprobs (best_of asks every candidate for them anyway)

    @classmethod
    def of(cls, body, options: dict, limit: int) -> "Plan":
        """The request's plan, checked against the generations the server admits at once (`limit`)."""
        n = body.n or 1
        best_of = body.ranked()
        candidates = n if best_of is None else best_of
        param = "n" if best_of is None else "best_of"
        if candidates < n:
            raise bad_request(f"'best_of' ({best_of}) must be at least 'n' ({n})", "best_of")
        if body.stream and candidates > n:
            raise bad_request("'best_of' larger than 'n' cannot be streamed: the candidates are ranked once "
                              "all of them are complete", "best_of")
        if candidates > limit:  # greedy ones too, which run once: n copies still make a response n times as long
            raise bad_request(f"'{param}' is {candidates}: this server holds at most {limit} generations at once "
                              "(its workers and queue, within --max-concurrent-requests)", param)
        runs = 1 if options["temperature"] == 0 else candidates
        return cls(n, candidates, runs, options["logprobs"] is not None)

    def run_of(self, candidate: int) -> int:
        return 0 if self.runs == 1 else candidate

    def options(self, options: dict, run: int) -> dict:
        """The Service.request options of generation `run`. Of several, each waits for a worker without the
        queue's time limit: where workers are fewer than the choices, some wait for the request's own
        others, which the limit (meant for a busy server) would turn into a 429 that retrying cannot cure.
        The server applies the limit to the first of them to get a worker instead (app.py, _start); the
        request's deadline (--request-timeout) bounds them all."""
        ranked = self.candidates > self.n and self.runs > 1
        extra = {"timeout": float(threading.TIMEOUT_MAX)} if self.runs > 1 else {}
        return {**options, **extra, "seed": candidate_seed(options["seed"], run),
                "logprobs": 0 if ranked and options["logprobs"] is None else options["logprobs"]}

    def chosen(self, requests) -> list[int]:
        """The generation each returned choice shows, in choice order: best_of's n likeliest candidates (the
        highest mean token logprob first, ties to the earlier candidate), else the choices' own."""
        if self.candidates == self.n or self.runs == 1:
            return [self.run_of(i) for i in range(self.n)]
        return sorted(range(self.runs), key=lambda k: (-mean_logprob(requests[k]), k))[:self.n]

    def completion_tokens(self, requests) -> int:
        """Tokens of every candidate asked for (a repeated greedy one counts once per candidate)."""
        return sum(len(requests[self.run_of(c)].token_ids) for c in range(self.candidates))


def mean_logprob(request) -> float:
    logprobs = request.logprobs or ()  # none (max_tokens 0, scoring a prompt): every candidate ties
    return sum(t.logprob for t in logprobs) / len(logprobs) if logprobs else 0.0


def combined_stats(requests) -> dict:
    """The `specdeploy` extension field of a response: one generation's numbers, or its generations' together
    (they ran side by side: the longest one's seconds)."""
    if len(requests) == 1:
        return public_stats(requests[0].stats)
    stats = [r.stats for r in requests]
    tokens = sum(s.get("new_tokens", 0) for s in stats)
    calls = sum(s.get("target_calls", 0) for s in stats)
    seconds = max((s.get("seconds", 0.0) for s in stats), default=0.0)
    total = {"method": stats[0].get("method"), "target_calls": calls,
             "acceptance_length": tokens / calls if calls else 0.0,
             "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
             "queue_s": max((s.get("queue_s", 0.0) for s in stats), default=0.0), "seconds": seconds}
    return public_stats({k: v for k, v in total.items() if v is not None})


async def merged(runs: list[AsyncRequest]):
    """(generation index, a batch of its ready events) as they come from any of `runs`, and (index, None) when
    one ends; an error of any generation is raised here. Closing it early stops every generation."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, run: AsyncRequest) -> None:
        try:
            async for batch in run.batches():
                queue.put_nowait((index, batch, None))
            queue.put_nowait((index, None, None))
        except Exception as exc:
            queue.put_nowait((index, None, exc))

    tasks = [asyncio.ensure_future(pump(i, run)) for i, run in enumerate(runs)]
    try:
        left = len(runs)
        while left:
            index, batch, error = await queue.get()
            if error is not None:
                raise error
            left -= batch is None
            yield index, batch
    finally:
        for task in tasks:
            task.cancel()
        for run in runs:
            run.cancel()
