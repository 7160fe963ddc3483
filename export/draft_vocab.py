"""A head's draft vocabulary: target token ids by frequency, written beside a trained head.

Medusa and EAGLE heads end in an LM head over the target's vocabulary; reading it
is most of a head call's cost on a CPU. With `draft_vocab.json` (specdeploy's extra
file; upstream loaders ignore it) an export can keep only the N most frequent
tokens' rows (`medusa.draft_vocab`, `eagle.draft_vocab`). Only the candidates
change: verification is the target's, so the output stays lossless.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..runtime.errors import SpecDeployError

DRAFT_VOCAB_FILE = "draft_vocab.json"


def ids_by_frequency(seqs: torch.Tensor, vocab_size: int) -> list[int]:
    """Token ids that occur in `seqs`, most frequent first (ties by id): draft_vocab.json's order."""
    counts = torch.bincount(seqs.flatten(), minlength=vocab_size)
    return sorted((i for i in range(vocab_size) if counts[i] > 0), key=lambda i: (-int(counts[i]), i))


def write_draft_vocab(out_dir: Path, seqs: torch.Tensor, vocab_size: int) -> None:
    """Token ids by frequency in the head's training text (mostly the target's own greedy output)."""
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
