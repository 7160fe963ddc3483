"""Load a local Hugging Face model directory, with clear errors for bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..runtime.errors import SpecDeployError
from .decoder_graph import SUPPORTED_MODEL_TYPES

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def read_hf_config(model_dir: Path) -> dict:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise SpecDeployError(f"model directory not found: {model_dir}")
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise SpecDeployError(f"{model_dir} has no config.json: not a Hugging Face model directory")
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise SpecDeployError(f"{cfg_path} is not valid JSON: {exc}") from None


def load_causal_lm(model_dir: Path, dtype: str = "float32"):
    """An HF causal LM of a supported family, in eval mode, on the CPU."""
    from transformers import AutoModelForCausalLM

    cfg = read_hf_config(model_dir)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise SpecDeployError(
            f"{model_dir}: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if dtype not in DTYPES:
        raise SpecDeployError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    if not any(Path(model_dir).glob("*.safetensors")) and not any(Path(model_dir).glob("*.bin")):
        raise SpecDeployError(f"{model_dir} holds no weights (*.safetensors or *.bin)")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[dtype], attn_implementation="eager")
    except Exception as exc:  # corrupt weights, shape mismatches, unreadable files
        raise SpecDeployError(f"could not load model from {model_dir}: {type(exc).__name__}: {exc}") from None
    return model.eval()


def tokenizer_vocab(model_dir: Path) -> dict[str, int] | None:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())["model"]["vocab"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise SpecDeployError(f"{path} is not a valid tokenizer file: {exc}") from None


def check_same_vocab(target_dir: Path, draft_dir: Path, target_cfg: dict, draft_cfg: dict) -> None:
    """A draft must speak the target's vocabulary, or its tokens mean nothing."""
    if target_cfg.get("vocab_size") != draft_cfg.get("vocab_size"):
        raise SpecDeployError(
            f"vocabulary mismatch: target vocab_size {target_cfg.get('vocab_size')} != draft vocab_size {draft_cfg.get('vocab_size')}"
        )
    tv, dv = tokenizer_vocab(target_dir), tokenizer_vocab(draft_dir)
    if tv is not None and dv is not None and tv != dv:
        differing = len(set(tv.items()) ^ set(dv.items()))
        raise SpecDeployError(f"vocabulary mismatch: target and draft tokenizers differ ({differing} differing entries)")
