"""Byte-level BPE for the embedded family, saved as a Hugging Face tokenizer dir.

Choices (the runtime and the exporter rely on them):
- Byte-level, no normalizer, no prefix space: decode(encode(text)) == text for any
  text, whitespace and newlines included.
- Special tokens <pad>=0, <s>=1, </s>=2. No post-processor: encoding never adds
  <s> or </s>. The family trains on files joined by </s> and sampled as windows
  starting anywhere, so prompts need no <s> in front.
- `clean_up_tokenization_spaces` is off so transformers' decode round-trips too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterable, Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = [PAD, BOS, EOS]  # ids 0, 1, 2 in this order
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _batches(texts: Iterable[str], max_chars: int | None, batch: int = 64) -> Iterator[list[str]]:
    """Texts in batches (the trainer's iterator API), stopping after ~max_chars chars."""
    buf: list[str] = []
    seen = 0
    for text in texts:
        if max_chars is not None and seen >= max_chars:
            break
        buf.append(text)
        seen += len(text)
        if len(buf) == batch:
            yield buf
            buf = []
    if buf:
        yield buf


def train_bpe(texts: Iterable[str], vocab_size: int, max_chars: int | None = None) -> Tokenizer:
    """Train a byte-level BPE with `vocab_size` entries (specials included)."""
    if vocab_size <= 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} leaves no room for merges (needs > 259)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        show_progress=False,
    )
    tok.train_from_iterator(_batches(texts, max_chars), trainer=trainer)
    for token, want in zip(SPECIAL_TOKENS, (PAD_ID, BOS_ID, EOS_ID)):
        got = tok.token_to_id(token)
        if got != want:
            raise RuntimeError(f"special token {token!r} got id {got}, expected {want}")
    return tok


def save_hf_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> Path:
    """Write tokenizer.json + the two config files AutoTokenizer needs."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
    return out_dir


def copy_tokenizer(src_dir: Path, dst_dir: Path) -> None:
    """Copy the tokenizer files next to a saved model so the model dir is self-contained."""
    Path(dst_dir).mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(Path(src_dir) / name, Path(dst_dir) / name)
