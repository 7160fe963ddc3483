"""Task-level accuracy of quantized weights: the quantized graphs against the float32 ones on real text.

The per-graph check (export/check.py) holds ONNX Runtime to float rounding error, which
int4/int8 weights exceed by design. What quantization must keep is the model's behaviour,
measured here on held-out text (the Python standard library's held-out source files,
train/corpus.py, never trained on by the embedded family; or a text file given):

* decoders (target, draft): top-1 agreement, the share of positions where the quantized
  fused graph's argmax equals the float32 portable graph's (the same export's float reference;
  the portable graphs are never quantized), and perplexity of both on the text (a draft with a
  restricted vocabulary: over the positions whose next token it can score);
* the EAGLE head: top-1 agreement of its quantized fused graphs with its float32 portable
  ones, both fed the float32 target's features of the same text (as decoding feeds them).

Each result is printed beside its threshold and fails below it (`specdeploy check` exits
non-zero; `specdeploy export` publishes nothing). The thresholds are the accuracy a scheme
must keep to be deployed, per bit width: int8 should be near lossless, int4 round-to-nearest
costs a few points of agreement and some perplexity on small models. A draft model's weights
decide only how often its drafts are accepted, never the output (the target verifies them),
so it is held only to a floor that a broken quantization falls through: an int4 self-draft
(export --draft self) of SmolLM2-135M keeps 81% top-1 at +21% perplexity, below the int4
target thresholds, and still verifies 2.9 / 3.5 tokens per target call on chat / code.

Runs ONNX Runtime only (no torch): the runtime's own decoders over the manifest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..runtime.errors import SpecDeployError
from ..runtime.graph_contract import DECODER, EAGLE, EAGLE_DRAFT, FUSED, PORTABLE

MIN_TOP1 = {8: 0.97, 4: 0.85}  # decoders: argmax agreement with float32
MAX_PPL_RATIO = {8: 1.02, 4: 1.15}  # decoders: quantized / float32 perplexity
DRAFT_MIN_TOP1, DRAFT_MAX_PPL_RATIO = 0.5, 2.0  # the draft model, any bits (module docstring)
MIN_HEAD_TOP1 = {8: 0.95, 4: 0.80}  # the EAGLE head: its top-1 proposal agrees with float32's
DEFAULT_TOKENS = 512
WINDOW = 256  # tokens of context per evaluation window (less where max_context is smaller)


@dataclass
class TaskResult:
    model: str
    scheme: str  # "int4 (block 32)"
    tokens: int  # positions scored
    top1: float
    min_top1: float
    ppl_float: float | None = None  # decoders only
    ppl_quant: float | None = None
    max_ppl_ratio: float | None = None

    @property
    def ppl_ratio(self) -> float | None:
        return None if self.ppl_float is None else self.ppl_quant / self.ppl_float

    @property
    def passed(self) -> bool:
        ok = self.top1 >= self.min_top1
        return ok and (self.ppl_ratio is None or self.ppl_ratio <= self.max_ppl_ratio)

    def line(self) -> str:
        text = (f"{'ok  ' if self.passed else 'FAIL'} {self.model} {self.scheme}: top-1 agreement with float32 "
                f"{self.top1:.1%} (threshold >= {self.min_top1:.0%})")
        if self.ppl_float is not None:
            text += (f", perplexity {self.ppl_quant:.3f} vs float32 {self.ppl_float:.3f} "
                     f"({self.ppl_ratio - 1:+.1%}, threshold <= {self.max_ppl_ratio - 1:+.0%})")
        return text + f" [{self.tokens} positions]"


def heldout_text(min_chars: int) -> str:
    """Held-out standard-library source, in a fixed order, at least `min_chars` long."""
    from ..train.corpus import iter_texts

    parts, size = [], 0
    for text in iter_texts("heldout"):
        parts.append(text)
        size += len(text)
        if size >= min_chars:
            break
    return "\n".join(parts)


# What is read of a --task-text file: a token is a few bytes of text (BPE averages about 4), so
# past this many bytes per token nothing more can be scored; the cap keeps a huge file (or a
# wrong one) from being read whole.
TEXT_BYTES_PER_TOKEN = 64
MAX_TEXT_BYTES = 64 << 20


def read_task_text(path: str | Path, tokens: int) -> str:
    """The start of a --task-text file, as much as `tokens` tokens can use, as text; one clear error for
    what is not a readable regular UTF-8 file. Opened without blocking and checked by its open handle:
    a FIFO would block the open, and a device (/dev/urandom) never ends."""
    import codecs
    import os
    import stat

    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise SpecDeployError(f"--task-text {path}: no such file") from None
    except OSError as exc:
        raise SpecDeployError(f"--task-text {path}: cannot read it ({exc.strerror or exc})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise SpecDeployError(f"--task-text {path} is a directory; give a text file")
        raise SpecDeployError(f"--task-text {path} is not a regular file (a pipe or a device); give a text file")
    with os.fdopen(fd, "rb") as f:
        limit = min(tokens * TEXT_BYTES_PER_TOKEN, MAX_TEXT_BYTES)
        try:
            data = f.read(limit)
        except OSError as exc:
            raise SpecDeployError(f"--task-text {path}: cannot read it ({exc.strerror or exc})") from None
    try:  # not final at the cap: a character the cap cuts in two is dropped, not an error
        text = codecs.getincrementaldecoder("utf-8")().decode(data, final=len(data) < limit)
    except UnicodeDecodeError as exc:
        raise SpecDeployError(f"--task-text {path} is not UTF-8 text (byte {exc.start}: "
                              f"0x{data[exc.start]:02x})") from None
    if not text.strip():
        raise SpecDeployError(f"--task-text {path} is empty")
    return text


def evaluation_ids(tokenizer, tokens: int, text: str | None = None) -> list[int]:
    """The first `tokens` token ids of `text` (default: held-out standard-library source)."""
    ids = tokenizer.encode(heldout_text(tokens * 8) if text is None else text)[:tokens]
    if len(ids) < 2:
        raise SpecDeployError(f"task check: the text has {len(ids)} tokens, at least 2 are needed")
    return ids


def _windows(ids: list[int], room: int) -> list[np.ndarray]:
    """Consecutive windows of the ids (each scored from an empty cache, `room` rows at most: the
    context less a padded target's spare position); a last lone token is dropped."""
    width = min(WINDOW, room)
    windows = [np.asarray(ids[s : s + width], np.int64) for s in range(0, len(ids), width)]
    return [w for w in windows if len(w) > 1]


def _run(decoder, window: np.ndarray, chunk: int) -> list:
    """Every row's StepOutput for one window, from an empty cache."""
    decoder.reset()
    steps = []
    decoder.prefill(window, chunk, on_chunk=steps.append, all_logits=True)
    return steps


def _scores(steps, window: np.ndarray, columns: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(argmax per position, negative log-likelihood of the next token) for all but the last row.

    `columns`: the vocabulary id of each logits column where the model drafts over a restricted
    vocabulary (draft.draft_vocab); argmax is then a column, and the likelihood is scored only
    where the next token is one of the columns (the others have no logit to score)."""
    logits = np.concatenate([s.logits for s in steps])[:-1].astype(np.float64)
    top = logits.max(-1, keepdims=True)
    logz = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[:, 0]
    targets = window[1:]
    if columns is not None:
        column_of = np.full(max(int(columns.max()), int(targets.max())) + 1, -1, np.int64)
        column_of[columns] = np.arange(len(columns))
        targets = column_of[targets]
    scored = targets >= 0
    nll = (logz - logits[np.arange(len(logits)), np.maximum(targets, 0)])[scored]
    return logits.argmax(-1), nll


def decoder_task(manifest, model: str, ids: list[int], threads: int | None = None) -> TaskResult:
    from ..runtime.backends.ort_decoder import OrtDecoder
    from ..runtime.drafters.draft_model import draft_vocab_ids

    scheme = _scheme(manifest, model)
    columns = draft_vocab_ids(manifest) if model == "draft" else None
    reference = OrtDecoder(manifest, model, "ort-cpu", threads, fused=False)
    quantized = OrtDecoder(manifest, model, "ort-cpu", threads, fused=True)
    agree, nll_f, nll_q = [], [], []
    for window in _windows(ids, manifest.max_context - quantized.spare):
        top_f, f = _scores(_run(reference, window, manifest.prefill_chunk), window, columns)
        top_q, q = _scores(_run(quantized, window, manifest.prefill_chunk), window, columns)
        agree.append(top_f == top_q)
        nll_f.append(f)
        nll_q.append(q)
    agree, nll_f, nll_q = (np.concatenate(a) for a in (agree, nll_f, nll_q))
    bits = scheme["bits"]
    min_top1, max_ppl = (DRAFT_MIN_TOP1, DRAFT_MAX_PPL_RATIO) if model == "draft" else (MIN_TOP1[bits],
                                                                                         MAX_PPL_RATIO[bits])
    if not len(nll_f):  # no next token of the text is in a restricted vocabulary: agreement alone
        return TaskResult(model, _scheme_name(scheme), len(agree), float(agree.mean()), min_top1)
    return TaskResult(model, _scheme_name(scheme), len(agree), float(agree.mean()), min_top1,
                      math.exp(nll_f.mean()), math.exp(nll_q.mean()), max_ppl)


def eagle_task(manifest, ids: list[int], threads: int | None = None) -> TaskResult:
    """The head's top-1 candidate, quantized vs float32, on the float32 target's features of the text."""
    from ..runtime.backends.ort_decoder import OrtDecoder
    from ..runtime.drafters.eagle_head import EagleHeadRunner

    scheme = _scheme(manifest, EAGLE)
    target = OrtDecoder(manifest, "target", "ort-cpu", threads, fused=False)
    heads = [EagleHeadRunner(manifest, "ort-cpu", threads, fused=fused) for fused in (False, True)]
    if not heads[1].fused:
        raise SpecDeployError("task check: the export has no fused EAGLE head graphs to compare")
    key = "features" if heads[0].version == 3 else "hidden"
    agree = []
    for window in _windows(ids, manifest.max_context):  # the float32 target: no spare position
        feats = np.concatenate([getattr(s, key) for s in _run(target, window, manifest.prefill_chunk)])
        tokens, feats = window[1:], feats[:-1]  # row p: the token at p + 1 with the features of p
        tops = []
        for head in heads:
            head.reset()
            sizes, s, top = head.sizes_by_width[head.feature_dim], 0, []
            while s < len(tokens):
                call = head.fit(len(tokens) - s, sizes)
                if call is None:
                    break
                n, pos = call[0], head.cache.length
                out = head.forward(tokens[s : s + n], feats[s : s + n], np.arange(pos, pos + n),
                                   np.tril(np.ones((n, n), bool)))
                head.commit(out, slice(0, n))
                top.append(out.ids[:, 0])
                s += n
            tops.append(np.concatenate(top))
        rows = min(len(t) for t in tops)
        agree.append(tops[0][:rows] == tops[1][:rows])
    agree = np.concatenate(agree)
    return TaskResult(EAGLE, _scheme_name(scheme), len(agree), float(agree.mean()), MIN_HEAD_TOP1[scheme["bits"]])


FLOAT_SCHEME = {"bits": 8, "name": "float32 fused"}  # an unquantized fused graph: held to int8's thresholds


def _scheme(manifest, model: str) -> dict:
    return (manifest.quantization or {}).get("models", {}).get(model, FLOAT_SCHEME)


def _scheme_name(scheme: dict) -> str:
    return scheme.get("name") or f"int{scheme['bits']} (block {scheme['block_size']})"


def run_task_check(manifest, tokens: int = DEFAULT_TOKENS, text: str | None = None,
                   threads: int | None = None) -> list[TaskResult]:
    """One result per quantized model of the export; with nothing quantized, the float32 fused
    target against its portable twin (none without fused graphs). `text`: what to score (a
    --task-text file's, read_task_text); default: held-out standard-library source."""
    from ..runtime.tokenizer import TextTokenizer

    models = list((manifest.quantization or {}).get("models", {})) or \
        [m for m in ("target",) if manifest.graphs_of(DECODER, m, FUSED)]
    if not models:
        return []
    tokenizer = TextTokenizer(manifest.root / manifest.tokenizer.get("dir", "tokenizer"))
    ids = evaluation_ids(tokenizer, tokens, text)
    results = []
    for model in models:
        if manifest.graphs_of(DECODER, model, FUSED) and manifest.graphs_of(DECODER, model, PORTABLE):
            results.append(decoder_task(manifest, model, ids, threads))
        elif model == EAGLE and manifest.graphs_of(EAGLE_DRAFT, EAGLE, PORTABLE):
            results.append(eagle_task(manifest, ids, threads))
        else:
            raise SpecDeployError(f"task check: {model} has no float32 portable graphs to compare against")
    return results


def describe_text(tokens: int, text_file: Path | None) -> str:
    source = str(text_file) if text_file else "held-out Python standard library source (train/corpus.py)"
    return f"task check: quantized fused graphs vs the float32 portable graphs on {source}, up to {tokens} tokens"
