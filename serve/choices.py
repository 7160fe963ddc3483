"""A request's choices: OpenAI's `n` (several answers to one prompt), the completions' `best_of`
(that many candidates generated server-side, the `n` likeliest returned), and the completions' list
of prompts (each prompt's choices in turn).

Each candidate is a generation of its own in the Service (an instance of the pool, or a row of
the batch), so a request of `n` costs what n requests cost, and admission counts it so: asking
for more candidates (prompts x candidates) than the server holds generations at once is a 400,
finding too few places free a 429.

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
    """How many prompts a request sends (completions take a list), choices it returns for each (`n`),
    candidates it asks for each (`best_of`, else n), and generations it runs for each (one when greedy: its
    candidates would be identical). Generation k serves prompt k // per_prompt; a response lists each
    prompt's choices in turn (choice index prompt x n + j, as OpenAI and vLLM number them)."""

    prompts: int
    n: int
    candidates: int
    per_prompt: int
    shows_logprobs: bool  # the request asked for logprobs (best_of asks every candidate for them anyway)

    @classmethod
    def of(cls, body, options: list[dict], limit: int) -> "Plan":
        """The request's plan (`options`: each prompt's Service.request options), checked against the
        generations the server holds at once (`limit`)."""
        n = body.n or 1
        best_of = body.ranked()
        candidates = n if best_of is None else best_of
        param = "n" if best_of is None else "best_of"
        if candidates < n:
            raise bad_request(f"'best_of' ({best_of}) must be at least 'n' ({n})", "best_of")
        if body.stream and candidates > n:
            raise bad_request("'best_of' larger than 'n' cannot be streamed: the candidates are ranked once "
                              "all of them are complete", "best_of")
        # greedy ones too, which run once: n copies still make a response n times as long
        if len(options) * candidates > limit:
            what = f"'{param}' is {candidates}" if len(options) == 1 else \
                f"{len(options)} prompts x {candidates} ('{param}') are {len(options) * candidates} generations"
            raise bad_request(f"{what}: this server holds at most {limit} generations at once (its workers and "
                              "queue, within --max-concurrent-requests)", param if candidates > 1 else "prompt")
        per_prompt = 1 if options[0]["temperature"] == 0 else candidates
        return cls(len(options), n, candidates, per_prompt, options[0]["logprobs"] is not None)

    @property
    def runs(self) -> int:
        return self.prompts * self.per_prompt

    def run_of(self, prompt: int, candidate: int) -> int:
        return prompt * self.per_prompt + (0 if self.per_prompt == 1 else candidate)

    def options(self, options: list[dict], run: int) -> dict:
        """The Service.request options of generation `run`. Of several, each waits for a worker without the
        queue's time limit: where workers are fewer than the generations, some wait for the request's own
        others, which the limit (meant for a busy server) would turn into a 429 that retrying cannot cure.
        The server applies the limit to the first of them to get a worker instead (app.py, _start); the
        request's deadline (--request-timeout) bounds them all."""
        prompt, candidate = divmod(run, self.per_prompt)
        mine = options[prompt]
        ranked = self.candidates > self.n and self.per_prompt > 1
        extra = {"timeout": float(threading.TIMEOUT_MAX)} if self.runs > 1 else {}
        return {**mine, **extra, "seed": candidate_seed(mine["seed"], candidate),
                "logprobs": 0 if ranked and mine["logprobs"] is None else mine["logprobs"]}

    def chosen(self, requests) -> list[int]:
        """The generation each returned choice shows, in choice order: for each prompt, best_of's n likeliest
        candidates (the highest mean token logprob first, ties to the earlier one), else its choices' own."""
        out = []
        for prompt in range(self.prompts):
            if self.candidates == self.n or self.per_prompt == 1:
                out += [self.run_of(prompt, j) for j in range(self.n)]
            else:
                runs = [self.run_of(prompt, c) for c in range(self.candidates)]
                out += sorted(runs, key=lambda k: (-mean_logprob(requests[k]), k))[:self.n]
        return out

    def shown_by(self, run: int) -> list[int]:
        """The choice indexes that show generation `run` (a stream's: no ranking)."""
        prompt = run // self.per_prompt
        return [prompt * self.n + j for j in range(self.n) if self.run_of(prompt, j) == run]

    def completion_tokens(self, requests) -> int:
        """Tokens of every candidate asked for (a repeated greedy one counts once per candidate)."""
        return sum(len(requests[self.run_of(p, c)].token_ids) for p in range(self.prompts)
                   for c in range(self.candidates))

    def prompt_tokens(self, options: list[dict]) -> int:
        return sum(len(o["prompt_ids"]) for o in options)


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
    # one scheme for all (a request's sampling parameters are its generations'); their seeds differ: not shown
    total = {"method": stats[0].get("method"), "sampling": stats[0].get("sampling"), "target_calls": calls,
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
