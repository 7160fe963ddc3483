"""A draft model for a target that has no smaller sibling, cut from the target itself.

The draft is the target's token embeddings, a few of its decoder layers, its final
norm and its (tied) LM head: a normal HF directory of the same architecture and
tokenizer, so `specdeploy export --draft DIR` takes it like any other draft. Starting
from the target's own weights means its hidden space already speaks the LM head's
language; distillation on the target's own responses (`train/responses.py`) then
teaches the kept layers to stand in for the dropped ones. Cut this way the draft is
useless before training (measured on SmolLM2: under 5% top-1 agreement for any 2-6
layers tried, first, last or spread), since the final norm and LM head expect the
last layer's residual stream.

The loss is EAGLE's: regress the draft's final hidden state onto the target's
(smooth L1; with the LM head shared and frozen, matching features matches logits),
plus a token loss over the draft vocabulary only (the target's distribution, KL, and
its argmax, CE): the full vocabulary's logits, softmax and gradient were 4x the cost
of a step on a 49k-token target, and a feature that matches scores every token.
The embeddings (and so the tied LM head) stay frozen: they are most of the
parameters, the target's are already right, and their gradient is most of a step.
Beside the draft, `draft_vocab.json` ranks the responses' tokens by frequency: an
export with `draft.draft_vocab N` keeps only the first N rows of its LM head.

    python -m specdeploy.train.draft --target DIR --data RESPONSES --out DIR [--preset default]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see Makefile: spinning OpenMP waits fight on shared cores

import torch
import torch.nn.functional as F

from ..export.draft_vocab import DRAFT_VOCAB_FILE, write_draft_vocab
from ..export.hf_loading import load_causal_lm, readable_by_both
from ..runtime.errors import SpecDeployError
from .cli_finish import finish, say
from .distill import VocabSubset, reuse_or_train, run_meta, spec_hash, write_result
from .loop import fit, native_precision, with_steps
from .responses import Responses, data_hash, heldout_splits, load_split, next_token_labels, response_tokens

Progress = Callable[[str], None]
TRAIN_FORMAT = 1  # bump when the recipe changes in a way the spec hash cannot see
# Files of the target dir that are the model itself; everything else (tokenizer, chat template,
# generation config) is copied so the draft dir is self-contained.
MODEL_FILES = ("config.json", "source.json")


@dataclass(frozen=True)
class DraftSpec:
    layers: tuple[int, ...]  # target layers the draft starts from, in order
    steps: int
    batch: int = 8  # sequences per step
    max_len: int = 256  # sequences are cut to this many tokens
    lr: float = 3e-3
    warmup: int = 20
    token_weight: float = 1.0  # token loss next to the feature loss
    kl_weight: float = 0.5  # share of the token loss that is KL to the target's distribution (the rest: CE)
    train_vocab: int = 8192  # the token loss ranks the N most frequent tokens of the responses
    bf16: bool = True
    seed: int = 0

    def config_hash(self) -> str:
        return spec_hash(self, TRAIN_FORMAT)


PRESETS = {
    "micro": DraftSpec(layers=(0,), steps=10, batch=2, max_len=64),
    # Measured on SmolLM2 (100 steps, held-out top-1 on responses): layers 0-1 0.18 at lr 1e-3 and
    # token weight 0.5, 0.23 at 3e-3 and 1.0 (0.22 at 3.0); layers 0-3 0.22 at 1e-3 for 1.7x the time.
    # `make export`'s 15 minutes: ~2.4 s of CPU a step in float32 on 2 AVX2 cores (250 steps on 75k
    # positions reached 0.37 held-out top-1 on responses, 600 CPU-seconds).
    "default": DraftSpec(layers=(0, 1), steps=100, train_vocab=4096),
    "long": DraftSpec(layers=(0, 1, 2, 3), steps=1200),
}


# ---------------------------------------------------------------- model


def draft_from_target(target, layers: tuple[int, ...]):
    """A model of the target's class with only `layers` of its decoder layers (copies of their weights)."""
    n = target.config.num_hidden_layers
    if not layers or any(not 0 <= i < n for i in layers):
        raise SpecDeployError(f"draft layers {layers} must be non-empty indices into the target's {n} layers")
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = len(layers)
    if getattr(cfg, "layer_types", None) is not None:  # per-layer attention kinds follow their layers
        cfg.layer_types = [target.config.layer_types[i] for i in layers]
    draft = type(target)(cfg)
    state = {k: v for k, v in target.state_dict().items() if ".layers." not in k}
    for new, old in enumerate(layers):
        prefix = f"model.layers.{old}."
        state.update({f"model.layers.{new}.{k[len(prefix):]}": v for k, v in target.state_dict().items()
                      if k.startswith(prefix)})
    draft.load_state_dict(state)
    return draft.float().eval()


def trainable_parameters(draft) -> list[torch.nn.Parameter]:
    """Everything but the token embeddings and the LM head (frozen: the target's own)."""
    frozen = {id(draft.get_input_embeddings().weight), id(draft.get_output_embeddings().weight)}
    params = []
    for p in draft.parameters():
        p.requires_grad_(id(p) not in frozen)
        if p.requires_grad:
            params.append(p)
    return params


# ---------------------------------------------------------------- data


def padded_batch(data: Responses, labels: list[torch.Tensor], idx: list[int], max_len: int):
    """Right-padded tokens [B, L], features [B, L - 1, H], labels [B, L - 1] and a mask of the
    positions that have a feature."""
    seqs = [data.tokens[i][:max_len] for i in idx]
    width = max(len(s) for s in seqs)
    tokens = torch.zeros(len(idx), width, dtype=torch.int64)
    feats = torch.zeros(len(idx), width - 1, data.features[0].shape[-1], dtype=data.features[0].dtype)
    labs = torch.zeros(len(idx), width - 1, dtype=torch.int64)
    mask = torch.zeros(len(idx), width - 1, dtype=torch.bool)
    for j, (i, s) in enumerate(zip(idx, seqs)):
        n = len(s) - 1
        tokens[j, : n + 1] = s
        feats[j, :n] = data.features[i][:n]
        labs[j, :n] = labels[i][:n]
        mask[j, :n] = True
    return tokens, feats, labs, mask


# ---------------------------------------------------------------- training


def distill_loss(draft, tokens, feats, labels, mask, subset: VocabSubset, spec: DraftSpec):
    """(loss, feature loss, token loss) over the masked positions of one batch."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec.bf16):
        # Right padding and a causal model: real positions never see the padding, no mask needed.
        hidden = draft.model(input_ids=tokens[:, :-1]).last_hidden_state
    hidden, teacher = hidden.float()[mask], feats.float()[mask]
    feat_loss = F.smooth_l1_loss(hidden, teacher)
    log_q = F.log_softmax(subset.logits(hidden), -1)
    with torch.no_grad():
        log_p = F.log_softmax(subset.logits(teacher), -1)
    kl = F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")
    ce = F.nll_loss(log_q, subset.index[labels[mask]], ignore_index=-100)
    token_loss = spec.kl_weight * kl + (1 - spec.kl_weight) * ce
    return feat_loss + spec.token_weight * token_loss, feat_loss, token_loss


def train_draft(draft, data: Responses, labels: list[torch.Tensor], subset: VocabSubset, spec: DraftSpec,
                progress: Progress) -> dict:
    def batch_loss(gen: torch.Generator):
        idx = torch.randint(0, len(data.tokens), (spec.batch,), generator=gen).tolist()
        loss, feat_loss, token_loss = distill_loss(draft, *padded_batch(data, labels, idx, spec.max_len), subset, spec)
        return loss, {"feature": feat_loss, "token": token_loss}

    return fit(draft, trainable_parameters(draft), batch_loss, steps=spec.steps, lr=spec.lr, warmup=spec.warmup,
               seed=spec.seed, tag="draft", progress=progress, weight_decay=0.01)


@torch.no_grad()
def agreement(draft, data: Responses, labels: list[torch.Tensor], max_len: int, batch: int = 8) -> dict:
    """How often the draft's argmax over the whole vocabulary (as it drafts) is the target's next
    token: on response positions, and on all."""
    hits = {"response": [0, 0], "all": [0, 0]}
    for first in range(0, len(data.tokens), batch):
        idx = list(range(first, min(first + batch, len(data.tokens))))
        tokens, _, labs, mask = padded_batch(data, labels, idx, max_len)
        right = (draft(input_ids=tokens[:, :-1]).logits.argmax(-1) == labs) & mask
        response = mask.clone()
        for j, i in enumerate(idx):
            response[j, : data.prompt_lens[i] - 1] = False
        for key, where in (("response", response), ("all", mask)):
            hits[key][0] += int((right & where).sum())
            hits[key][1] += int(where.sum())
    out = {f"top1_{k}": round(h / max(n, 1), 4) for k, (h, n) in hits.items()}
    out["response_positions"] = hits["response"][1]
    return out


# ---------------------------------------------------------------- build


def _save(draft, target_dir: Path, out: Path) -> None:
    """The draft as an HF dir with the target's tokenizer files."""
    draft.save_pretrained(out, safe_serialization=True)
    readable_by_both(Path(out) / "config.json")  # transformers 4.x and 5.x read the same RoPE
    for path in Path(target_dir).iterdir():
        if path.is_file() and path.name not in MODEL_FILES and not path.name.startswith("model") \
                and not (out / path.name).exists():
            shutil.copyfile(path, out / path.name)


def build_draft(target_dir: Path, data_dir: Path, out_dir: Path, spec: DraftSpec, progress: Progress = print) -> dict:
    """Train (or reuse) a draft for the target from its responses in `data_dir`; returns train.json.
    A reused draft trained before drafts had a draft vocabulary gets its draft_vocab.json (from the
    same responses) instead of a retraining."""
    meta = reuse_or_train(out_dir, spec, data_hash(data_dir), ["config.json", "model.safetensors"],
                          lambda: _distil(Path(target_dir), Path(data_dir), Path(out_dir), spec, progress),
                          progress, "[draft]")
    if not (Path(out_dir) / DRAFT_VOCAB_FILE).is_file():
        _write_vocab(Path(out_dir), load_split(Path(data_dir), "train"))
        progress(f"[draft] wrote {Path(out_dir) / DRAFT_VOCAB_FILE} from the training responses")
    return meta


def _write_vocab(out: Path, train: Responses) -> None:
    """draft_vocab.json: the tokens of the responses the draft was trained on, by frequency."""
    vocab_size = json.loads((out / "config.json").read_text())["vocab_size"]
    write_draft_vocab(out, response_tokens(train), vocab_size)


def _distil(target_dir: Path, data_dir: Path, out_dir: Path, spec: DraftSpec, progress: Progress) -> dict:
    """Cut the draft, distil it on the responses, write it to `out_dir`; returns train.json."""
    t0 = time.perf_counter()
    torch.manual_seed(spec.seed)
    target = load_causal_lm(target_dir, "float32")
    draft = draft_from_target(target, spec.layers)
    train, heldout = load_split(data_dir, "train"), heldout_splits(data_dir)
    weight = target.lm_head.weight
    labels = next_token_labels(train)
    subset = VocabSubset.most_frequent(response_tokens(train), weight, spec.train_vocab)
    del target
    progress(f"[draft] layers {list(spec.layers)}: {sum(p.numel() for p in draft.parameters()):,} params; "
             f"{train.positions:,} train positions")
    run = train_draft(draft, train, labels, subset, spec, progress)
    scores = {name: agreement(draft, data, next_token_labels(data), spec.max_len) for name, data in heldout.items()}
    for name, score in scores.items():
        progress(f"[draft] held-out top-1 agreement on responses ({name}): {score['top1_response']:.3f}")
    meta = run_meta(spec, run, t0, **scores)  # heldout, and freeform where the data has it
    def save(out: Path) -> None:
        _save(draft, target_dir, out)
        _write_vocab(out, train)

    write_result(out_dir, meta, save)
    progress(f"[draft] written to {out_dir} in {meta['seconds']:.1f}s")
    return meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Cut a draft model from a target and distil it on the target's responses.")
    p.add_argument("--target", type=Path, required=True, help="HF model directory of the target")
    p.add_argument("--data", type=Path, required=True, help="the target's responses (train.responses --out)")
    p.add_argument("--out", type=Path, required=True, help="output HF directory (cached by spec and data)")
    p.add_argument("--preset", default="default", choices=sorted(PRESETS))
    p.add_argument("--layers", help="comma-separated target layers to keep (default: the preset's)")
    p.add_argument("--steps", type=int, help="training steps (default: the preset's)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    spec = native_precision(PRESETS[args.preset])
    if args.layers:
        spec = replace(spec, layers=tuple(int(i) for i in args.layers.split(",")))
    if args.steps is not None:
        if args.steps < 1:
            p.error("--steps must be >= 1")
        spec = with_steps(spec, args.steps)
    torch.set_num_threads(args.threads)
    return finish(lambda: build_draft(args.target, args.data, args.out, spec, say), "heldout", "freeform")


if __name__ == "__main__":
    sys.exit(main())
