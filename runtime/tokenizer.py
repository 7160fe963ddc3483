"""Tokenization with the `tokenizers` library only (no transformers at run time)."""

from __future__ import annotations

from pathlib import Path

from .errors import SpecDeployError


def check_text(text: str, what: str) -> str:
    """`text`, if the tokenizer can take it: lone surrogates (Python's stand-ins for bytes that were
    not UTF-8, as argv and surrogateescape decode them, or JSON's "\\ud800") are no text, and the
    tokenizers library refuses them with a TypeError. `what` names the text in the error."""
    if not isinstance(text, str):
        raise SpecDeployError(f"{what} must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise SpecDeployError(f"{what} is not valid UTF-8 text ({bad_char(text[exc.start])} at character "
                              f"{exc.start})") from None
    return text


def bad_char(char: str) -> str:
    code = ord(char)
    # surrogateescape maps an undecodable byte b to U+DC00 + b
    return f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"


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
        """As the model's own tokenizer does by default (its post-processor decides BOS). A batch of one:
        `encode_batch` releases the GIL, `encode` would hold it (and a server's event loop) throughout."""
        return self.tok.encode_batch([check_text(text, "the text")], add_special_tokens=True)[0].ids

    def decode(self, ids: list[int]) -> str:
        """Text of token ids (ids the tokenizer does not know, e.g. a model's padding rows, decode to nothing)."""
        from .generate import checked_ids  # the generator imports this module

        ids = checked_ids(ids)
        bad = [t for t in ids if not 0 <= t < 2**32]
        if bad:
            raise SpecDeployError(f"token ids must be non-negative 32-bit integers, got {bad[:5]}")
        return self.decode_ids(ids)

    def decode_ids(self, ids: list[int]) -> str:
        """decode() of ids a generation produced (the runtime's own: no checks, per streamed token)."""
        return self.tok.decode(ids, skip_special_tokens=True)


class IncrementalDecoder:
    """Text deltas for a growing list of token ids, decoding only a short window.

    Decoding the whole output per token is O(n^2). Like vLLM's detokenizer, decode
    from a prefix offset a few tokens back (so decoders that treat a leading space
    specially still see context) and emit what lies beyond the already-read text;
    an incomplete UTF-8 sequence (trailing U+FFFD) waits for its next byte.
    """

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = self.read = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.tokenizer.decode_ids(self.ids[self.prefix : self.read])
        after = self.tokenizer.decode_ids(self.ids[self.prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """What is still held back at the end (an undecodable tail decodes as U+FFFD)."""
        before = self.tokenizer.decode_ids(self.ids[self.prefix : self.read])
        after = self.tokenizer.decode_ids(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return after[len(before) :] if len(after) > len(before) else ""
