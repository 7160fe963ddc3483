"""Train an EAGLE-1/2 head on a frozen target; write SafeAILab's published layout.

The head reads (token at position i+1, target feature at position i) and regresses
the target feature at position i+1 (smooth L1, EAGLE's feature loss), plus a token
loss: cross-entropy of the target's LM head applied to the predicted feature against
the target's own next-token distribution (self-distillation: the head learns what
verification will accept). Features are the target's final hidden states (after
its final norm); the target, its embeddings and its LM head stay frozen. Inputs get
uniform noise, EAGLE's augmentation for drafting from its own (imperfect) features.

Drafting feeds the head its own predicted feature from the second tree level on, so
a head trained on the target's features alone drafts the deeper levels from inputs
it never saw (SmolLM2-135M: held-out top-1 0.37 at level 1, 0.21 at level 2, 0.17 at
level 3). With `unroll` N the head is also trained as it drafts (HASS's and
EAGLE-3's training-time test): levels 2..N read its own output of the level before
and attend as the drafter's tree does (`head_unroll`), each level's losses against
the target's next feature and token there, weighted LEVEL_DECAY per level; with
`unroll_rows` < 1 the draft levels run at that share of each window's rows, drawn per batch.

Training sequences mix windows of the train split and the target's own greedy
continuations of train-split prompts (the text a greedy run actually drafts on).
The target is frozen, so its features are computed once; steps run only the head.

    python -m specdeploy.train.eagle --target DIR --out DIR [--steps N]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ..export.draft_vocab import write_draft_vocab
from ..export.eagle_heads import EagleHead, new_head, save_head
from .cli_finish import finish, say
from .distill import (
    HASHED_WHEN_SET,
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
LEVEL_DECAY = 0.8  # a draft level's loss weight against the level above it (upstream EAGLE-3's)
ACCURACY_LEVELS = 3  # draft levels the accuracy is reported at (the drafter's first levels)


@dataclass(frozen=True)
class EagleTrainSpec:
    steps: int = 300
    batch: int = 8  # sequences per step
    lr: float = 2e-3
    warmup: int = 20
    token_weight: float = 0.5  # token loss weight next to the feature loss (upstream: 0.1)
    # Share of the token loss against the target's argmax (the rest: its full distribution).
    # Greedy acceptance is argmax agreement, but a head starved of data learns more from the whole
    # distribution (the `real` preset below).
    hard_share: float = 1.0
    intermediate: int = 0  # the head's MLP width (0: the target's); the head is read once per draft level
    noise: float = 0.2  # uniform noise amplitude on input features
    data_windows: int = 96  # train-split windows the target reads
    gen_prompts: int = 64  # train-split prompts the target continues greedily
    prompt_len: int = 16
    gen_tokens: int = 112
    eval_windows: int = 16
    eval_prompts: int = 16
    bf16: bool = False
    threads: int = 2
    seed: int = 0
    # > 0: the token loss ranks only the N most frequent tokens of the training text (the export
    # drafts among at most `draft_vocab` of them); a large target's full LM head is most of a step.
    train_vocab: int = 0
    window: int = 128  # positions per window of the target's responses (--data)
    # draft levels each position is trained at (1: the target's features only; module docstring)
    unroll: int = 1
    # share of a window's rows the draft levels past the first are trained at, drawn per batch (each
    # level costs about what the first does; the first level always trains at every row)
    unroll_rows: float = field(default=1.0, metadata={HASHED_WHEN_SET: True})

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.gen_tokens

    def config_hash(self) -> str:
        return spec_hash(self, TRAIN_FORMAT)


# Sized for the budgets on a 2-core CPU: micro <= 20 s, default <= 3 minutes.
PRESETS = {
    # The micro target is close to noise: its full distribution teaches the tiny head more than its argmax.
    "micro": EagleTrainSpec(steps=400, batch=8, lr=3e-3, hard_share=0.0, data_windows=48, gen_prompts=32,
                            gen_tokens=80, eval_windows=8, eval_prompts=8, threads=1),
    # A narrower MLP than the target's (384 vs 1024) costs ~nothing in accuracy and a fifth of each draft level.
    "default": EagleTrainSpec(steps=600, batch=8, lr=2e-3, intermediate=384, data_windows=240, gen_prompts=128,
                              gen_tokens=112, bf16=True),
    # A real target's responses (--data), over a draft vocabulary. On SmolLM2-135M's default data
    # (45k positions), free-form top-1 / top-4: argmax labels 0.191 / 0.358 at 250 steps, 0.212 /
    # 0.397 at 750; the target's distribution 0.198 / 0.389 at 250, 0.223 / 0.410 at 400 (1.7x the
    # time of 250), 0.246 / 0.444 at 750. At 400, EAGLE went from 1.06x to 1.13x ar on 8 chat
    # prompts and from 1.11x to 1.22x on 8 code prompts (acceptance 1.28 -> 1.33, 1.38 -> 1.47).
    # Trained 3 draft levels deep (`unroll`): level 2 / 3 top-1 0.21 / 0.17 -> 0.31 / 0.32 on held-out
    # responses, 0.14 / 0.11 -> 0.20 / 0.20 free-form, level 1 0.37 -> 0.33 and 0.22 -> 0.21. The draft
    # levels at half the rows (`unroll_rows`) make a step 0.63-0.75x as dear (float32, 2-core AVX2: 0.48 against
    # 0.77 s over 40 steps; 226 against 303 s for the whole run)
    # for as good a head: free-form top-1 at levels 1-3 0.218 / 0.184 / 0.183 -> 0.206 / 0.193 / 0.189,
    # held-out 0.319 / 0.311 / 0.315 -> 0.348 / 0.325 / 0.324, and EAGLE as fast on 8 free-form and 8
    # held-out chat prompts (47.7 against 47.0 and 59.7 against 54.4 tokens/s, interleaved). 600 such
    # steps (the time of 400 at every row) scored 0.230 / 0.209 / 0.206 free-form and drafted no faster.
    "real": EagleTrainSpec(steps=400, batch=8, lr=2e-3, intermediate=768, bf16=True, train_vocab=4096,
                           hard_share=0.0, unroll=3, unroll_rows=0.5),
    # `make heads-long`: the long responses (~5x the default's positions), the recipe of `real` with the
    # draft levels at every row (as measured; its cached heads stay valid).
    "real-long": EagleTrainSpec(steps=2000, batch=8, lr=2e-3, warmup=50, intermediate=768, bf16=True,
                                train_vocab=8192, hard_share=0.0, unroll=3),
}


# ---------------------------------------------------------------- data


@torch.no_grad()
def _features(target, seqs: torch.Tensor, bf16: bool, batch: int = 16) -> torch.Tensor:
    """The target's final hidden states (after its final norm): [N, L, H] float32."""
    parts = []
    for i in range(0, len(seqs), batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            parts.append(target.model(input_ids=seqs[i : i + batch]).last_hidden_state.float())
    return torch.cat(parts)


# ---------------------------------------------------------------- head forward


def head_unroll(head: EagleHead, seqs: torch.Tensor, feats: torch.Tensor, levels: int = 1,
                rows: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The head over whole sequences as it drafts, `levels` tree levels deep: [B, L] tokens, [B, L, H]
    features -> per level j, the predicted features [B, M_j, H]: level 0 at every row i = 0 .. m - 1
    (m = L - levels), the later levels at `rows` (sorted row indices; None: every row).

    Level 0 is teacher-forced: row i reads (x[i+1], f[i]) at position i and predicts f[i+1], attending
    rows <= i (the committed past). Level j reads (x[i+1+j], its own level j-1 output at row i) at
    position i+j and predicts f[i+1+j], attending rows <= i of level 0 and row i of each level since,
    itself included: the drafter's tree mask along a path whose earlier drafts were right.
    """
    b, m = seqs.shape[0], seqs.shape[1] - levels
    every = torch.arange(m)
    rows = every if rows is None else rows
    committed = every[:, None] >= every[None, :]
    past = [torch.zeros(b, 0, head.num_kv_heads, head.head_dim)] * (2 * head.num_layers)
    feature, out = feats[:, :m], []
    for j in range(levels):
        at = every if j == 0 else rows
        if j == 1:
            feature = feature[:, rows]
        own = torch.eye(len(at), dtype=torch.bool)
        mask = torch.cat([committed[at]] + [own] * j, -1).expand(b, len(at), m + j * len(at))  # no key free
        feature, presents = head.step(seqs[:, at + 1 + j], feature, (at + j).expand(b, len(at)), mask, past)
        past = [torch.cat([p, new], 1) for p, new in zip(past, presents)]
        out.append(feature)
    return out


def _token_logits(head: EagleHead, feats: torch.Tensor, subset: VocabSubset | None) -> torch.Tensor:
    return head.target_lm_head(feats) if subset is None else subset.logits(feats)


def train_head(head: EagleHead, seqs: torch.Tensor, feats: torch.Tensor, spec: EagleTrainSpec,
               progress: Progress, labels: torch.Tensor | None = None, subset: VocabSubset | None = None) -> dict:
    """Feature loss + token loss. `labels` [N, L]: the target's token after each position (else its
    argmax from the features); with `subset` the token loss ranks only its tokens."""

    def level_losses(pred, f, want):
        """The feature and token losses of predicted features `pred` against the target's features `f`
        and next tokens `want` (None: the target's argmax) at the same positions."""
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec.bf16):
            logits = _token_logits(head, pred, subset)
            with torch.no_grad():
                teacher = F.softmax(_token_logits(head, f, subset).float(), -1)
        logq = F.log_softmax(logits.float(), -1)
        soft = -(teacher * logq).sum(-1).mean()
        if want is None:
            want = teacher.argmax(-1)  # already an index into the subset's logits
        elif subset is not None:
            want = subset.index[want]
        hard = F.nll_loss(logq.flatten(0, 1), want.flatten(), ignore_index=IGNORE)
        return F.smooth_l1_loss(pred.float(), f), spec.hard_share * hard + (1 - spec.hard_share) * soft

    def batch_loss(gen: torch.Generator):
        idx = torch.randint(0, len(seqs), (spec.batch,), generator=gen)
        s, f = seqs[idx], feats[idx]
        noisy = f + (torch.rand(f.shape, generator=gen) - 0.5) * spec.noise
        m = s.shape[1] - spec.unroll
        rows = None
        if spec.unroll > 1 and spec.unroll_rows < 1.0:  # the draft levels at a random share of the rows
            rows = torch.randperm(m, generator=gen)[: max(1, round(spec.unroll_rows * m))].sort().values
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec.bf16):
            preds = head_unroll(head, s, noisy, spec.unroll, rows)
        total, parts, every = 0.0, {}, torch.arange(m)
        for j, pred in enumerate(preds):  # level j predicts the positions 1+j on from its rows
            ahead = (every if j == 0 or rows is None else rows) + 1 + j
            feat_loss, token_loss = level_losses(pred, f[:, ahead], None if labels is None else labels[idx][:, ahead])
            total = total + LEVEL_DECAY**j * (feat_loss + spec.token_weight * token_loss)
            if j == 0:
                parts = {"feature": feat_loss, "token": token_loss}
        return total, parts

    params = [p for p in head.parameters() if p.requires_grad]
    return fit(head, params, batch_loss, steps=spec.steps, lr=spec.lr, warmup=spec.warmup, seed=spec.seed + 1,
               tag="eagle", progress=progress)


@torch.no_grad()
def head_accuracy(head: EagleHead, seqs: torch.Tensor, feats: torch.Tensor, top: int = 4,
                  labels: torch.Tensor | None = None, subset: VocabSubset | None = None) -> dict:
    """Top-1 (and top-`top`) agreement of the head's next token with the target's at the first draft
    level (the target's features), and top-1 at the next levels (its own: `head_unroll`), along the
    target's path (drafting among `subset` when given, as an export with that draft vocabulary does)."""
    m = seqs.shape[1] - ACCURACY_LEVELS
    out = {}
    for j, pred in enumerate(head_unroll(head, seqs, feats, ACCURACY_LEVELS)):
        ahead = slice(1 + j, m + 1 + j)
        logits = _token_logits(head, pred, subset)
        ranked = logits.topk(min(top, logits.shape[-1]), -1).indices
        if subset is not None:
            ranked = subset.ids[ranked]
        theirs = head.target_lm_head(feats[:, ahead]).argmax(-1) if labels is None else labels[:, ahead]
        scored = theirs != IGNORE  # labelled windows score the responses only
        top1 = round((ranked[..., 0] == theirs)[scored].float().mean().item(), 4)
        if j == 0:
            topk = (ranked == theirs[..., None]).any(-1)[scored].float().mean().item()
            out = {"positions": int(scored.sum()), "top1": top1, f"top{top}": round(topk, 4), "top1_levels": [top1]}
        else:
            out["top1_levels"].append(top1)
    return out


# ---------------------------------------------------------------- build


def _corpus_data(target, target_dir: Path, spec: EagleTrainSpec, progress: Progress, t0: float):
    """Training (tokens, features) from corpus windows and the target's greedy continuations of
    corpus prompts; held-out sets {name: (tokens, features)}."""
    length = spec.seq_len
    train_stream, heldout_stream = corpus_streams(target_dir, spec.seed + 11,
                                                  (spec.data_windows + spec.gen_prompts + 8) * length * 4,
                                                  (spec.eval_windows + spec.eval_prompts + 8) * length * 4)
    gen = torch.Generator().manual_seed(spec.seed)
    data = random_windows(train_stream, spec.data_windows, length, gen)
    prompts = random_windows(train_stream, spec.gen_prompts, spec.prompt_len, gen)
    generated = greedy_continuations(target, prompts, spec.gen_tokens)
    seqs = torch.cat([data, generated])
    feats = _features(target, seqs, spec.bf16)
    progress(f"[eagle] target features for {seqs.numel():,} positions ({len(generated)} greedy continuations) "
             f"in {time.perf_counter() - t0:.1f}s")
    eval_text = random_windows(heldout_stream, spec.eval_windows, length, gen)
    eval_greedy = greedy_continuations(target, random_windows(heldout_stream, spec.eval_prompts, spec.prompt_len,
                                                              gen), spec.gen_tokens)
    evals = {"heldout_text": (eval_text, _features(target, eval_text, False), None),
             "heldout_greedy": (eval_greedy, _features(target, eval_greedy, False), None)}
    return (seqs, feats, None), evals, seqs


def _responses_data(target, data_dir: Path, spec: EagleTrainSpec, progress: Progress, t0: float):
    """The same (with the target's next-token labels) from its responses in `data_dir` (train.responses)."""
    responses, train, evals = labelled_windows(data_dir, spec.window)
    progress(f"[eagle] {responses.positions:,} positions of the target's responses in {len(train[0])} "
             f"windows ({time.perf_counter() - t0:.1f}s)")
    return train, evals, response_tokens(responses)


def train_eagle(target_dir: Path, out_dir: Path, spec: EagleTrainSpec, progress: Progress = print,
                fmt: str = "safetensors", data_dir: Path | None = None) -> dict:
    """Train a head for the target in `target_dir`; write the EAGLE-1/2 layout to `out_dir`.

    Data: the target's responses in `data_dir` when given, else corpus windows and continuations."""
    t0 = time.perf_counter()
    torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.seed)
    target = frozen_target(target_dir)
    if data_dir is None:
        (seqs, feats, labels), evals, vocab_text = _corpus_data(target, Path(target_dir), spec, progress, t0)
    else:
        (seqs, feats, labels), evals, vocab_text = _responses_data(target, Path(data_dir), spec, progress, t0)

    # Randomly initialised: started from a target layer's weights (SmolLM2-135M's layer 15, 25 or 29, the
    # MLP cut to the head's width or whole) the `real` recipe diverged (loss 5e3-1e4, top-1 under 0.01).
    head = new_head(1, target, seed=spec.seed, intermediate=spec.intermediate or None)
    for p in (*head.embed_tokens.parameters(), *head.target_lm_head.parameters()):
        p.requires_grad_(False)
    subset = None
    if spec.train_vocab:
        subset = VocabSubset.most_frequent(vocab_text, target.lm_head.weight, spec.train_vocab)
    run = train_head(head, seqs, feats, spec, progress, labels, subset)
    accuracy = {what: head_accuracy(head, s, f, labels=lab, subset=subset) for what, (s, f, lab) in evals.items()}
    for what, acc in accuracy.items():
        deeper = " / ".join(f"{a:.3f}" for a in acc["top1_levels"][1:])
        progress(f"[eagle] held-out top-1 vs the target's next token ({what}): {acc['top1']:.3f} "
                 f"(top-4 {acc['top4']:.3f}); at draft levels 2-{ACCURACY_LEVELS}, on its own features: {deeper}")
    meta = run_meta(spec, run, t0, accuracy=accuracy)

    def save(tmp: Path) -> None:
        save_head(head, target.config, tmp, fmt)
        write_draft_vocab(tmp, vocab_text, target.config.vocab_size)

    write_result(out_dir, meta, save)
    progress(f"[eagle] head written to {out_dir} in {meta['seconds']:.1f}s")
    return meta


def train_eagle_cached(target_dir: Path, data_dir: Path, out_dir: Path, spec: EagleTrainSpec,
                       progress: Progress = print) -> dict:
    """`train_eagle` on the target's responses, reused while the spec and the data are unchanged."""
    return reuse_or_train(out_dir, spec, data_hash(data_dir), ["config.json"],
                          lambda: train_eagle(target_dir, out_dir, spec, progress, data_dir=data_dir),
                          progress, "[eagle]")


def build_eagle_head(family_dir: Path, preset: str, progress: Progress = print) -> dict:
    """A head for a built family's target, cached in <family_dir>/eagle. Returns train.json."""
    return train_for_family(family_dir, "eagle", preset, PRESETS, train_eagle, ["config.json"], progress)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Train an EAGLE-1/2 head (frozen target, feature + token loss).")
    p.add_argument("--target", type=Path, help="HF model directory of the target")
    p.add_argument("--out", type=Path, help="output directory (SafeAILab EAGLE-1/2 layout)")
    p.add_argument("--family", type=Path, help="a built family dir instead: head cached in FAMILY/eagle")
    p.add_argument("--data", type=Path, help="train on the target's responses in this dir (train.responses), "
                   "reused while the spec and the data are unchanged; use a real-target preset")
    p.add_argument("--steps", type=int, help="training steps (default: the preset's)")
    p.add_argument("--preset", default="default", choices=sorted(PRESETS), help="data and step budget")
    p.add_argument("--format", default="safetensors", choices=["safetensors", "bin"])
    args = p.parse_args(argv)
    if (args.family is None) == (args.target is None or args.out is None):
        p.error("give either --family DIR or both --target and --out")
    if args.family is not None:
        return finish(lambda: build_eagle_head(args.family, args.preset, say), "accuracy")
    spec = native_precision(PRESETS[args.preset])
    if args.steps is not None:
        if args.steps < 1:
            p.error("--steps must be >= 1")
        spec = with_steps(spec, args.steps)
    if args.data is not None:
        return finish(lambda: train_eagle_cached(args.target, args.data, args.out, spec, say), "accuracy")
    return finish(lambda: train_eagle(args.target, args.out, spec, say, args.format), "accuracy")


if __name__ == "__main__":
    sys.exit(main())
