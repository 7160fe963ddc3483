"""Build the embedded model family: a target and a draft Llama trained on the stdlib.

The project needs a target/draft pair that exists on every machine without a
download, that behaves like a real pair (the target clearly more expensive, the
draft agreeing with it often) and that is built within the `make export` budget
on a small CPU. Steps:

1. a byte-level BPE on the train split (`tokenizer`),
2. the target, trained with cross-entropy on random windows of the train split,
3. the draft, distilled from the target's logits (KL, mixed with a little CE),
   which is what raises its top-1 agreement with the target,
4. held-out loss and draft/target top-1 agreement on files neither model saw.

Output (`out_dir`): tokenizer/, target/, draft/ (each a Hugging Face dir that
`AutoModelForCausalLM` / `AutoTokenizer` load) and family.json. family.json is
written last and carries a hash of the preset, so a finished build is reused and
an interrupted or outdated one is redone.

    python -m specdeploy.train.family --preset default --out build/family/default
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

if "torch" not in sys.modules:
    # libgomp reads this once, when torch loads it. Its default (spin while
    # waiting) makes 2-thread training 3-5x slower whenever another process
    # shares the 2 cores (measured here); passive waiting costs little when idle.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from ..export.hf_loading import readable_by_both
from ..export.out_dir import build_lock
from . import corpus
from .distill import evenly_spaced_windows, random_windows, spec_hash, take_chars, token_stream
from .loop import fit
from .tokenizer import BOS_ID, EOS_ID, PAD_ID, copy_tokenizer, save_hf_tokenizer, train_bpe

FAMILY_FORMAT = 1  # bump when the recipe changes in a way the preset hash cannot see
Progress = Callable[[str], None]


@dataclass(frozen=True)
class ModelSpec:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class TrainSpec:
    steps: int
    batch: int  # sequences per step
    lr: float
    warmup: int
    min_lr_frac: float = 0.1
    weight_decay: float = 0.1
    kl_weight: float = 0.0  # > 0: distill from the target (draft only)


@dataclass(frozen=True)
class Preset:
    name: str
    vocab_size: int
    tokenizer_chars: int  # chars of train text the BPE learns merges from
    corpus_chars: int  # chars of train text tokenized into the training stream
    seq_len: int
    max_position_embeddings: int
    target: ModelSpec
    draft: ModelSpec
    target_train: TrainSpec
    draft_train: TrainSpec
    eval_windows: int  # held-out windows of seq_len tokens for loss / agreement
    bf16: bool  # bf16 autocast for training (measured ~2.4x faster on AVX512-BF16 CPUs)
    seed: int = 0
    rope_theta: float = 10000.0

    def config_hash(self) -> str:
        return spec_hash(self, FAMILY_FORMAT)


MICRO = Preset(
    name="micro",
    vocab_size=512,
    tokenizer_chars=1_000_000,
    corpus_chars=1_500_000,
    seq_len=128,
    max_position_embeddings=1024,
    target=ModelSpec(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=192),
    draft=ModelSpec(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=96),
    target_train=TrainSpec(steps=400, batch=8, lr=3e-3, warmup=20),
    draft_train=TrainSpec(steps=300, batch=8, lr=3e-3, warmup=20, kl_weight=0.9),
    eval_windows=32,
    bf16=False,  # measured: bf16 autocast is 2-3x slower than fp32 at this size
)

DEFAULT = Preset(
    name="default",
    vocab_size=4096,
    tokenizer_chars=8_000_000,
    corpus_chars=12_000_000,
    seq_len=256,
    max_position_embeddings=1024,
    target=ModelSpec(hidden=384, layers=6, heads=6, kv_heads=2, intermediate=1024),
    draft=ModelSpec(hidden=192, layers=1, heads=3, kv_heads=1, intermediate=768),
    # Small batches, many steps: at ~0.6M tokens, more updates beat bigger batches
    # (proxy sweeps here: batch 8 -> 4 -> 2 at equal tokens kept lowering held-out
    # loss and raising draft agreement; lr ~1e-3 target, ~3e-3 draft did best).
    # Draft tokens buy agreement cheaply (its step is ~half a target step, mostly
    # the teacher's forward), so the draft gets more of them than the target.
    target_train=TrainSpec(steps=600, batch=4, lr=1e-3, warmup=40),
    draft_train=TrainSpec(steps=1400, batch=2, lr=3e-3, warmup=30, kl_weight=0.9),
    eval_windows=48,
    bf16=True,
)

_PRESETS = (MICRO, DEFAULT)
PRESET_NAMES = tuple(p.name for p in _PRESETS)


def get_preset(name: str) -> Preset:
    for preset in _PRESETS:
        if preset.name == name:
            return preset
    raise ValueError(f"unknown family preset {name!r}; expected one of {PRESET_NAMES}")


# ---------------------------------------------------------------- models


def llama_config(spec: ModelSpec, preset: Preset, vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=preset.max_position_embeddings,
        rope_theta=preset.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )


def new_model(spec: ModelSpec, preset: Preset, vocab_size: int, seed: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(spec, preset, vocab_size))
    return model.float()


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- training


def distill_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor, kl_weight: float):
    """kl_weight * KL(teacher || student) + (1 - kl_weight) * CE(labels), per token."""
    vocab = logits.shape[-1]
    log_q = F.log_softmax(logits.float().reshape(-1, vocab), dim=-1)
    ce = F.nll_loss(log_q, labels.reshape(-1))
    if kl_weight == 0.0:
        return ce
    log_p = F.log_softmax(teacher_logits.float().reshape(-1, vocab), dim=-1)
    kl = F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")
    return kl_weight * kl + (1 - kl_weight) * ce


def train(model, stream: torch.Tensor, spec: TrainSpec, preset: Preset, label: str,
          progress: Progress, teacher=None, seed: int = 0) -> dict:
    """Train `model` in place on random windows of `stream`; distill from `teacher` if given."""
    if (teacher is None) != (spec.kl_weight == 0.0):
        raise ValueError(f"{label}: a teacher is needed exactly when kl_weight > 0")

    def batch_loss(gen: torch.Generator):
        window = random_windows(stream, spec.batch, preset.seq_len + 1, gen)
        inputs, labels = window[:, :-1], window[:, 1:]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=preset.bf16):
            teacher_logits = None
            if teacher is not None:
                with torch.no_grad():
                    teacher_logits = teacher(input_ids=inputs).logits
            logits = model(input_ids=inputs).logits
        return distill_loss(logits, teacher_logits, labels, spec.kl_weight), {}

    run = fit(model, list(model.parameters()), batch_loss, steps=spec.steps, lr=spec.lr, warmup=spec.warmup, seed=seed,
              tag=label, progress=progress, weight_decay=spec.weight_decay, min_lr_frac=spec.min_lr_frac, logs=20)
    return {"steps": spec.steps, "tokens": spec.steps * spec.batch * preset.seq_len, "seconds": run["seconds"],
            "final_train_loss": run["final_loss"]}


# ---------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(target, draft, windows: torch.Tensor, batch: int = 8) -> dict:
    """Held-out loss of both models and the draft's top-1 agreement with the target, in fp32."""
    sums = {"target": 0.0, "draft": 0.0, "agree": 0.0}
    count = 0
    for i in range(0, windows.shape[0], batch):
        chunk = windows[i : i + batch]
        inputs, labels = chunk[:, :-1], chunk[:, 1:]
        t_logits = target(input_ids=inputs).logits.float()
        d_logits = draft(input_ids=inputs).logits.float()
        vocab = t_logits.shape[-1]
        sums["target"] += F.cross_entropy(t_logits.reshape(-1, vocab), labels.reshape(-1), reduction="sum").item()
        sums["draft"] += F.cross_entropy(d_logits.reshape(-1, vocab), labels.reshape(-1), reduction="sum").item()
        sums["agree"] += (t_logits.argmax(-1) == d_logits.argmax(-1)).sum().item()
        count += labels.numel()
    return {
        "heldout_tokens": count,
        "target_loss": round(sums["target"] / count, 4),
        "draft_loss": round(sums["draft"] / count, 4),
        "top1_agreement": round(sums["agree"] / count, 4),
    }


# ---------------------------------------------------------------- build


def _save_model(model, out: Path, tokenizer_dir: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out, safe_serialization=True)
    readable_by_both(Path(out) / "config.json")  # transformers 4.x and 5.x read the same RoPE
    copy_tokenizer(tokenizer_dir, out)


def load_cached(out_dir: Path, preset: Preset) -> dict | None:
    """family.json's contents if a finished build of this exact preset is in out_dir."""
    meta_path = Path(out_dir) / "family.json"
    if not meta_path.exists():
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError:
        return None
    dirs_ok = all((Path(out_dir) / m / "model.safetensors").exists() for m in ("target", "draft"))
    return meta if dirs_ok and meta.get("config_hash") == preset.config_hash() else None


def build_family(preset: str, out_dir: Path, progress: Progress = print) -> dict:
    """Build (or reuse) the target/draft family for `preset` in `out_dir`; returns family.json."""
    spec = get_preset(preset)
    out_dir = Path(out_dir)

    def say(msg: str) -> None:
        progress(msg)
        sys.stdout.flush()  # progress lines must show up live in logs, not at exit

    with build_lock(out_dir):
        cached = load_cached(out_dir, spec)
        if cached is not None:
            say(f"[family] {preset}: reusing {out_dir} (config {cached['config_hash']})")
            return cached
        return _build(spec, out_dir, say)


def _build(spec: Preset, out_dir: Path, say: Progress) -> dict:
    preset = spec.name
    t0 = time.perf_counter()
    torch.set_num_threads(2)
    torch.manual_seed(spec.seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "family.json").unlink(missing_ok=True)  # invalid until this build finishes

    say(f"[family] {preset}: training tokenizer (vocab {spec.vocab_size})")
    tok = train_bpe(corpus.iter_texts("train", shuffle_seed=spec.seed), spec.vocab_size, spec.tokenizer_chars)
    tokenizer_dir = save_hf_tokenizer(tok, out_dir / "tokenizer", spec.max_position_embeddings)
    vocab_size = tok.get_vocab_size()

    train_texts = take_chars(corpus.iter_texts("train", shuffle_seed=spec.seed), spec.corpus_chars)
    train_stream = token_stream(tok, train_texts, EOS_ID)
    heldout_stream = token_stream(tok, corpus.iter_texts("heldout"), EOS_ID)
    heldout = evenly_spaced_windows(heldout_stream, spec.eval_windows, spec.seq_len + 1)
    say(f"[family] corpus: {train_stream.numel():,} train tokens, {heldout.numel():,} held-out eval tokens "
        f"({time.perf_counter() - t0:.1f}s)")

    target = new_model(spec.target, spec, vocab_size, seed=spec.seed)
    draft = new_model(spec.draft, spec, vocab_size, seed=spec.seed + 1)
    say(f"[family] target {n_params(target):,} params, draft {n_params(draft):,} params")

    target_run = train(target, train_stream, spec.target_train, spec, "target", say, seed=spec.seed)
    # fit leaves the target frozen: from here on it is the draft's teacher.
    draft_run = train(draft, train_stream, spec.draft_train, spec, "draft", say,
                      teacher=target, seed=spec.seed + 1)

    metrics = evaluate(target, draft, heldout)
    say(f"[family] held-out loss target {metrics['target_loss']:.3f} draft {metrics['draft_loss']:.3f}, "
        f"top-1 agreement {metrics['top1_agreement']:.3f}")

    _save_model(target, out_dir / "target", tokenizer_dir)
    _save_model(draft, out_dir / "draft", tokenizer_dir)
    meta = {
        "preset": spec.name,
        "config_hash": spec.config_hash(),
        "config": asdict(spec),
        "vocab_size": vocab_size,
        "train_stream_tokens": train_stream.numel(),
        "params": {"target": n_params(target), "draft": n_params(draft)},
        "training": {"target": target_run, "draft": draft_run},
        **metrics,
        "build_seconds": round(time.perf_counter() - t0, 1),
        "torch": torch.__version__,
    }
    (out_dir / "family.json").write_text(json.dumps(meta, indent=2) + "\n")
    say(f"[family] {preset} done in {meta['build_seconds']:.1f}s -> {out_dir}")
    return meta


# ---------------------------------------------------------------- random models for arch tests


RANDOM_ARCHS = ("llama", "mistral", "qwen2", "qwen3")


def _random_config(arch: str, vocab_size: int, overrides: dict | None = None):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.2,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    )
    if arch == "llama":
        common.update(head_dim=16)
        cls = LlamaConfig
    elif arch == "mistral":
        common.update(head_dim=16, sliding_window=None)
        cls = MistralConfig
    elif arch == "qwen2":  # q/k/v projections carry a bias
        common.update(use_sliding_window=False)
        cls = Qwen2Config
    else:
        assert arch == "qwen3", arch  # per-head RMSNorm on q and k
        common.update(head_dim=16, attention_bias=False, use_sliding_window=False)
        cls = Qwen3Config
    return cls(**{**common, **(overrides or {})})



def make_random_model(arch: str, out_dir: Path, tokenizer_dir: Path, seed: int = 0,
                      overrides: dict | None = None) -> Path:
    """A tiny random-init HF causal LM of `arch` (with the tokenizer copied in) for architecture tests;
    `overrides`: config fields to set (e.g. a head size the fused graphs cannot take).

    initializer_range 0.2 makes the logits peaked, so argmax ties between an
    exported graph and PyTorch are unlikely.
    """
    from transformers import AutoModelForCausalLM

    if arch not in RANDOM_ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; expected one of {RANDOM_ARCHS}")
    out_dir, tokenizer_dir = Path(out_dir), Path(tokenizer_dir)
    vocab_size = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()
    config = _random_config(arch, vocab_size, overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    # HF inits biases to 0 and norm weights to 1; perturb them so an exporter that
    # drops a bias or a norm scale (qwen3's q_norm/k_norm included) fails the tests.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.bias"):
                p.normal_(0.0, config.initializer_range)
            elif name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    _save_model(model, out_dir, tokenizer_dir)
    return out_dir


# ---------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the embedded target/draft model family.")
    parser.add_argument("--preset", default="default", help=f"one of {PRESET_NAMES}")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    args = parser.parse_args(argv)
    try:
        get_preset(args.preset)
    except ValueError as err:
        parser.error(str(err))
    meta = build_family(args.preset, args.out, progress=lambda m: print(m, flush=True))
    print(json.dumps({k: meta[k] for k in ("preset", "params", "target_loss", "draft_loss", "top1_agreement")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
