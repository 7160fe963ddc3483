"""Tokenization with the `tokenizers` library only (no transformers at run time)."""

from __future__ import annotations

from pathlib import Path

from .errors import SpecDeployError


class TextTokenizer:
    def __init__(self, directory: Path):
        from tokenizers import Tokenizer

        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            raise SpecDeployError(f"tokenizer file missing: {path}")
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as exc:
            raise SpecDeployError(f"tokenizer file {path} is corrupt: {str(exc)[:200]}") from None
        self.directory = Path(directory)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """As the model's own tokenizer does by default (its post-processor decides BOS)."""
        return self.tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)
