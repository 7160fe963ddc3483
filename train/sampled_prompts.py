"""User messages sampled from the chat target itself (the Magpie recipe): its user-turn prior.

Drafters trained only on answers to `chat_prompts.py`'s templates generalize poorly to
what users actually ask: on SmolLM2-135M-Instruct the EAGLE head's teacher-forced top-1
on its own greedy answers was 0.40-0.48 for held-out template prompts but 0.22-0.35 for
free-form requests. An instruction-tuned model, given its chat template up to the start
of a user turn, writes the kind of request it was tuned on; sampling that turn yields
varied, realistic prompts with no data set to download. Only turns the model ends itself
(an end-of-turn token within `max_tokens`) are kept, deduplicated, and split train /
held-out by a stable hash of the text (as `chat_prompts.py` splits by topic).
"""

from __future__ import annotations

import hashlib

import torch

from .chat_prompts import HELDOUT_PER_MILLE, SPLITS

SENTINEL = "\x00user message\x00"


def user_turn_prefix(template) -> str:
    """The template rendered up to where a user's message starts (system prompt and all)."""
    from ..runtime.chat_template import chat_messages

    text = template.render(chat_messages(SENTINEL))
    if SENTINEL not in text:
        raise ValueError("the chat template does not place the user's message in its output")
    return text[: text.index(SENTINEL)]


def split_of_text(text: str) -> str:
    h = int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) % 1000
    return "heldout" if h < HELDOUT_PER_MILLE else "train"


@torch.no_grad()
def sample_user_messages(model, tok, prefix_ids: list[int], wanted: dict[str, int], end_ids: set[int],
                         seed: int, max_tokens: int = 64, batch: int = 32, temperature: float = 1.0,
                         top_p: float = 0.95, max_rounds: int = 64) -> dict[str, list[str]]:
    """Up to wanted[split] distinct user messages per split, sampled from `model` after `prefix_ids`.

    Deterministic for `seed`. Stops after `max_rounds` batches, with fewer messages if the model
    rarely ends its turn (the caller says how many it got)."""
    got: dict[str, list[str]] = {s: [] for s in SPLITS}
    seen: set[str] = set()
    generator = torch.Generator().manual_seed(seed)
    ends = torch.tensor(sorted(end_ids))
    prompt = torch.tensor([prefix_ids] * batch)
    for _ in range(max_rounds):
        if all(len(got[s]) >= wanted.get(s, 0) for s in SPLITS):
            break
        rows = _sample(model, prompt, max_tokens, ends, generator, temperature, top_p)
        for row in rows:
            text = tok.decode(row).strip()
            split = split_of_text(text)
            if text and text not in seen and len(text.split()) >= 3 and len(got[split]) < wanted.get(split, 0):
                seen.add(text)
                got[split].append(text)
    return got


def _sample(model, prompt: torch.Tensor, max_tokens: int, ends: torch.Tensor, generator, temperature: float,
            top_p: float) -> list[list[int]]:
    """Each row's sampled tokens up to (not including) its end-of-turn token; rows that did not end
    within `max_tokens` are left out."""
    from transformers import DynamicCache

    cache = DynamicCache()
    logits = model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[:, -1]
    rows: list[list[int]] = [[] for _ in range(len(prompt))]
    ended = torch.zeros(len(prompt), dtype=torch.bool)
    for _ in range(max_tokens):
        probs = torch.softmax(logits.float() / temperature, -1)
        sorted_p, order = probs.sort(-1, descending=True)
        # nucleus: keep the smallest prefix of the sorted tokens whose mass reaches top_p
        sorted_p[(sorted_p.cumsum(-1) - sorted_p) >= top_p] = 0
        nxt = order.gather(-1, torch.multinomial(sorted_p, 1, generator=generator)).squeeze(-1)
        now = torch.isin(nxt, ends) & ~ended
        for j in (~ended & ~now).nonzero().flatten().tolist():
            rows[j].append(int(nxt[j]))
        ended |= now
        if ended.all():
            break
        logits = model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True).logits[:, -1]
    return [r for r, e in zip(rows, ended.tolist()) if e]
