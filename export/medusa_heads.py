"""Medusa-1 heads in FasterDecoding/Medusa's published layout: build, save, load, validate.

A heads directory holds `config.json` (`medusa_num_heads`, `medusa_num_layers`,
`base_model_name_or_path`) and `medusa_lm_head.safetensors` (or the original
`medusa_lm_head.pt`): the state dict of a ModuleList with one
`Sequential(ResBlock * num_layers, Linear(H, V, bias=False))` per head, so keys read
`{head}.{layer}.linear.weight|bias` and `{head}.{num_layers}.weight`.
Head k maps the target's final hidden state at position t (after the final norm)
to logits for the token at t + k + 2 (the target's own lm_head covers t + 1).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..runtime.errors import SpecDeployError
from .dir_config import read_dir_config

CONFIG_NAME = "config.json"
WEIGHT_NAMES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


class ResBlock(nn.Module):
    """x + SiLU(Linear(x)), Linear with bias: the published block."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


def medusa_module_list(num_heads: int, num_layers: int, hidden: int, vocab: int) -> nn.ModuleList:
    # Upstream repeats one ResBlock object num_layers times (shared weights); separate
    # blocks load the same state dict and compute the same function when it is shared.
    return nn.ModuleList(
        nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)], nn.Linear(hidden, vocab, bias=False))
        for _ in range(num_heads)
    )


@dataclass
class MedusaHeads:
    heads: nn.ModuleList
    num_layers: int
    base_model: str = ""
    source: str = ""

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    @property
    def hidden_size(self) -> int:
        return self.heads[0][-1].weight.shape[1]

    @property
    def vocab_size(self) -> int:
        return self.heads[0][-1].weight.shape[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [num_heads, ..., V]."""
        return torch.stack([head(hidden) for head in self.heads])


def new_heads(num_heads: int, num_layers: int, lm_head_weight: torch.Tensor, base_model: str = "") -> MedusaHeads:
    """Medusa's initialisation: each head starts as the target's lm_head behind identity blocks."""
    vocab, hidden = lm_head_weight.shape
    heads = medusa_module_list(num_heads, num_layers, hidden, vocab)
    with torch.no_grad():
        for head in heads:
            for block in head[:-1]:
                block.linear.weight.zero_()  # SiLU(0) = 0: the block starts as the identity
                block.linear.bias.zero_()
            head[-1].weight.copy_(lm_head_weight.float())
    return MedusaHeads(heads, num_layers, base_model)


def save_heads(heads: MedusaHeads, out_dir: Path, fmt: str = "safetensors", extra_config: dict | None = None) -> Path:
    """Write the published layout (`fmt`: "safetensors" or "pt")."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {
        "medusa_num_heads": heads.num_heads,
        "medusa_num_layers": heads.num_layers,
        "base_model_name_or_path": heads.base_model,
        "hidden_size": heads.hidden_size,
        "vocab_size": heads.vocab_size,
        **(extra_config or {}),
    }
    (out_dir / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    state = {k: v.detach().contiguous().clone() for k, v in heads.heads.state_dict().items()}
    for name in WEIGHT_NAMES:
        (out_dir / name).unlink(missing_ok=True)
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(state, str(out_dir / WEIGHT_NAMES[0]))
    elif fmt == "pt":
        torch.save(state, out_dir / WEIGHT_NAMES[1])
    else:
        raise ValueError(f"unknown heads format {fmt!r}")
    return out_dir


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated / corrupt / not a tensor dict
        raise SpecDeployError(f"could not read Medusa heads from {path}: {type(exc).__name__}: {exc}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise SpecDeployError(f"{path} does not hold a state dict of tensors")
    return state


def load_heads(heads_dir: Path, hidden_size: int, vocab_size: int) -> MedusaHeads:
    """Load and validate a heads directory against the target's hidden size and vocabulary."""
    heads_dir = Path(heads_dir)
    cfg = read_dir_config(heads_dir, CONFIG_NAME, "Medusa heads", " (expected medusa_num_heads, medusa_num_layers)")
    weights = next((heads_dir / n for n in WEIGHT_NAMES if (heads_dir / n).is_file()), None)
    if weights is None:
        raise SpecDeployError(f"{heads_dir} holds no Medusa weights ({' or '.join(WEIGHT_NAMES)})")
    state = _read_state(weights)
    num_layers = cfg.get("medusa_num_layers", 1)
    num_heads = cfg.get("medusa_num_heads")
    if num_heads is None:  # some exports omit it: count the heads in the state dict
        num_heads = len({k.split(".")[0] for k in state})
    for name, value in (("medusa_num_heads", num_heads), ("medusa_num_layers", num_layers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "medusa_num_heads" else 0):
            raise SpecDeployError(f"{heads_dir / CONFIG_NAME}: {name} must be a non-negative integer, got {value!r}")

    expected = {}
    for k in range(num_heads):
        for layer in range(num_layers):
            expected[f"{k}.{layer}.linear.weight"] = ((hidden_size, hidden_size), "hidden x hidden")
            expected[f"{k}.{layer}.linear.bias"] = ((hidden_size,), "hidden")
        expected[f"{k}.{num_layers}.weight"] = ((vocab_size, hidden_size), "vocab x hidden")
    missing = [k for k in expected if k not in state]
    if missing:
        raise SpecDeployError(
            f"{weights}: missing {len(missing)} tensors for {num_heads} heads x {num_layers} layers "
            f"(first: {missing[0]}; keys present: {sorted(state)[:4]}...)"
        )
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise SpecDeployError(
            f"{weights}: unexpected tensors {unexpected[:3]} (config says {num_heads} heads x {num_layers} layers)"
        )
    for key, (shape, meaning) in expected.items():
        got = tuple(state[key].shape)
        if got != shape:
            raise SpecDeployError(
                f"Medusa heads {weights.name}: {key} has shape {list(got)}, expected {list(shape)} ({meaning}) "
                f"for a target with hidden_size {hidden_size} and vocab_size {vocab_size}"
            )
    heads = medusa_module_list(num_heads, num_layers, hidden_size, vocab_size)
    heads.load_state_dict({k: v.float() for k, v in state.items()})
    heads.eval()
    for p in heads.parameters():
        p.requires_grad_(False)
    return MedusaHeads(heads, num_layers, str(cfg.get("base_model_name_or_path", "")), str(heads_dir.resolve()))
