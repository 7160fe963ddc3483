"""The optimisation loop every trainer here runs: the family's target and draft, the Medusa and
EAGLE heads and the draft cut from a real target.

Each trainer brings only what differs: the model, the parameters it trains and a batch loss that
draws its batch from the loop's seeded generator. The loop owns the rest, the same for all:
AdamW (betas 0.9/0.95, weight decay on matrices only), warm-up + cosine learning rate, gradients
clipped to norm 1, a running loss logged `logs` times.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Callable

import torch

Progress = Callable[[str], None]
# One step's batch, drawn from the loop's generator -> (loss, {name: part of the loss} to log).
BatchLoss = Callable[[torch.Generator], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def bf16_native() -> bool:
    """Whether this CPU computes bfloat16 matmuls natively (AVX512-BF16 or AMX). Elsewhere PyTorch
    emulates them: on a 2-core AVX2 EPYC, SmolLM2's forward took 3-6x float32's time in bfloat16
    (a 64-row decode step 17 vs 6.0 ms a row; a prefill 14 vs 2.5 ms a token)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16"} & set(flags))


def native_precision(spec):
    """A training spec (with `bf16`) in bfloat16 only where the CPU computes it natively."""
    return replace(spec, bf16=False) if spec.bf16 and not bf16_native() else spec


def warmup_cosine_lr(step: int, lr: float, warmup: int, steps: int, min_frac: float = 0.1) -> float:
    """Linear warm-up, then cosine decay from `lr` down to `lr * min_frac`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(steps - warmup, 1)
    return lr * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def with_steps(spec, steps: int):
    """A training spec (with `steps` and `warmup`) cut or stretched to `steps` steps; its warm-up
    at most a fifth of them."""
    return replace(spec, steps=steps, warmup=min(spec.warmup, max(steps // 5, 1)))


def fit(model: torch.nn.Module, params: list[torch.nn.Parameter], batch_loss: BatchLoss, *, steps: int, lr: float,
        warmup: int, seed: int, tag: str, progress: Progress, weight_decay: float = 0.0, min_lr_frac: float = 0.1,
        logs: int = 10) -> dict:
    """Train `params` (of `model`) for `steps` steps; they require grad only meanwhile and `model`
    is left in eval mode. `seed` seeds the generator `batch_loss` draws its batches from.

    Returns {"steps", "seconds", "final_loss"} (the running loss at the end).
    """
    for p in params:
        p.requires_grad_(True)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]  # norms and biases: decaying them only fights the scale
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(seed)
    log_every = max(steps // logs, 1)
    start, running = time.perf_counter(), 0.0
    model.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = warmup_cosine_lr(step, lr, warmup, steps, min_lr_frac)
        loss, parts = batch_loss(gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        running = loss.item() if step == 0 else 0.9 * running + 0.1 * loss.item()
        if (step + 1) % log_every == 0 or step + 1 == steps:
            elapsed = time.perf_counter() - start
            eta = elapsed / (step + 1) * (steps - step - 1)
            detail = ", ".join(f"{name} {part.item():.3f}" for name, part in parts.items())
            progress(f"[{tag}] step {step + 1}/{steps} loss {running:.3f}" + (f" ({detail})" if detail else "")
                     + f" {elapsed:.1f}s, eta {eta:.0f}s")
    model.eval()
    for p in params:
        p.requires_grad_(False)
    return {"steps": steps, "seconds": round(time.perf_counter() - start, 1), "final_loss": round(running, 4)}
