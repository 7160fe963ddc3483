"""Train Medusa-1 heads on a frozen target by self-distillation, in the published layout.

Head k at position t learns the target's own token at position t + k + 2 (its
argmax at t + k + 1). The teacher is the target itself, never the corpus: heads
learn what the target will say, which is what verification accepts. The training
sequences are the target's greedy continuations of train-split prompts: the
sequences a greedy Medusa run actually sees. Measured on the default family (top-1
of each head on held-out greedy text), these choices beat the alternatives at equal
cost: continuations only > continuations mixed with corpus windows (0.75 vs 0.66 for
head 0), hard labels (cross-entropy) > the target's soft distribution (KL), and more
continuations > more steps.
The target is frozen, so its final hidden states and labels are computed once;
each step only runs the heads.

    python -m specdeploy.train.medusa --target DIR --out DIR --heads 4 [--steps N]
    python -m specdeploy.train.medusa --family build/family/default --preset default   # cached
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ..export.draft_vocab import write_draft_vocab
from ..export.medusa_heads import CONFIG_NAME, WEIGHT_NAMES, MedusaHeads, new_heads, save_heads
from .cli_finish import finish, say
from .distill import (
    VocabSubset,
    corpus_streams,
    frozen_target,
    greedy_continuations,
    random_windows,
    reuse_or_train,
    run_meta,
    spec_hash,
    train_for_family,
    write_result,
)
from .loop import fit, native_precision, with_steps
from .responses import IGNORE, data_hash, labelled_windows, response_tokens

Progress = Callable[[str], None]
TRAIN_FORMAT = 2  # bump when the recipe changes in a way the spec hash cannot see
REQUIRED = [CONFIG_NAME, "|".join(WEIGHT_NAMES)]  # the files a finished run leaves (either weight file)


@dataclass(frozen=True)
class HeadsTrainSpec:
    heads: int = 4
    layers: int = 1
    steps: int = 100
    batch: int = 256  # positions per step
    lr: float = 5e-3
    warmup: int = 10
    decay: float = 0.8  # loss weight of head k is decay**k (Medusa's weighting)
    gen_prompts: int = 128  # train-split prompts the target continues greedily
    prompt_len: int = 16
    gen_tokens: int = 112
    eval_windows: int = 16  # held-out windows (teacher-forced accuracy)
    eval_prompts: int = 16  # held-out prompts (accuracy on the target's greedy text)
    bf16: bool = False
    threads: int = 2  # at most; one when the CPU is busy (oversubscribed OpenMP is ~10x slower)
    seed: int = 0
    # > 0: the heads' LM heads stay the target's (frozen) and the loss ranks only the N most frequent
    # tokens of the training text. An export keeps at most `draft_vocab` of them anyway, so the full
    # vocabulary's rows cost a large target's LM head per head per position and teach nothing drafted.
    train_vocab: int = 0
    window: int = 64  # positions per window of the target's responses (--data)

    def config_hash(self) -> str:
        return spec_hash(self, TRAIN_FORMAT)


# Sized for the budgets on a 2-core CPU: micro <= 20 s, default <= 2 minutes.
PRESETS = {
    "micro": HeadsTrainSpec(steps=100, gen_prompts=64, gen_tokens=80, eval_windows=8, eval_prompts=8, threads=1),
    "default": HeadsTrainSpec(steps=100, gen_prompts=128, gen_tokens=112, bf16=True),
    # A real target's responses (--data): frozen LM heads over a draft vocabulary.
    # (`make export`'s 15 minutes; 300 steps took ~120 s of CPU on 75k positions, head 0 top-1 0.41)
    "real": HeadsTrainSpec(steps=150, batch=512, lr=2e-3, warmup=20, bf16=True, train_vocab=4096),
    "real-long": HeadsTrainSpec(steps=1500, batch=512, lr=2e-3, warmup=50, bf16=True, train_vocab=8192),
}


# ---------------------------------------------------------------- data


@torch.no_grad()
def _hidden(target, seqs: torch.Tensor, batch: int = 16, bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's final hidden states (after the final norm) [N, L, H] float32 and its argmax tokens [N, L]."""
    hidden, labels = [], []
    for i in range(0, len(seqs), batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            h = target.model(input_ids=seqs[i : i + batch]).last_hidden_state
            labels.append(target.lm_head(h).argmax(-1))
        hidden.append(h.float())
    return torch.cat(hidden), torch.cat(labels)


# ---------------------------------------------------------------- training


def _threads(most: int) -> int:
    """`most` threads on an idle CPU, one when others keep it busy: OpenMP threads that wait
    for a descheduled peer make a busy 2-core machine ~10x slower than one thread."""
    free = (os.cpu_count() or 1) - os.getloadavg()[0]
    return max(1, min(most, int(free + 0.5)))


def _sample_positions(n_seq: int, length: int, heads: int, batch: int, gen: torch.Generator):
    """(sequence, t) pairs for which every head's label t + k + 1 exists."""
    seq = torch.randint(0, n_seq, (batch,), generator=gen)
    t = torch.randint(0, length - heads - 1, (batch,), generator=gen)
    return seq, t


def _head_logits(head, h: torch.Tensor, subset: VocabSubset | None) -> torch.Tensor:
    return head(h) if subset is None else subset.logits(head[:-1](h))


def train_heads(heads: MedusaHeads, hidden: torch.Tensor, labels: torch.Tensor, spec: HeadsTrainSpec,
                progress: Progress, subset: VocabSubset | None = None) -> dict:
    """Cross-entropy of head k at t against the target's token at t+k+2 (labels[t+k+1]), weights decay**k.

    With `subset` only the heads' blocks train and labels outside it are left out of the loss."""
    n_seq, length, _ = hidden.shape
    weights = [spec.decay**k for k in range(heads.num_heads)]

    def batch_loss(gen: torch.Generator):
        seq, t = _sample_positions(n_seq, length, heads.num_heads, spec.batch, gen)
        h = hidden[seq, t]
        loss = 0.0
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec.bf16):
            for k, head in enumerate(heads.heads):
                want = labels[seq, t + k + 1]
                if subset is not None:
                    want = subset.index[want]
                loss = loss + weights[k] * F.cross_entropy(_head_logits(head, h, subset).float(), want,
                                                           ignore_index=IGNORE)
        return loss, {}

    params = [p for head in heads.heads for p in (head.parameters() if subset is None else head[:-1].parameters())]
    run = fit(heads.heads, params, batch_loss, steps=spec.steps, lr=spec.lr, warmup=spec.warmup, seed=spec.seed + 1,
              tag="medusa", progress=progress)
    return {**run, "positions": spec.steps * spec.batch}


@torch.no_grad()
def head_accuracy(heads: MedusaHeads, hidden: torch.Tensor, labels: torch.Tensor, top: int = 5,
                  subset: VocabSubset | None = None) -> list[dict]:
    """Per head: how often its top-1 (and top-`top`) holds the target's token at t + k + 2
    (drafting among `subset` when given, as an export with that draft vocabulary does)."""
    n_seq, length, size = hidden.shape
    out = []
    for k, head in enumerate(heads.heads):
        h = hidden[:, : length - k - 1].reshape(-1, size)
        want = labels[:, k + 1 :].reshape(-1)
        logits = _head_logits(head, h, subset)
        ranked = logits.topk(min(top, logits.shape[-1]), -1).indices
        if subset is not None:
            ranked = subset.ids[ranked]
        hit = (ranked == want[:, None])[want != IGNORE]  # labelled windows score the responses only
        out.append({"head": k, "top1": round(hit[:, 0].float().mean().item(), 4),
                    f"top{top}": round(hit.any(-1).float().mean().item(), 4)})
    return out


# ---------------------------------------------------------------- entry points


def _corpus_data(target, target_dir: Path, spec: HeadsTrainSpec, progress: Progress, t0: float):
    """Train and held-out (hidden, labels) from the target's greedy continuations of corpus prompts,
    and the training tokens the draft vocabulary is counted on."""
    length = spec.prompt_len + spec.gen_tokens
    train_stream, heldout_stream = corpus_streams(target_dir, spec.seed + 7,
                                                  (spec.gen_prompts + 8) * spec.prompt_len * 64,
                                                  (spec.eval_windows + spec.eval_prompts + 8) * length * 4)
    gen = torch.Generator().manual_seed(spec.seed)
    prompts = random_windows(train_stream, spec.gen_prompts, spec.prompt_len, gen)
    generated = greedy_continuations(target, prompts, spec.gen_tokens, batch=64)
    progress(f"[medusa] {len(generated)} greedy continuations of {spec.gen_tokens} tokens "
             f"({time.perf_counter() - t0:.1f}s)")
    hidden, labels = _hidden(target, generated, bf16=spec.bf16)
    progress(f"[medusa] target hidden states for {hidden.shape[0] * hidden.shape[1]:,} positions "
             f"({time.perf_counter() - t0:.1f}s)")
    eval_text = random_windows(heldout_stream, spec.eval_windows, length, gen)
    eval_gen = greedy_continuations(target, random_windows(heldout_stream, spec.eval_prompts, spec.prompt_len, gen),
                                    spec.gen_tokens, batch=64)
    evals = {"heldout_text": _hidden(target, eval_text), "heldout_greedy": _hidden(target, eval_gen)}
    return (hidden, labels), evals, generated


def _responses_data(target, data_dir: Path, spec: HeadsTrainSpec, progress: Progress, t0: float):
    """The same from the target's responses in `data_dir` (train.responses): features computed once."""
    responses, (_, hidden, labels), evals = labelled_windows(data_dir, spec.window)
    progress(f"[medusa] {responses.positions:,} positions of the target's responses in {len(hidden)} windows "
             f"({time.perf_counter() - t0:.1f}s)")
    return (hidden, labels), {name: (h, lab) for name, (_, h, lab) in evals.items()}, response_tokens(responses)


def train_medusa(target_dir: Path, out_dir: Path, spec: HeadsTrainSpec, progress: Progress = print,
                 fmt: str = "safetensors", data_dir: Path | None = None) -> dict:
    """Train heads for the target in `target_dir`; write the published layout to `out_dir`.

    Data: the target's responses in `data_dir` when given, else its greedy continuations of corpus prompts."""
    t0 = time.perf_counter()
    torch.set_num_threads(_threads(spec.threads))
    torch.manual_seed(spec.seed)
    target_dir = Path(target_dir)
    target = frozen_target(target_dir)
    if data_dir is None:
        (hidden, labels), evals, vocab_text = _corpus_data(target, target_dir, spec, progress, t0)
    else:
        (hidden, labels), evals, vocab_text = _responses_data(target, Path(data_dir), spec, progress, t0)

    heads = new_heads(spec.heads, spec.layers, target.lm_head.weight, base_model=str(target_dir.resolve()))
    subset = None
    if spec.train_vocab:
        subset = VocabSubset.most_frequent(vocab_text, target.lm_head.weight, spec.train_vocab)
    run = train_heads(heads, hidden, labels, spec, progress, subset)
    metrics = {what: head_accuracy(heads, *data, subset=subset) for what, data in evals.items()}
    for what, rows in metrics.items():
        progress(f"[medusa] held-out top-1 vs target ({what}): "
                 + ", ".join(f"head {r['head']} {r['top1']:.3f}" for r in rows))
    meta = run_meta(spec, run, t0, accuracy=metrics)

    def save(tmp: Path) -> None:
        save_heads(heads, tmp, fmt, extra_config={"specdeploy_train_hash": spec.config_hash()})
        write_draft_vocab(tmp, vocab_text, target.config.vocab_size)

    write_result(out_dir, meta, save)
    progress(f"[medusa] {spec.heads} heads written to {out_dir} in {meta['seconds']:.1f}s")
    return meta


def train_medusa_cached(target_dir: Path, data_dir: Path, out_dir: Path, spec: HeadsTrainSpec,
                        progress: Progress = print) -> dict:
    """`train_medusa` on the target's responses, reused while the spec and the data are unchanged."""
    return reuse_or_train(out_dir, spec, data_hash(data_dir), REQUIRED,
                          lambda: train_medusa(target_dir, out_dir, spec, progress, data_dir=data_dir),
                          progress, "[medusa]")


def build_medusa_heads(family_dir: Path, preset: str, progress: Progress = print) -> dict:
    """Heads for a built family's target, cached in <family_dir>/medusa. Returns train.json."""
    return train_for_family(family_dir, "medusa", preset, PRESETS, train_medusa, REQUIRED, progress)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Train Medusa-1 heads (frozen target, self-distillation).")
    p.add_argument("--target", type=Path, help="HF model directory of the target")
    p.add_argument("--out", type=Path, help="output directory (published Medusa layout)")
    p.add_argument("--family", type=Path, help="a built family dir: train (or reuse) <family>/medusa for its "
                   "target with --preset's spec (the cached `make export` step)")
    p.add_argument("--data", type=Path, help="train on the target's responses in this dir (train.responses), "
                   "reused while the spec and the data are unchanged; use a real-target preset")
    p.add_argument("--heads", type=int, help="number of heads (default: the preset's)")
    p.add_argument("--layers", type=int, help="ResBlocks per head (medusa_num_layers; default: the preset's)")
    p.add_argument("--steps", type=int, help="training steps (default: the preset's)")
    p.add_argument("--preset", default="default", choices=sorted(PRESETS), help="data and step budget")
    p.add_argument("--format", default="safetensors", choices=["safetensors", "pt"])
    args = p.parse_args(argv)
    if args.family is not None:
        return finish(lambda: build_medusa_heads(args.family, args.preset, say), "accuracy")
    if args.target is None or args.out is None:
        p.error("--target and --out are required (or --family DIR)")
    spec = native_precision(PRESETS[args.preset])
    spec = replace(spec, heads=spec.heads if args.heads is None else args.heads,
                   layers=spec.layers if args.layers is None else args.layers)
    if args.steps is not None:
        spec = with_steps(spec, args.steps)
    for name in ("heads", "steps"):
        if getattr(spec, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.data is not None:
        return finish(lambda: train_medusa_cached(args.target, args.data, args.out, spec, say), "accuracy")
    return finish(lambda: train_medusa(args.target, args.out, spec, say, args.format), "accuracy")


if __name__ == "__main__":
    sys.exit(main())
