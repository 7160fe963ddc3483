"""The target's own responses and features: the self-distillation data for a real target.

Drafters are accepted when they guess what the target says next, so they learn from
the target's own greedy responses (what a greedy run drafts on): chat prompts
(`chat_prompts.py`, rendered with the target's chat template exactly as
`generate --chat` and the server render them) and code prompts (function openings
from the train split of the standard library, raw text as the bench's code prompts).

One batched pass yields everything the trainers need: the tokens, and at every
position the target's final hidden state (after its final norm; the Medusa/EAGLE
features, and through the tied or separate LM head the teacher's logits for a draft
model). It runs on our own runtime: the target's batched ONNX graph (the one
`specdeploy export` writes for continuous batching), built into a scratch dir, with
rows continuously batched (`generate_with_features`). On SmolLM2 and a 2-core AVX2 CPU
a row costs 3.2 ms a token at 64 rows, against 6.0 in PyTorch float32 and 17 in
PyTorch bfloat16 (which such a CPU emulates); and its greedy tokens are the export's.

Sequences of `n` tokens carry features for their first `n - 1` positions:
feature i is the target's state after token i, predicting token i + 1.

    python -m specdeploy.train.responses --target DIR --out DIR [--preset default]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see Makefile: spinning OpenMP waits fight on shared cores

import numpy as np
import onnx
import torch

from ..export.hf_loading import load_causal_lm, read_hf_config
from ..runtime.batching.graph import EXTRA_ROWS, BatchedGraph, Run
from ..runtime.batching.kv_slots import SlotKV
from ..runtime.chat_template import ChatTemplate, chat_messages
from ..runtime.errors import SpecDeployError
from ..runtime.graph_contract import TARGET, KVGeometry, ModelRecord
from . import chat_prompts, corpus
from .cli_finish import finish, say
from .distill import spec_hash, target_fingerprint, target_tokenizer

Progress = Callable[[str], None]
DATA_FORMAT = 5  # bump when the recipe changes in a way the spec hash cannot see
# freeform: chat_prompts.FREEFORM, written apart from the templates; absent without a chat template
SPLIT_FILES = {"train": "train.pt", "heldout": "heldout.pt", "freeform": "freeform.pt"}
REQUIRED_SPLITS = ("train", "heldout")
META_FILE = "responses.json"
IGNORE = -100  # a label no position is scored on (torch's cross-entropy ignore_index)


@dataclass(frozen=True)
class ResponsesSpec:
    chat_prompts: int  # train-split chat prompts
    code_prompts: int  # train-split function openings
    chat_tokens: int  # most new tokens per chat response (stops earlier at an end-of-turn token)
    code_tokens: int  # new tokens per code continuation
    heldout_chat: int
    heldout_code: int
    freeform_chat: int  # free-form held-out requests (chat_prompts.FREEFORM), chat models only
    # rows a call decodes (SmolLM2 float32 on 2 cores, the batched graph: 4.9 ms a row at 16 rows,
    # 3.2 at 64; PyTorch took 6.0 in float32 and 17 in bfloat16 on this AVX2 CPU)
    batch: int = 64
    seed: int = 0

    def config_hash(self) -> str:
        return spec_hash(self, DATA_FORMAT)


PRESETS = {
    "micro": ResponsesSpec(chat_prompts=8, code_prompts=8, chat_tokens=24, code_tokens=24, heldout_chat=4,
                           heldout_code=4, freeform_chat=2, batch=3),  # fewer slots than prompts: rows refill
    # Sized for `make export`'s 15 minutes on 2 cores: ~7.4 ms of CPU a position (SmolLM2, 64 rows),
    # so ~45k train positions take ~3 minutes. The heldout split only scores the trainers.
    "default": ResponsesSpec(chat_prompts=192, code_prompts=64, chat_tokens=160, code_tokens=128, heldout_chat=16,
                             heldout_code=8, freeform_chat=16),
    "long": ResponsesSpec(chat_prompts=1024, code_prompts=320, chat_tokens=256, code_tokens=128, heldout_chat=24,
                          heldout_code=16, freeform_chat=24),
}


# ---------------------------------------------------------------- data in memory


@dataclass
class Responses:
    """Sequences of one split: tokens [n_i], the target's features [n_i - 1, H] (bfloat16) and its
    argmax after each prompt token but the last [p_i - 1] (after the last: the first new token)."""

    tokens: list[torch.Tensor]
    features: list[torch.Tensor]
    prompt_lens: list[int]
    kinds: list[str]  # "chat" | "code"
    prompt_labels: list[torch.Tensor]

    @property
    def positions(self) -> int:
        return sum(len(f) for f in self.features)

    def save(self, path: Path) -> None:
        lengths = torch.tensor([len(t) for t in self.tokens])
        torch.save({"tokens": torch.cat(self.tokens), "features": torch.cat(self.features), "lengths": lengths,
                    "prompt_lens": torch.tensor(self.prompt_lens), "kinds": self.kinds,
                    "prompt_labels": torch.cat(self.prompt_labels)}, path)

    @classmethod
    def load(cls, path: Path) -> "Responses":
        blob = torch.load(path, weights_only=True)
        lengths = blob["lengths"].tolist()
        prompt_lens = blob["prompt_lens"].tolist()
        tokens = list(torch.split(blob["tokens"], lengths))
        features = list(torch.split(blob["features"], [n - 1 for n in lengths]))
        labels = list(torch.split(blob["prompt_labels"], [p - 1 for p in prompt_lens]))
        return cls(tokens, features, prompt_lens, list(blob["kinds"]), labels)


def next_token_labels(data: Responses) -> list[torch.Tensor]:
    """Per sequence, the target's argmax after each featured position [n_i - 1]: the next token itself
    in the response (generated greedily), the argmax recorded over the prompt (which is not its output)."""
    out = []
    for tokens, p, prompt in zip(data.tokens, data.prompt_lens, data.prompt_labels):
        labels = tokens[1:].clone()
        labels[: p - 1] = prompt
        out.append(labels)
    return out


def response_labels(data: Responses) -> list[torch.Tensor]:
    """`next_token_labels` with the prompt's positions IGNORE: what a drafter is scored on is the
    target's answer, not its argmax over a prompt (a chat template's fixed system text is learnt by heart)."""
    out = next_token_labels(data)
    for labels, p in zip(out, data.prompt_lens):
        labels[: p - 1] = IGNORE
    return out


def response_tokens(data: Responses) -> torch.Tensor:
    """Every token the target generated (prompts left out): what a drafter must propose."""
    return torch.cat([t[p:] for t, p in zip(data.tokens, data.prompt_lens)])


def windows(data: Responses, labels: list[torch.Tensor], length: int) -> tuple[torch.Tensor, ...]:
    """Fixed-length windows for trainers that batch whole sequences: tokens [N, length], features
    [N, length, H] (float32) and labels [N, length], position-aligned (feature i follows token i, label i
    is the target's token after it). Each sequence is cut from its start with stride `length`; its tail
    window is right-aligned (overlapping the one before); sequences shorter than `length` are skipped."""
    toks, feats, labs = [], [], []
    for tokens, f, lab in zip(data.tokens, data.features, labels):
        n = len(f)
        if n < length:
            continue
        starts = list(range(0, n - length + 1, length))
        if starts[-1] != n - length:
            starts.append(n - length)
        for s in starts:
            toks.append(tokens[s : s + length])
            feats.append(f[s : s + length])
            labs.append(lab[s : s + length])
    if not toks:
        raise SpecDeployError(f"no response has {length} positions: use shorter windows or longer responses")
    return torch.stack(toks), torch.stack(feats).float(), torch.stack(labs)


def load_split(data_dir: Path, split: str) -> Responses:
    path = Path(data_dir) / SPLIT_FILES[split]
    if not path.is_file():
        raise SpecDeployError(f"{data_dir} has no {SPLIT_FILES[split]}: build it with "
                              "python -m specdeploy.train.responses --target DIR --out DIR")
    return Responses.load(path)


def heldout_splits(data_dir: Path) -> dict[str, Responses]:
    """The held-out splits in `data_dir` by name: heldout (template prompts on held-out topics) and,
    where the target has a chat template, freeform (requests written apart from the templates)."""
    names = ["heldout"] + (["freeform"] if (Path(data_dir) / SPLIT_FILES["freeform"]).is_file() else [])
    return {name: load_split(data_dir, name) for name in names}


def labelled_windows(data_dir: Path, length: int):
    """The train split of the target's responses in `data_dir`, its `windows` of `length` positions
    labelled with the target's next tokens, and the held-out splits' windows by eval name
    (`heldout_responses`, `freeform_responses`; a split with no response that long is left out),
    labelled on the responses' positions only (`response_labels`)."""
    train = load_split(data_dir, "train")
    evals = {}
    for name, data in heldout_splits(data_dir).items():
        if name == "heldout" or any(len(f) >= length for f in data.features):
            evals[f"{name}_responses"] = windows(data, response_labels(data), length)
    return train, windows(train, next_token_labels(train), length), evals


def data_hash(data_dir: Path) -> str:
    """The identity of a finished data dir (its spec and target), for the trainers' caches."""
    meta = json.loads((Path(data_dir) / META_FILE).read_text())
    return f"{meta['data_hash']}-{meta['target_hash']}"


# ---------------------------------------------------------------- prompts


def prompt_ids(target_dir: Path, tok, spec: ResponsesSpec, split: str) -> list[tuple[str, list[int]]]:
    """(kind, token ids) of one split's prompts: chat through the target's template, code as raw text."""
    chat_n, code_n = {"train": (spec.chat_prompts, spec.code_prompts), "heldout": (spec.heldout_chat,
                      spec.heldout_code), "freeform": (spec.freeform_chat, 0)}[split]
    out = []
    template = ChatTemplate.from_tokenizer_dir(target_dir)
    if chat_n and template is not None:  # a base model without a template gets code prompts only
        users = (chat_prompts.freeform_prompts(chat_n) if split == "freeform"
                 else chat_prompts.chat_prompts(split, chat_n, seed=spec.seed))
        for user in users:
            # The template's own special tokens are in the text: encode them as such, add nothing.
            out.append(("chat", tok.encode(template.render(chat_messages(user)), add_special_tokens=False).ids))
    if code_n:
        for text in corpus.sampled_function_prompts(split, code_n, seed=spec.seed):
            out.append(("code", tok.encode(text, add_special_tokens=False).ids))
    return out


# ---------------------------------------------------------------- generation


@dataclass
class _Row:
    """A prompt being answered in one slot of the batch."""

    index: int  # into the prompts
    tokens: list[int]  # prompt + new tokens so far
    features: list[np.ndarray]  # [k, H] blocks: the target's state after each token but the last
    prompt_labels: np.ndarray | None = None  # its argmax after each prompt token but the last
    new: int = 0


def generate_with_features(graph: BatchedGraph, kv: SlotKV, prompts: list[list[int]], max_new: list[int],
                           stops: list[set[int]], progress: Progress) -> list[tuple[torch.Tensor, ...]]:
    """Greedy responses (prompt i + up to `max_new[i]` new tokens, cut after its first `stops[i]` token),
    their features and the argmax after each prompt token but the last, continuously batched on
    the target's batched graph (runtime/batching/graph.py): each of `kv`'s slots answers one
    prompt at a time, every decoding row one token per call, and a finished row's slot takes the
    next prompt, prefilled as a run of the next call (at most `graph.runs` a call) beside the
    rows still decoding. The batch stays full to the end of the
    queue, and every linear layer reads its weights once per call for all the rows in it.

    The graph computes each row as the batch-1 graph does: the greedy tokens are the export's own.
    """
    results: list[tuple[torch.Tensor, ...] | None] = [None] * len(prompts)
    queue = deque(sorted(range(len(prompts)), key=lambda i: -len(prompts[i])))
    rows: dict[int, _Row] = {}  # slot -> its row
    free = list(range(kv.slots))[::-1]  # low slots first: the decode part's slot range stays short
    t0, made, finished = time.perf_counter(), 0, 0
    while queue or rows:
        runs, admitted = [], []
        while queue and free and len(runs) < graph.runs:
            slot, i = free.pop(), queue.popleft()
            ids = np.asarray(prompts[i], np.int64)
            n = len(ids)
            # every prompt token scored: the trainers' labels over the prompt are the target's argmax
            runs.append(Run(ids, np.arange(n), np.tril(np.ones((n, n), bool)), 0, kv.views(slot, slot + 1)))
            admitted.append(slot)
            rows[slot] = _Row(i, list(prompts[i]), [])
        decoding = sorted(s for s in rows if s not in admitted)
        hi = decoding[-1] + 1 if decoding else 0
        # Slots in the decode range that take no part write one row where it costs least and harms
        # nothing: a slot prefilling in a run just past its prompt (its first decode step overwrites
        # it), a free slot at 0. Their attention reads that many rows (the trash row would read all).
        decode = [(rows[s].tokens[-1], len(rows[s].tokens) - 1, len(rows[s].tokens) - 1) if s in decoding
                  else len(rows[s].tokens) if s in rows else 0 for s in range(hi)]
        logits, hidden = graph.run(decode, kv.views(0, hi) if hi else None, runs)
        picks = logits.argmax(-1)  # [N]: every token of the call scored
        at = 0
        for slot in decoding + admitted:
            row = rows[slot]
            width = 1 if slot in decoding else len(row.tokens)
            row.features.append(hidden[at : at + width])
            if slot not in decoding:
                row.prompt_labels = picks[at : at + width - 1]
            pick = picks[at + width - 1]
            at += width
            row.tokens.append(int(pick))
            row.new += 1
            if row.new >= max_new[row.index] or int(pick) in stops[row.index]:
                # The last token's feature is never computed (nothing reads past it).
                results[row.index] = (torch.tensor(row.tokens),
                                      torch.from_numpy(np.concatenate(row.features)).to(torch.bfloat16),
                                      torch.from_numpy(row.prompt_labels))
                made, finished = made + len(row.tokens), finished + 1
                del rows[slot]
                free.append(slot)
                if finished % 64 == 0 or finished == len(prompts):
                    progress(f"[responses] {finished}/{len(prompts)} sequences, {made:,} tokens "
                             f"({time.perf_counter() - t0:.0f}s)")
        free.sort(reverse=True)
    return results  # type: ignore[return-value]


def build_graph(target_dir: Path, out_dir: Path, max_context: int) -> Path:
    """The target's batched graph (export/fused_graph.py, as `specdeploy export` writes it) in
    `out_dir`, positions up to `max_context`; returns its path."""
    from ..export.fused_graph import build_fused_decoder
    from ..export.onnx_writer import SharedWeights

    causal_lm = load_causal_lm(target_dir, "float32")
    model = build_fused_decoder(causal_lm, 1, max_context + EXTRA_ROWS, batched=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "target_batched.onnx"
    SharedWeights(out_dir, "target_batched.weights").externalize(model, path)
    onnx.save(model, str(path))
    return path


# ---------------------------------------------------------------- build


def eos_token_ids(target_dir: Path, cfg: dict) -> set[int]:
    """Tokens that end a response: config.json's and generation_config.json's eos ids."""
    ids = set()
    for source in (cfg, _json_or_empty(Path(target_dir) / "generation_config.json")):
        value = source.get("eos_token_id")
        ids.update(value if isinstance(value, list) else [value] if value is not None else [])
    return ids


def _json_or_empty(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def build_responses(target_dir: Path, out_dir: Path, spec: ResponsesSpec, progress: Progress = print,
                    threads: int = 2) -> dict:
    """Generate (or reuse) both splits' responses for the target in `target_dir`; returns responses.json."""
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    target_hash = target_fingerprint(target_dir)
    meta_path = out_dir / META_FILE
    if meta_path.is_file() and all((out_dir / SPLIT_FILES[f]).is_file() for f in REQUIRED_SPLITS):
        meta = json.loads(meta_path.read_text())
        if meta.get("data_hash") == spec.config_hash() and meta.get("target_hash") == target_hash:
            progress(f"[responses] reusing {out_dir} ({meta['train']['positions']:,} train positions)")
            return meta
    t0 = time.perf_counter()
    cfg = read_hf_config(target_dir)
    tok = target_tokenizer(target_dir)
    eos = eos_token_ids(target_dir, cfg)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    splits = {split: prompt_ids(target_dir, tok, spec, split) for split in ("heldout", "freeform", "train")}
    splits = {split: prompts for split, prompts in splits.items() if prompts}  # freeform: chat models only
    longest = max(len(ids) for prompts in splits.values() for _, ids in prompts)
    graph_path = build_graph(target_dir, tmp / "graph", longest + max(spec.chat_tokens, spec.code_tokens))
    progress(f"[responses] batched target graph built ({time.perf_counter() - t0:.0f}s)")
    graph = BatchedGraph(graph_path, threads)
    record = ModelRecord.from_geometry(TARGET, KVGeometry.from_config(cfg), int(cfg["hidden_size"]),
                                       int(cfg["vocab_size"]))
    kv = SlotKV(record, spec.batch, longest + max(spec.chat_tokens, spec.code_tokens))
    meta = {"data_hash": spec.config_hash(), "target_hash": target_hash, "spec": asdict(spec)}
    # Both splits' prompts in one pass: the batch stays full until the last few rows of all of them.
    prompts = [(split, kind, ids) for split, of_split in splits.items() for kind, ids in of_split]
    limits = {"chat": (spec.chat_tokens, eos), "code": (spec.code_tokens, set())}  # code runs past EOS
    made = generate_with_features(graph, kv, [ids for _, _, ids in prompts], [limits[k][0] for _, k, _ in prompts],
                                  [limits[k][1] for _, k, _ in prompts], progress)
    for split in splits:
        seqs = [(kind, len(ids), *outputs) for (where, kind, ids), outputs in zip(prompts, made) if where == split]
        data = Responses([s[2] for s in seqs], [s[3] for s in seqs], [s[1] for s in seqs], [s[0] for s in seqs],
                         [s[4] for s in seqs])
        data.save(tmp / SPLIT_FILES[split])
        meta[split] = {"sequences": len(seqs), "positions": data.positions,
                       "response_tokens": sum(len(t) - p for t, p in zip(data.tokens, data.prompt_lens)),
                       "by_kind": {k: sum(1 for s in seqs if s[0] == k) for k in ("chat", "code")}}
        progress(f"[responses] {split}: {len(seqs)} sequences, {data.positions:,} positions "
                 f"({time.perf_counter() - t0:.0f}s)")
    shutil.rmtree(graph_path.parent)  # scratch (the target's weights again): the data is what is kept
    meta["seconds"] = round(time.perf_counter() - t0, 1)
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)  # swapped in whole: an interrupted run never looks finished
    return meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="The target's greedy responses to train/held-out prompts, with features.")
    p.add_argument("--target", type=Path, required=True, help="HF model directory of the target")
    p.add_argument("--out", type=Path, required=True, help="output directory (cached by spec and target)")
    p.add_argument("--preset", default="default", choices=sorted(PRESETS))
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    return finish(lambda: build_responses(args.target, args.out, PRESETS[args.preset], say, args.threads),
                  "train", "heldout", "freeform")


if __name__ == "__main__":
    sys.exit(main())
