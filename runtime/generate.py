"""The verify loop every method shares: draft -> verify -> accept -> update.

Streaming: `Generation` is an iterator of `TokenEvent`s; `.result()` drains it.
"""

from __future__ import annotations

import dataclasses
import numbers
import time
from collections.abc import Iterator, Mapping, Set
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .adaptive import AdaptivePolicy, Memory, on_by_default
from .decoder import StepOutput
from .drafters.base import DecodeState, Drafter, Proposal
from .errors import SpecDeployError
from .loaded_export import LoadedExport
from .logprobs import TokenLogprob, checked_top, token_logprob
from .methods import build_drafter, resolve_method
from .penalties import Penalties, PenaltyContext
from .sampling import PositionNoise, SamplingParams, as_int, fresh_seed
from .tokenizer import IncrementalDecoder, check_text, text_and_offsets
from .verify import Verdict, verify


@dataclass
class TokenEvent:
    token_id: int
    text: str  # text delta made safe to show (held back while it may be a stop-string prefix)
    # when the request asked for logprobs: those of the tokens whose text this event's delta completes
    # (a token's text held back behind a possible stop string brings its logprobs later, with it)
    logprobs: tuple[TokenLogprob, ...] = ()
    # when it asked for them: token_id's own log probability, at once (an API that pairs each token with
    # its number, as Triton's output_ids and output_log_probs, rather than with its text); None otherwise
    logprob: float | None = None


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (eos or stop string), "length", "cancelled"
    stats: dict = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked for
    # one per prompt token, when asked for (the first None: nothing before it to predict it)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def to_json(self) -> dict:
        out = {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
               "stats": self.stats}
        if self.logprobs is not None:
            out["logprobs"] = [lp.to_json() for lp in self.logprobs]
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = [None if lp is None else lp.to_json() for lp in self.prompt_logprobs]
        return out


def checked_ids(prompt_ids) -> list[int]:
    """A prompt's token ids as ints (numpy integers too: a tokenizer's return_tensors="np" output);
    SpecDeployError for anything else (a float, a bool or a string is no token id). A set or a dict
    has no order a prompt could be read in, and an iterator (a generator) may never end: refused."""
    if (prompt_ids is None or isinstance(prompt_ids, (str, bytes, Set, Mapping, Iterator))
            or not hasattr(prompt_ids, "__iter__")):
        raise SpecDeployError(f"prompt_ids must be a list of token ids, got {type(prompt_ids).__name__}")
    try:
        ids = list(prompt_ids)
    except TypeError:  # a 0-d numpy array has __iter__ but is no sequence
        raise SpecDeployError(f"prompt_ids must be a list of token ids, got {type(prompt_ids).__name__}") from None
    if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in ids):
        raise SpecDeployError("prompt_ids must be integers")
    return [int(t) for t in ids]


def checked_stop(stop) -> list[str]:
    """Stop strings: one string or a list of them (a lone string is one stop, not one per character)."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise SpecDeployError("stop must be a string or a list of strings")
    return [check_text(s, "stop") for s in stop]  # a lone surrogate can never match the decoded text


def checked_flag(value, name: str) -> bool:
    if value not in (True, False):  # bool("no") is True: refuse rather than guess
        raise SpecDeployError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def validate_request(export: LoadedExport, prompt_ids: list[int], max_new_tokens: int, scoring: bool = False) -> int:
    """Checks a request against the export; returns max_new_tokens as a Python int (numpy's integers too).
    `scoring`: the request asks for the prompt's logprobs, and may then generate nothing (0)."""
    new = as_int(max_new_tokens)
    if new is None or new < (0 if scoring else 1):
        raise SpecDeployError(f"max_new_tokens must be an integer >= 1 (0 only to score the prompt: "
                              f"prompt_logprobs), got {max_new_tokens!r}")
    if not prompt_ids:
        raise SpecDeployError("the prompt is empty")
    vocab = export.manifest.models["target"].vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise SpecDeployError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
    # scoring alone (0 new tokens) prefills all but the last token (its logprob is the row before): a whole
    # context fits
    length, most = len(prompt_ids), export.manifest.max_context
    if length > most or length == most and not (scoring and new == 0):
        raise SpecDeployError(f"prompt is {length} tokens; the export's max context is {most} (it must leave room "
                              "for at least one new token, unless it is only scored: prompt_logprobs, 0 new tokens)")
    return new


class _PrefillCancelled(Exception):
    pass


class Generation:
    """One request. Iterate for streamed tokens; call cancel() from any thread to stop it.

    `method_overrides` change the export's config of `method` for this request; `drafter`
    is one the caller built for `method` (tree tuning wraps one to observe it). `adaptive`
    decodes plainly while speculating is measured slower (runtime/adaptive.py); None: on,
    unless the environment sets SPECDEPLOY_ADAPTIVE=0. `logprobs` N: each token's log probability
    and its N likeliest alternatives' (runtime/logprobs.py); None: none. `prompt_logprobs`: the same
    for every prompt token after the first (the prefill then scores every row). `penalties`: repetition,
    frequency and presence penalties and logit biases (runtime/penalties.py); None: none."""

    def __init__(self, export: LoadedExport, prompt_ids: list[int], method: str = "ar",
                 params: SamplingParams | None = None, max_new_tokens: int = 64, stop: list[str] | None = None,
                 ignore_eos: bool = False, method_overrides: dict | None = None, drafter: Drafter | None = None,
                 adaptive: bool | None = None, logprobs: int | None = None, penalties: Penalties | None = None,
                 prompt_logprobs: bool = False):
        if params is not None and not isinstance(params, SamplingParams):
            raise SpecDeployError(f"params must be a SamplingParams, got {type(params).__name__}")
        if penalties is not None and not isinstance(penalties, Penalties):
            raise SpecDeployError(f"penalties must be a Penalties, got {type(penalties).__name__}")
        if method_overrides is not None and not isinstance(method_overrides, dict):
            raise SpecDeployError(f"method_overrides must be a dict, got {type(method_overrides).__name__}")
        self.params = params or SamplingParams()
        prompt_ids = checked_ids(prompt_ids)
        stop, ignore_eos = checked_stop(stop), checked_flag(ignore_eos, "ignore_eos")
        self.top_logprobs = checked_top(logprobs)
        # prompt token i's log probability, read off the prefill's row i - 1 (runtime/logprobs.py)
        self.prompt_logprobs: list[TokenLogprob | None] | None = \
            [None] if checked_flag(prompt_logprobs, "prompt_logprobs") else None
        max_new_tokens = validate_request(export, prompt_ids, max_new_tokens, self.prompt_logprobs is not None)
        method = resolve_method(method, export)  # `auto`: the export's recommended method
        self.export, self.method, self.max_new = export, method, max_new_tokens
        config = export.method_config(method, method_overrides)
        self.drafter = drafter or build_drafter(export, config)
        self.speculative = config.verify_tokens > 1  # ar never speculates: nothing to adapt
        self._times_key = repr(config)
        self.policy = None
        if self.speculative and not self.drafter.sizes_own_rows and (on_by_default() if adaptive is None else adaptive):
            self.policy = AdaptivePolicy.resume(export.part("adaptive", Memory), self._times_key)
        self.target = export.decoder("target")
        self.exact_chain = exact_rows_only(export)
        self.stop = [s for s in (stop or []) if s]
        self.eos = set() if ignore_eos else export.eos_token_ids
        # No seed: draw one, so every request samples the same way (runtime/sampling.py), and report it.
        seed = fresh_seed() if self.params.seed is None else self.params.seed
        # A seed asks for a replayable answer: seed-exact for every method. Without one, the method's default
        # (the draft model's is rejection sampling, which accepts more: Drafter.default_sampling).
        scheme = "greedy" if self.params.greedy else self.params.sampling or (
            "seeded" if self.params.seed is not None else getattr(self.drafter, "default_sampling", "seeded"))
        if penalties is not None:
            penalties.check_vocab(export.manifest.models["target"].vocab_size)
        self.penalty = PenaltyContext(penalties, prompt_ids) if penalties is not None and penalties.active else None
        self.state = DecodeState(list(prompt_ids), self.params, np.random.default_rng(seed),
                                 noise=PositionNoise(seed) if scheme == "seeded" else None,
                                 penalize=None if self.penalty is None else self.penalty.apply)
        self.prompt_len = len(prompt_ids)
        self.new_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = None if self.top_logprobs is None else []  # released ones
        self._held: list[tuple[int, TokenLogprob]] = []  # (where its token's text ends, its logprobs) not yet shown
        self.text, self._shown = "", 0
        self._detok = IncrementalDecoder(export.tokenizer)
        self.finish_reason: str | None = None
        self._cancelled = False
        self.stats: dict[str, Any] = {
            "method": method, "new_tokens": 0, "target_calls": 0, "prefill_calls": 0,
            "accepted_drafts": 0, "draft_s": 0.0, "verify_s": 0.0, "prefill_s": 0.0, "host_s": 0.0,
            "adaptive": self.policy is not None, "spec_steps": 0, "plain_steps": 0,
            "sampling": scheme, "seed": None if scheme == "greedy" else seed}

    def cancel(self) -> None:
        self._cancelled = True

    # -- the loop -----------------------------------------------------------------
    def __iter__(self):
        t0 = time.perf_counter()
        target, drafter, state, policy = self.target, self.drafter, self.state, self.policy
        target.reset()
        calls0, verify0 = target.calls, target.seconds
        try:
            target.prefill(state.tokens[:-1], target.prefill_limit(self.export.prefill_chunk),
                           on_chunk=self._prefilled, all_logits=self.prompt_logprobs is not None)
        except _PrefillCancelled:
            self.finish_reason = "cancelled"
        self.stats["prefill_calls"] = target.calls - calls0
        self.stats["prefill_s"] = target.seconds - verify0
        self.stats["prefilled_tokens"] = target.cache.length  # fewer than the prompt's when cancelled
        if self.finish_reason is None and self.max_new == 0:  # the prompt scored (prompt_logprobs): done
            self.finish_reason = "length"
        if self.finish_reason is None:
            drafter.start(state)
        kv0 = target.cache.bytes_copied
        while self.finish_reason is None:
            if self._cancelled:
                self.finish_reason = "cancelled"
                break
            td = time.perf_counter()
            # Decided before drafting, from committed steps only: sampling stays exact.
            speculate = self.speculative and (policy is None or policy.speculate())
            proposal = drafter.propose(state) if speculate else Proposal.root_only(state.tokens[-1])
            self.stats["draft_s"] += time.perf_counter() - td
            room = target.room
            # no graph fits (a padded target keeps a spare; at a large block the smallest is T=2)
            if room < target.graph_for(1):
                self.finish_reason = "length"
                break
            timed = policy is not None
            # A step emits up to proposal.size tokens: never past the context (a T=2 graph would let
            # a quantized target's 2-row step emit a token at position max_context).
            # A tree (or auxiliary rows) with nothing cached yet (a one-token prompt: the root is all of it):
            # ONNX Runtime's GroupQueryAttention takes a call with no past for a prompt and attends
            # causally, whatever the tree mask says (a sibling's rows then read each other's KV).
            first_tree = target.cache.length == 0 and (proposal.tree.chain_rows < proposal.tree.size
                                                       or proposal.aux_tokens is not None)
            if proposal.size > 1 and (target.graph_for(proposal.size) > room or proposal.size >= room or first_tree):
                proposal = Proposal.root_only(state.tokens[-1])  # near the context end, or that first tree: plain
                speculate = timed = False  # drafted for nothing: no sample of either kind of step
            tv = time.perf_counter()
            # Exact rows only (a quantized or --exact-rows target): the tree in depth-first order, so its likeliest
            # path is the leading chain whose rows match sequential decoding (verify.py).
            order = proposal.tree.preorder if self.exact_chain else None
            call = proposal if order is None or order == tuple(range(len(order))) else proposal.reordered(order)
            out = target.forward(*call.packed(target.cache.length))  # tree rows first, then aux rows
            self.stats["verify_s"] += time.perf_counter() - tv
            self.stats["target_calls"] += 1
            verdict = verify(call.tree, call.tokens, out.logits, self.params, state.rng, call.draft_probs,
                             state.noise, len(state.tokens) - 1, call.tree.chain_rows if self.exact_chain else None,
                             None if self.penalty is None else self.penalty.apply)
            target.commit(out, verdict.path)
            accepted = [int(call.tokens[i]) for i in verdict.path[1:]] + [verdict.next_token]
            if self.penalty is not None:
                self.penalty.commit(accepted)
            self.stats["accepted_drafts"] += verdict.accepted_drafts
            state.tokens.extend(accepted)
            if call is not proposal:  # the drafter reads its own node ids
                verdict, out = in_proposal_order(verdict, out, order, proposal.size)
            drafter.update(state, proposal, verdict, out)
            # token i of the step was chosen at row path[i] (the root's, then each accepted draft's)
            rows = verdict.path if self.logprobs is not None else None
            if timed:  # the step's own work (the consumer's time between yields is not the step's);
                # a step that verified the root alone (the drafter proposed nothing) is a plain one
                policy.observe(proposal.size > 1, time.perf_counter() - td, len(accepted))
            self.stats["spec_steps" if speculate else "plain_steps"] += 1
            for i, tok in enumerate(accepted):
                event = self._emit(tok, None if rows is None else
                                   token_logprob(out.logits[rows[i]], tok, self.top_logprobs or 0))
                if event is not None:
                    yield event
                if self.finish_reason is not None:
                    break
            if len(state.tokens) >= target.max_context and self.finish_reason is None:
                self.finish_reason = "length"
        tail = self._flush()
        if tail is not None:
            yield tail
        self.stats["kv_bytes_copied"] = target.cache.bytes_copied - kv0
        if policy is not None:
            policy.remember(self.export.part("adaptive", Memory), self._times_key)
        self._finish_stats(time.perf_counter() - t0)

    def _prefilled(self, step) -> None:
        """After each prefill chunk: a cancelled request stops here, not after the whole prompt."""
        self.drafter.prefilled(step)
        if self.prompt_logprobs is not None:  # row r scores the token after it
            prompt, top, at = self.state.tokens, self.top_logprobs or 0, len(self.prompt_logprobs)
            self.prompt_logprobs += [token_logprob(row, prompt[at + r], top) for r, row in enumerate(step.logits)]
            if len(self.prompt_logprobs) == self.prompt_len:  # where each token's text starts in the prompt's
                _, starts = text_and_offsets(self.export.tokenizer, prompt[: self.prompt_len])
                self.prompt_logprobs = [lp if lp is None else dataclasses.replace(lp, text_offset=start)
                                        for lp, start in zip(self.prompt_logprobs, starts)]
        if self._cancelled:
            raise _PrefillCancelled

    def _emit(self, tok: int, logprob: TokenLogprob | None = None) -> TokenEvent | None:
        self.new_ids.append(tok)
        start = len(self.text)
        if tok in self.eos:
            self.finish_reason = "stop"
            self.text += self._detok.flush()  # the last event: any held bytes go with it, and their logprobs
            return TokenEvent(tok, self._delta(final=True), self._release(logprob, start, final=True),
                              None if logprob is None else logprob.logprob)
        self.text += self._detok.push(tok)
        if self.stop:
            hits = [i for i in (self.text.find(s, max(0, self._shown - len(s))) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.finish_reason = "stop"
        if self.finish_reason is None and len(self.new_ids) >= self.max_new:
            self.finish_reason = "length"
            self.text += self._detok.flush()  # ended inside a character: its bytes go with this last event
        final = self.finish_reason is not None
        delta = self._delta(final)
        own = None if logprob is None else logprob.logprob
        return TokenEvent(tok, delta, self._release(logprob, start, final), own)

    def _release(self, logprob: TokenLogprob | None, start: int, final: bool) -> tuple[TokenLogprob, ...]:
        """Hold `logprob` (its token's text starts at `start`) until the text shown has passed its
        token's; return those it has passed now (every one when `final`), each with its text offset."""
        if logprob is not None:  # a token whose character is not complete yet ends past the text so far
            end = len(self.text) + (len(self._detok.ids) > self._detok.read)
            self._held.append((end, dataclasses.replace(logprob, text_offset=start)))
        if not self._held:
            return ()
        n = len(self._held) if final else next((i for i, (end, _) in enumerate(self._held) if end > self._shown),
                                               len(self._held))
        # a stop string cuts the text: a token past it starts at the text's end
        out = tuple(lp if lp.text_offset <= len(self.text) else dataclasses.replace(lp, text_offset=len(self.text))
                    for _, lp in self._held[:n])
        del self._held[:n]
        if self.logprobs is not None:
            self.logprobs.extend(out)
        return out

    def _delta(self, final: bool) -> str:
        safe = len(self.text)
        if not final and self.stop:  # hold back what could still become a stop string
            safe = max(self._shown, safe - self._stop_prefix())
        delta = self.text[self._shown : safe]
        self._shown = max(self._shown, safe)
        return delta

    def _stop_prefix(self) -> int:
        """How many characters at the text's end could begin a stop string: only those are held back
        (a fixed stop-length buffer held every token's text back behind any stop string: a 200-character
        stop string turned a stream of 40 tokens into one chunk at its end)."""
        text, tail = self.text, len(self.text) - self._shown
        return max((next((n for n in range(min(len(s) - 1, tail), 0, -1) if text.endswith(s[:n])), 0)
                    for s in self.stop), default=0)

    def _flush(self) -> TokenEvent | None:
        if self.finish_reason != "stop" or self.new_ids[-1:] and self.new_ids[-1] in self.eos:
            self.text += self._detok.flush()  # a stop string already cut the text: nothing after it
        if self._shown < len(self.text) or self._held:
            delta = self._delta(final=True)
            return TokenEvent(-1, delta, self._release(None, len(self.text), final=True))
        return None

    def _finish_stats(self, seconds: float) -> None:
        s = self.stats
        s["new_tokens"] = len(self.new_ids)
        s["prompt_tokens"] = self.prompt_len
        # what the target has read of the prompt: all of it once a step ran, else what prefill reached
        s["prompt_processed"] = self.prompt_len if s["target_calls"] else s["prefilled_tokens"]
        s["seconds"] = seconds
        s["tokens_per_s"] = s["new_tokens"] / seconds if seconds > 0 else 0.0
        s["acceptance_length"] = s["new_tokens"] / s["target_calls"] if s["target_calls"] else 0.0
        s["host_s"] = max(0.0, seconds - s["draft_s"] - s["verify_s"] - s["prefill_s"])
        s["kv_bytes_per_step"] = s["kv_bytes_copied"] / s["target_calls"] if s["target_calls"] else 0.0
        s["finish_reason"] = self.finish_reason

    def result(self) -> GenerationResult:
        for _ in self:
            pass
        return GenerationResult(self.text, list(self.new_ids), self.finish_reason or "length", dict(self.stats),
                                None if self.logprobs is None else list(self.logprobs), self.scored_prompt())

    def scored_prompt(self) -> list[TokenLogprob | None] | None:
        """The prompt's logprobs when asked for and the whole prompt was prefilled (not when cancelled in it)."""
        scored = self.prompt_logprobs
        return list(scored) if scored is not None and len(scored) == self.prompt_len else None


def exact_rows_only(export: LoadedExport) -> bool:
    """Whether only a tree's leading chain may be followed (verify.py, `exact_rows`): a target whose
    graphs quantize activations to int8 (MatMulNBits) turns a tree row's ulp-level difference from
    sequential decoding into whole logits (measured: up to 0.7 on SmolLM2 int8, 3e-5 in float32),
    and an `export --exact-rows` float target holds even those ulps (Manifest.exact_rows)."""
    return export.manifest.exact_rows


def in_proposal_order(verdict: Verdict, out: StepOutput, order: tuple[int, ...], size: int) -> tuple:
    """A verdict and step output of a reordered call (row r: node order[r]) in the proposal's node ids."""
    rows = np.empty(size, dtype=np.int64)
    rows[list(order)] = np.arange(len(order))
    rows[len(order):] = np.arange(len(order), size)  # aux rows stay after the tree
    pick = lambda a: None if a is None else a[rows]  # noqa: E731
    return (Verdict([order[r] for r in verdict.path], verdict.next_token),
            StepOutput(out.logits[rows], out.hidden[rows], [], pick(out.features)))


def generate(export: LoadedExport, prompt_ids: list[int], **kwargs) -> GenerationResult:
    return Generation(export, prompt_ids, **kwargs).result()
