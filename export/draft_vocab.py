"""A drafter's draft vocabulary: target token ids by frequency, written beside a trained head or draft.

Medusa and EAGLE heads and the draft model end in an LM head over the target's
vocabulary; reading it is most of a draft call's cost on a CPU. With
`draft_vocab.json` (specdeploy's extra file; upstream loaders ignore it) an export
can keep only the N most frequent tokens' rows (`medusa.draft_vocab`,
`eagle.draft_vocab`, `draft.draft_vocab`). Only the candidates change: verification
is the target's, so the output stays lossless.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from ..runtime.errors import SpecDeployError

DRAFT_VOCAB_FILE = "draft_vocab.json"


def ids_by_frequency(seqs: torch.Tensor, vocab_size: int) -> list[int]:
    """Token ids that occur in `seqs`, most frequent first (ties by id): draft_vocab.json's order."""
    counts = torch.bincount(seqs.flatten(), minlength=vocab_size)
    return sorted((i for i in range(vocab_size) if counts[i] > 0), key=lambda i: (-int(counts[i]), i))


def write_draft_vocab(out_dir: Path, seqs: torch.Tensor, vocab_size: int) -> None:
    """Token ids by frequency in the drafter's training text (mostly the target's own greedy output)."""
    counts = torch.bincount(seqs.flatten(), minlength=vocab_size)
    seen = ids_by_frequency(seqs, vocab_size)
    data = {"about": "target token ids by frequency in the head's training text (most frequent first)",
            "token_ids": seen, "counts": [int(counts[i]) for i in seen]}
    (Path(out_dir) / DRAFT_VOCAB_FILE).write_text(json.dumps(data) + "\n")


def read_draft_vocab(head_dir: Path, size: int, vocab_size: int, what: str, progress) -> list[int] | None:
    """The `size` most frequent token ids, or None (full vocabulary: size 0 or >= vocab, or no file)."""
    if not size or size >= vocab_size:
        return None
    path = Path(head_dir) / DRAFT_VOCAB_FILE
    if not path.is_file():
        progress(f"  {what}.draft_vocab {size}: {head_dir} has no {DRAFT_VOCAB_FILE}, "
                 "drafting over the full vocabulary")
        return None
    try:
        ids = [int(i) for i in json.loads(path.read_text())["token_ids"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise SpecDeployError(f"{path} is not a valid draft vocabulary: {exc!r}") from None
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= vocab_size:
        raise SpecDeployError(f"{path}: token_ids must be distinct ids in [0, {vocab_size})")
    return ids[:size]


def restrict_lm_head(causal_lm, token_ids: list[int]):
    """A copy of an HF causal LM whose logits score only `token_ids` (column i: token_ids[i]): its LM
    head an untied Linear of those rows. The embeddings (still the full vocabulary) are shared, not
    copied; the config's vocab_size becomes the head's width (graph builders read it for the logits)."""
    embed = causal_lm.get_input_embeddings().weight
    lm = copy.deepcopy(causal_lm, memo={id(embed): embed})
    old = causal_lm.get_output_embeddings()
    rows = torch.as_tensor(token_ids, dtype=torch.int64)
    head = nn.Linear(old.in_features, len(token_ids), bias=old.bias is not None, dtype=old.weight.dtype)
    with torch.no_grad():
        head.weight.copy_(old.weight[rows])
        if old.bias is not None:
            head.bias.copy_(old.bias[rows])
    head.requires_grad_(False)
    lm.set_output_embeddings(head)
    lm.config.tie_word_embeddings = False
    lm.config.vocab_size = len(token_ids)
    return lm.eval()


def with_input_vocab(causal_lm, vocab_size: int):
    """`causal_lm`, changed in place (a draft loaded for this export alone), to read token ids up to
    `vocab_size`: a draft whose vocabulary is the target's but padded to another size (Qwen2.5-0.5B's
    151,936 rows beside Qwen2.5-7B's 152,064). Its input embedding gets zero rows for ids past its own
    (no text has them; the target's logits could still pick one) or loses the rows past `vocab_size`;
    its LM head is kept, untied (the exporter restricts it to the shared ids with restrict_lm_head)."""
    lm, old = causal_lm, causal_lm.get_input_embeddings()
    rows = min(vocab_size, old.num_embeddings)
    embed = nn.Embedding(vocab_size, old.embedding_dim, dtype=old.weight.dtype)
    with torch.no_grad():
        embed.weight.zero_()
        embed.weight[:rows] = old.weight[:rows]
    embed.requires_grad_(False)
    lm.config.tie_word_embeddings = False
    lm.set_input_embeddings(embed)
    lm.config.vocab_size = vocab_size
    return lm.eval()
