"""Training data shared by every trainer here: the family and the head trainers (their
optimisation loop: train/loop.py).

All of them read windows of one token stream cut from the corpus. The head trainers
(Medusa, EAGLE) self-distil a frozen target: besides text windows they train on the
target's own greedy continuations of train-split prompts, tokenized with the target's
tokenizer. Every trainer of a target writes its result beside its output dir and swaps
it in (`write_result`), reused while the spec and the target (or its responses) are
unchanged (`reuse_or_train`; per family: `train_for_family`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, fields
from itertools import islice
from pathlib import Path
from typing import Callable

import torch

from ..export.draft_vocab import ids_by_frequency
from ..export.hf_loading import load_causal_lm, read_hf_config
from ..export.out_dir import build_lock
from ..runtime.errors import SpecDeployError
from . import corpus


def target_tokenizer(target_dir: Path):
    from tokenizers import Tokenizer

    path = Path(target_dir) / "tokenizer.json"
    if not path.is_file():
        raise SpecDeployError(f"{target_dir} has no tokenizer.json (needed to tokenize the training text)")
    return Tokenizer.from_file(str(path))


def target_fingerprint(target_dir: Path) -> str:
    """A content hash of an HF model dir (config, tokenizer, and each weight file's size, head and tail),
    cheap enough to check before every cached training step."""
    target_dir = Path(target_dir)
    h = hashlib.sha256()
    for name in ("config.json", "tokenizer.json"):
        path = target_dir / name
        h.update(path.read_bytes() if path.is_file() else b"-")
    for path in sorted(target_dir.glob("*.safetensors")) + sorted(target_dir.glob("*.bin")):
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(1 << 20)
            f.seek(max(size - (1 << 20), 0))
            tail = f.read()
        h.update(f"{path.name}:{size}".encode() + head + tail)
    return h.hexdigest()[:16]


def token_stream(tok, texts, eos: int | None, max_tokens: int | None = None, batch: int = 16) -> torch.Tensor:
    """Texts tokenized (no special tokens added) and joined, each followed by `eos` when given,
    as one int64 tensor of at most `max_tokens` tokens.

    Texts are encoded `batch` at a time (the tokenizer runs a batch in parallel) and read
    only until `max_tokens` is reached.
    """
    texts = iter(texts)
    ids: list[int] = []
    while chunk := list(islice(texts, batch)):
        for enc in tok.encode_batch(chunk, add_special_tokens=False):
            ids.extend(enc.ids)
            if eos is not None:
                ids.append(eos)
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    return torch.tensor(ids[:max_tokens], dtype=torch.int64)


def corpus_streams(target_dir: Path, shuffle_seed: int, train_tokens: int,
                   heldout_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The corpus's train (shuffled by `shuffle_seed`) and held-out streams in the target's
    tokenizer, each text followed by the target's end-of-sequence token."""
    tok = target_tokenizer(target_dir)
    eos = read_hf_config(target_dir).get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    return (token_stream(tok, corpus.iter_texts("train", shuffle_seed=shuffle_seed), eos, train_tokens),
            token_stream(tok, corpus.iter_texts("heldout"), eos, heldout_tokens))


def frozen_target(target_dir: Path):
    """The target in float32 with every parameter frozen: the teacher a head or draft learns from."""
    target = load_causal_lm(target_dir, "float32")
    for p in target.parameters():
        p.requires_grad_(False)
    return target


class VocabSubset:
    """A frozen LM head restricted to a draft vocabulary `ids`, and target ids mapped into it.

    Heads whose export drafts among the N most frequent tokens only need to rank those:
    training over them instead of a large target's whole vocabulary costs a fraction of
    the LM head, and labels outside (-100 in `index`) are tokens no draft can propose.
    """

    def __init__(self, ids: list[int], lm_head_weight: torch.Tensor):
        self.ids = torch.tensor(ids)
        self.weight = lm_head_weight.detach()[self.ids].float()
        self.index = torch.full((lm_head_weight.shape[0],), -100, dtype=torch.int64)
        self.index[self.ids] = torch.arange(len(ids))

    @classmethod
    def most_frequent(cls, tokens: torch.Tensor, lm_head_weight: torch.Tensor, size: int) -> "VocabSubset":
        """The `size` tokens most frequent in `tokens`: a prefix of the draft_vocab.json written
        from them, so the export's draft vocabulary when it keeps `size` or fewer."""
        return cls(ids_by_frequency(tokens, lm_head_weight.shape[0])[:size], lm_head_weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., len(ids)]."""
        return torch.nn.functional.linear(hidden, self.weight)


def take_chars(texts, max_chars: int):
    """Texts until about `max_chars` characters have been yielded (whole texts only)."""
    seen = 0
    for text in texts:
        if seen >= max_chars:
            return
        seen += len(text)
        yield text


def random_windows(stream: torch.Tensor, count: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """`count` windows of `length` tokens starting at random offsets: [count, length]."""
    if stream.numel() <= length:
        raise SpecDeployError(f"corpus too small: {stream.numel()} tokens for windows of {length}")
    starts = torch.randint(0, stream.numel() - length, (count,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def evenly_spaced_windows(stream: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """`count` windows spread evenly over the stream (fixed, so every model is scored on the same)."""
    if stream.numel() < count * length:
        raise ValueError(f"held-out stream has {stream.numel()} tokens, need {count * length}")
    stride = (stream.numel() - length) // max(count - 1, 1)
    return torch.stack([stream[i * stride : i * stride + length] for i in range(count)])


@torch.no_grad()
def greedy_continuations(target, prompts: torch.Tensor, new_tokens: int, batch: int = 32) -> torch.Tensor:
    """The target's greedy continuations (prompt included); equal-length prompts, so no padding."""
    out = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        out.append(target.generate(chunk, attention_mask=torch.ones_like(chunk), do_sample=False,
                                   max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0))
    return torch.cat(out)


def cached_training(out_dir: Path, train_hash: str, target_hash: str | None, required: list[str]) -> dict | None:
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


# A spec field with this metadata key set is hashed only when it differs from its default: a field
# added to a spec after results were cached keeps the results of specs that leave it alone valid.
HASHED_WHEN_SET = "hashed_when_set"


def spec_hash(spec, fmt: int) -> str:
    """A dataclass spec's identity with its recipe's format number: what a cached result is keyed by."""
    values = asdict(spec)
    for f in fields(spec):
        if f.metadata.get(HASHED_WHEN_SET) and values[f.name] == f.default:
            del values[f.name]
    blob = json.dumps({"format": fmt, **values}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def run_meta(spec, run: dict, t0: float, **scores) -> dict:
    """train.json's content: the spec and its hash, the training run, `scores`, the seconds since
    `t0` and the torch version."""
    return {"train_hash": spec.config_hash(), "spec": asdict(spec), "training": run, **scores,
            "seconds": round(time.perf_counter() - t0, 1), "torch": torch.__version__}


def write_result(out_dir: Path, meta: dict, save: Callable[[Path], None]) -> None:
    """`save(dir)` and train.json (`meta`) written beside `out_dir`, then swapped in: an interrupted
    run never leaves a directory that looks finished."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    save(tmp)
    (tmp / "train.json").write_text(json.dumps(meta, indent=2) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)


def reuse_or_train(out_dir: Path, spec, source_hash: str | None, required: list[str], train: Callable[[], dict],
                   progress: Callable[[str], None], label: str) -> dict:
    """train.json of a finished run in `out_dir` with `spec` on `source_hash` (the target's or its
    responses'), else `train()`'s (it writes `out_dir`) with `source_hash` added.

    `required` lists the files a finished run leaves ("a|b": either); `label` starts the log line."""
    out_dir = Path(out_dir)
    cached = cached_training(out_dir, spec.config_hash(), source_hash, required)
    if cached is not None:
        progress(f"{label} reusing {out_dir} (train {spec.config_hash()})")
        return cached
    meta = train()
    meta["target_hash"] = source_hash
    (out_dir / "train.json").write_text(json.dumps(meta, indent=2) + "\n")
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
    with build_lock(out):  # parallel test workers share build/: one trains, the others wait and reuse
        return reuse_or_train(out, spec, target_hash, required,
                              lambda: train(family_dir / "target", out, spec, progress),
                              progress, f"[{what}] {preset}:")
