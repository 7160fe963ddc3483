"""Training data and schedule shared by the head trainers (Medusa, EAGLE) on a frozen target.

Both self-distil: text windows of the train split plus the target's own greedy
continuations of train-split prompts, tokenized with the target's tokenizer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..runtime.errors import SpecDeployError


def target_tokenizer(target_dir: Path):
    from tokenizers import Tokenizer

    path = Path(target_dir) / "tokenizer.json"
    if not path.is_file():
        raise SpecDeployError(f"{target_dir} has no tokenizer.json (needed to tokenize the training text)")
    return Tokenizer.from_file(str(path))


def token_stream(tok, texts, eos: int | None, max_tokens: int) -> torch.Tensor:
    """Texts tokenized and joined (each followed by eos when the target has one), up to max_tokens."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tok.encode(text, add_special_tokens=False).ids)
        if eos is not None:
            ids.append(eos)
        if len(ids) >= max_tokens:
            break
    return torch.tensor(ids[:max_tokens], dtype=torch.int64)


def windows(stream: torch.Tensor, count: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """`count` random windows of `length` tokens: [count, length]."""
    if stream.numel() <= length:
        raise SpecDeployError(f"corpus too small: {stream.numel()} tokens for windows of {length}")
    starts = torch.randint(0, stream.numel() - length, (count,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


@torch.no_grad()
def greedy_continuations(target, prompts: torch.Tensor, new_tokens: int, batch: int = 32) -> torch.Tensor:
    """The target's greedy continuations (prompt included); equal-length prompts, so no padding."""
    out = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        out.append(target.generate(chunk, attention_mask=torch.ones_like(chunk), do_sample=False,
                                   max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0))
    return torch.cat(out)


def warmup_cosine_lr(step: int, lr: float, warmup: int, steps: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of `lr`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(steps - warmup, 1)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def _cached_training(out_dir: Path, train_hash: str, target_hash: str | None, required: list[str]) -> dict | None:
    """train.json of a finished run with this spec on this target, or None."""
    meta_path = out_dir / "train.json"
    if not meta_path.is_file() or not all(any((out_dir / n).is_file() for n in group.split("|")) for group in required):
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError:
        return None
    if meta.get("train_hash") != train_hash or meta.get("target_hash") != target_hash:
        return None
    return meta


def train_for_family(family_dir: Path, what: str, preset: str, presets: dict, train, required: list[str],
                     progress) -> dict:
    """Heads (`what`: "medusa", "eagle") for a built family's target, cached in <family_dir>/<what>
    and redone when the preset's training spec or the family's config hash changes.

    `train(target_dir, out_dir, spec, progress)` returns train.json's content; `required`
    lists the files a finished run leaves ("a|b": either). Returns train.json.
    """
    if preset not in presets:
        raise SpecDeployError(f"unknown {what} preset {preset!r}; expected one of {sorted(presets)}")
    family_dir = Path(family_dir)
    fam_path = family_dir / "family.json"
    if not fam_path.is_file():
        raise SpecDeployError(f"{family_dir} is not a finished family build (no family.json): build the family first")
    target_hash = json.loads(fam_path.read_text()).get("config_hash")
    spec, out = presets[preset], family_dir / what
    cached = _cached_training(out, spec.config_hash(), target_hash, required)
    if cached is not None:
        progress(f"[{what}] {preset}: reusing {out} (train {spec.config_hash()})")
        return cached
    meta = train(family_dir / "target", out, spec, progress)
    meta["target_hash"] = target_hash
    (out / "train.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta
