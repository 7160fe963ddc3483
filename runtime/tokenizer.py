"""Tokenization with the `tokenizers` library only (no transformers at run time)."""

from __future__ import annotations

import codecs
import functools
import re
from pathlib import Path

from .errors import SpecDeployError

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


@functools.lru_cache(maxsize=1)
def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte: printable bytes stand for themselves, the rest
    (controls, space, 0x7f-0xa0, 0xad) for chars from U+0100 up, in byte order."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = [b for b in range(256) if b not in keep]
    return {**{chr(b): b for b in keep}, **{chr(0x100 + i): b for i, b in enumerate(extra)}}


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
        decoder = self.tok.decoder  # its state is its JSON, a Sequence's parts included
        self._byte_level = decoder is not None and b'"ByteLevel"' in decoder.__getstate__()
        self._bytes: dict[int, bytes] = {}  # token_bytes, as they are asked for (at most the vocabulary)

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

    def decode_ids(self, ids: list[int], skip_special: bool = True) -> str:
        """decode() of ids a generation produced (the runtime's own: no checks, per streamed token)."""
        return self.tok.decode(ids, skip_special_tokens=skip_special)

    def ends_inside_character(self, ids: list[int]) -> bool | None:
        """Whether the bytes of `ids` end partway through a UTF-8 character (None: this vocabulary's
        tokens are not bytes, as byte-level BPE's and SentencePiece's are, so it cannot tell)."""
        if not self._byte_level and not any(_BYTE_PIECE.fullmatch(self.tok.id_to_token(i) or "") for i in ids):
            return None
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        decoder.decode(b"".join(self.token_bytes(i) for i in ids), final=False)
        return bool(decoder.getstate()[0])

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, alone (OpenAI's logprobs `bytes`: a token may hold part of
        a UTF-8 character). Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2) maps its alphabet back to
        bytes; SentencePiece pieces read "<0xNN>" as a byte and "\u2581" as a space; a special token
        is its own text; an id the tokenizer lacks (a model's padding rows) is no bytes."""
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._bytes[token_id] = self._piece_bytes(token_id)
        return raw

    def _piece_bytes(self, token_id: int) -> bytes:
        piece = self.tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            table = _byte_level_chars()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode("utf-8")  # an added token (<|im_end|>) is stored as its text
        byte = _BYTE_PIECE.fullmatch(piece)
        if byte:
            return bytes([int(byte.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")


class IncrementalDecoder:
    """Text deltas for a growing list of token ids, decoding only a short window.

    Decoding the whole output per token is O(n^2). Like vLLM's detokenizer, decode
    from a prefix offset a few tokens back (so decoders that treat a leading space
    specially still see context) and emit what lies beyond the already-read text;
    an incomplete UTF-8 sequence (trailing U+FFFD) waits for its next byte: where the tokens are
    bytes, only when their bytes do end inside a character (a U+FFFD that is text, not a
    stand-in, is shown at once). `skip_special`: special tokens decode to nothing (the default,
    as generated text shows them) or to their text (an echoed prompt).
    """

    def __init__(self, tokenizer: TextTokenizer, skip_special: bool = True):
        self.tokenizer, self.skip_special = tokenizer, skip_special
        self.ids: list[int] = []
        self.prefix = self.read = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.tokenizer.decode_ids(self.ids[self.prefix : self.read], self.skip_special)
        after = self.tokenizer.decode_ids(self.ids[self.prefix :], self.skip_special)
        if len(after) <= len(before) or (after.endswith("\ufffd")
                                         and self.tokenizer.ends_inside_character(self.ids[self.read :]) is not False):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """What is still held back at the end (an undecodable tail decodes as U+FFFD)."""
        before = self.tokenizer.decode_ids(self.ids[self.prefix : self.read], self.skip_special)
        after = self.tokenizer.decode_ids(self.ids[self.prefix :], self.skip_special)
        self.prefix = self.read = len(self.ids)
        return after[len(before) :] if len(after) > len(before) else ""


def text_and_offsets(tokenizer: TextTokenizer, ids: list[int]) -> tuple[str, list[int]]:
    """The text of a prompt's `ids`, special tokens written out (an echo shows what the model read), and
    where each token's text starts in it: a token that holds part of a character starts where that
    character does."""
    detok, text, starts = IncrementalDecoder(tokenizer, skip_special=False), "", []
    for tok in ids:
        starts.append(len(text))
        text += detok.push(tok)
    return text + detok.flush(), starts
