"""Logprobs (runtime/logprobs.py): a token's log-softmax and the likeliest alternatives, one clear
error for a bad count; and the bytes a token stands for (runtime/tokenizer.py), which OpenAI's
`bytes` and the token texts of a response are made of."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specdeploy.runtime.errors import SpecDeployError
from specdeploy.runtime.logprobs import MAX_TOP, checked_top, token_logprob
from specdeploy.runtime.tokenizer import TextTokenizer


def _reference(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_a_tokens_logprob_is_the_log_softmax_of_its_row():
    rng = np.random.default_rng(0)
    for scale in (1.0, 30.0):
        logits = (rng.standard_normal(49152) * scale).astype(np.float32)
        want = _reference(logits)
        for token in (0, 17, int(np.argmax(logits)), 49151):
            got = token_logprob(logits, token, 5)
            # exponentials in float32, summed in float64
            assert got.token_id == token and abs(got.logprob - want[token]) < 1e-6
            order = np.argsort(-want, kind="stable")[:5]
            assert [i for i, _ in got.top] == order.tolist()
            assert np.allclose([v for _, v in got.top], want[order], atol=1e-6, rtol=0)
        assert token_logprob(logits, 3, 0).top == ()
    # all alike: every logprob is -log(V)
    flat = token_logprob(np.zeros(8, np.float32), 2, 3)
    assert abs(flat.logprob + np.log(8)) < 1e-12


def test_ties_at_the_cut_go_to_the_lower_ids():
    logits = np.array([0.0, 2.0, 1.0, 2.0, 1.0, 1.0, -1.0], np.float32)
    got = token_logprob(logits, 6, 4)
    assert [i for i, _ in got.top] == [1, 3, 2, 4]
    assert got.top[0][1] == got.top[1][1] and got.top[2][1] == got.top[3][1]
    assert [i for i, _ in token_logprob(logits, 0, 7).top] == [1, 3, 2, 4, 5, 0, 6]


@pytest.mark.parametrize("value", [-1, MAX_TOP + 1, 2.5, "3", True, [1]])
def test_a_bad_count_is_one_clear_error(value):
    with pytest.raises(SpecDeployError, match=f"logprobs must be an integer from 0 to {MAX_TOP}"):
        checked_top(value)


def test_good_counts():
    assert checked_top(None) is None and checked_top(0) == 0 and checked_top(np.int64(MAX_TOP)) == MAX_TOP


def _byte_level_tokenizer(directory):
    """A real byte-level BPE (GPT-2's alphabet: SmolLM2, Llama 3, Qwen), trained here, with a special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, héllo wörld", "日本語のテキスト 😀", "tabs\tand\nnewlines"] * 20, trainer)
    tok.save(str(directory / "tokenizer.json"))
    return TextTokenizer(directory)


def test_byte_level_tokens_are_their_bytes(tmp_path):
    tok = _byte_level_tokenizer(tmp_path)
    text = "héllo wörld — 日本語 😀 tab\tnew\nline"
    ids = tok.encode(text)
    pieces = [tok.token_bytes(i) for i in ids]
    assert b"".join(pieces) == text.encode("utf-8")
    assert any(not _utf8(p) for p in pieces)  # some token holds part of a character: bytes, not text
    end = tok.tok.token_to_id("<|end|>")
    assert tok.token_bytes(end) == b"<|end|>"
    assert tok.token_bytes(10**6) == b""  # an id past the vocabulary (a model's padding rows)


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_sentencepiece_pieces_read_byte_fallback_and_the_space_mark(tmp_path):
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, "\u2581the": 1, "cat": 2, "<0xE6>": 3, "<0x97>": 4, "<0xA5>": 5, "\u2581": 6}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.save(str(tmp_path / "tokenizer.json"))
    assert json.loads((tmp_path / "tokenizer.json").read_text())["decoder"]["type"] == "Sequence"
    t = TextTokenizer(tmp_path)
    assert [t.token_bytes(i) for i in (1, 2, 6)] == [b" the", b"cat", b" "]
    assert b"".join(t.token_bytes(i) for i in (3, 4, 5)).decode("utf-8") == "\u65e5"


def test_openai_shapes_name_partial_characters_and_keep_the_sampled_token():
    """Tokens that hold part of a UTF-8 character get OpenAI's "bytes:\\xNN" texts; a legacy top_logprobs
    keeps the likelier of two tokens with one text and always lists the sampled token; offsets are the
    generation's."""
    from specdeploy.runtime.logprobs import TokenLogprob
    from specdeploy.serve.openai_format import Shape

    pieces = {1: b"\xf0\x9f", 2: b"\x99\x82", 3: b"\xf0\x9f\x98", 4: b" a", 5: b"<|end|>", 6: b" a"}
    tokens = [TokenLogprob(1, -0.5, ((3, -0.2), (1, -0.5)), 0), TokenLogprob(2, -0.1, ((2, -0.1),), 0),
              TokenLogprob(4, -3.0, ((5, -0.1), (6, -1.0)), 1)]
    legacy = Shape(False, "m", pieces.__getitem__).logprobs(tokens)
    assert legacy["tokens"] == ["bytes:\\xf0\\x9f", "bytes:\\x99\\x82", " a"]
    assert legacy["token_logprobs"] == [-0.5, -0.1, -3.0] and legacy["text_offset"] == [0, 0, 1]
    assert legacy["top_logprobs"] == [{"bytes:\\xf0\\x9f\\x98": -0.2, "bytes:\\xf0\\x9f": -0.5},
                                      {"bytes:\\x99\\x82": -0.1},
                                      {"<|end|>": -0.1, " a": -1.0}]  # token 6 (" a", likelier) keeps the key
    chat = Shape(True, "m", pieces.__getitem__).logprobs(tokens)
    first = chat["content"][0]
    assert first["bytes"] == [0xF0, 0x9F] and first["token"] == "bytes:\\xf0\\x9f" and first["logprob"] == -0.5
    assert [t["token"] for t in chat["content"][2]["top_logprobs"]] == ["<|end|>", " a"]
    assert chat["refusal"] is None and Shape(True, "m").logprobs(None) is None


def test_offsets_and_text_of_a_prompt_keep_what_the_model_read(tmp_path):
    """An echoed prompt writes its special tokens out; each token's offset points at its text there; a
    U+FFFD that is text is shown at once, not held as if it stood for an incomplete character."""
    from specdeploy.runtime.tokenizer import IncrementalDecoder, text_and_offsets

    tok = _byte_level_tokenizer(tmp_path)
    for text in ["héllo <|end|> wörld", "x\ufffdy \ufffd", "日本語 😀 tab\tend"]:
        ids = tok.encode(text)
        shown, starts = text_and_offsets(tok, ids)
        assert shown == text
        pieces = [tok.token_bytes(i) for i in ids]
        for piece, start in zip(pieces, starts):
            if _utf8(piece):  # a whole token's text is where its offset says
                assert shown[start:start + len(piece.decode())] == piece.decode()
    detok = IncrementalDecoder(tok)
    assert "".join(detok.push(i) for i in tok.encode("x\ufffd")) == "x\ufffd"  # shown at once, not held
