"""The target's own responses and features: the self-distillation data for a real target.

Drafters are accepted when they guess what the target says next, so they learn from
the target's own greedy responses (what a greedy run drafts on): chat prompts
(`chat_prompts.py`, rendered with the target's chat template exactly as
`generate --chat` and the server render them) and code prompts (function openings
from the train split of the standard library, raw text as the bench's code prompts).

One batched pass yields everything the trainers need: the tokens, and at every
position the target's final hidden state (after its final norm; the Medusa/EAGLE
features, and through the tied or separate LM head the teacher's logits for a draft
model). Generation keeps the KV cache, feeds one token per row per step, and drops
finished rows from the batch, so a step costs what the live rows cost.

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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see Makefile: spinning OpenMP waits fight on shared cores

import torch
import torch.nn.functional as F

from ..export.hf_loading import load_causal_lm, read_hf_config
from ..runtime.chat_template import ChatTemplate, chat_messages
from ..runtime.errors import SpecDeployError
from . import chat_prompts, corpus
from .cli_finish import finish, say
from .distill import spec_hash, target_fingerprint, target_tokenizer

Progress = Callable[[str], None]
DATA_FORMAT = 1  # bump when the recipe changes in a way the spec hash cannot see
SPLIT_FILES = {"train": "train.pt", "heldout": "heldout.pt"}
META_FILE = "responses.json"


@dataclass(frozen=True)
class ResponsesSpec:
    chat_prompts: int  # train-split chat prompts
    code_prompts: int  # train-split function openings
    chat_tokens: int  # most new tokens per chat response (stops earlier at an end-of-turn token)
    code_tokens: int  # new tokens per code continuation
    heldout_chat: int
    heldout_code: int
    # rows per decode step (measured, bf16 on 2 cores: 5.4 ms CPU per token at 16 rows, 3.4 at 64 and 128)
    batch: int = 64
    bf16: bool = True  # bf16 body, float32 LM head (argmax over bf16 logits would tie often)
    seed: int = 0

    def config_hash(self) -> str:
        return spec_hash(self, DATA_FORMAT)


PRESETS = {
    "micro": ResponsesSpec(chat_prompts=8, code_prompts=8, chat_tokens=24, code_tokens=24, heldout_chat=4,
                           heldout_code=4, batch=8),
    "default": ResponsesSpec(chat_prompts=320, code_prompts=96, chat_tokens=192, code_tokens=128, heldout_chat=24,
                             heldout_code=16),
    "long": ResponsesSpec(chat_prompts=1024, code_prompts=320, chat_tokens=256, code_tokens=128, heldout_chat=24,
                          heldout_code=16),
}


# ---------------------------------------------------------------- data in memory


@dataclass
class Responses:
    """Sequences of one split: tokens [n_i] and the target's features [n_i - 1, H] (bfloat16)."""

    tokens: list[torch.Tensor]
    features: list[torch.Tensor]
    prompt_lens: list[int]
    kinds: list[str]  # "chat" | "code"

    @property
    def positions(self) -> int:
        return sum(len(f) for f in self.features)

    def save(self, path: Path) -> None:
        lengths = torch.tensor([len(t) for t in self.tokens])
        torch.save({"tokens": torch.cat(self.tokens), "features": torch.cat(self.features), "lengths": lengths,
                    "prompt_lens": torch.tensor(self.prompt_lens), "kinds": self.kinds}, path)

    @classmethod
    def load(cls, path: Path) -> "Responses":
        blob = torch.load(path, weights_only=True)
        lengths = blob["lengths"].tolist()
        tokens = list(torch.split(blob["tokens"], lengths))
        features = list(torch.split(blob["features"], [n - 1 for n in lengths]))
        return cls(tokens, features, blob["prompt_lens"].tolist(), list(blob["kinds"]))


@torch.no_grad()
def next_token_labels(data: Responses, lm_head_weight: torch.Tensor) -> list[torch.Tensor]:
    """Per sequence, the target's argmax after each featured position [n_i - 1]: the next token itself
    in the response (generated greedily), the LM head's argmax over the prompt (which is not its output)."""
    out = []
    for tokens, feats, p in zip(data.tokens, data.features, data.prompt_lens):
        labels = tokens[1:].clone()
        if p > 1:
            labels[: p - 1] = F.linear(feats[: p - 1].float(), lm_head_weight.float()).argmax(-1)
        out.append(labels)
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


def labelled_windows(data_dir: Path, lm_head_weight: torch.Tensor, length: int):
    """The train split of the target's responses in `data_dir`, then the train and the held-out
    split's `windows` of `length` positions, labelled with the target's next tokens."""
    split = {name: load_split(data_dir, name) for name in ("train", "heldout")}
    train, heldout = (windows(split[name], next_token_labels(split[name], lm_head_weight), length)
                      for name in ("train", "heldout"))
    return split["train"], train, heldout


def data_hash(data_dir: Path) -> str:
    """The identity of a finished data dir (its spec and target), for the trainers' caches."""
    meta = json.loads((Path(data_dir) / META_FILE).read_text())
    return f"{meta['data_hash']}-{meta['target_hash']}"


# ---------------------------------------------------------------- prompts


def prompt_ids(target_dir: Path, tok, spec: ResponsesSpec, split: str) -> list[tuple[str, list[int]]]:
    """(kind, token ids) of one split's prompts: chat through the target's template, code as raw text."""
    chat_n, code_n = ((spec.chat_prompts, spec.code_prompts) if split == "train"
                      else (spec.heldout_chat, spec.heldout_code))
    out = []
    template = ChatTemplate.from_tokenizer_dir(target_dir)
    if chat_n and template is not None:  # a base model without a template gets code prompts only
        for user in chat_prompts.chat_prompts(split, chat_n, seed=spec.seed):
            # The template's own special tokens are in the text: encode them as such, add nothing.
            out.append(("chat", tok.encode(template.render(chat_messages(user)), add_special_tokens=False).ids))
    if code_n:
        for text in corpus.function_prompts(split, code_n, seed=spec.seed):
            out.append(("code", tok.encode(text, add_special_tokens=False).ids))
    return out


# ---------------------------------------------------------------- generation


class GreedyHead:
    """The target's argmax over its LM head, as float32 would pick it, at bf16 cost.

    Logits rounded to bf16 (8 mantissa bits) tie often, and a float32 LM head over
    49k tokens costs a third of a decode step; so bf16 logits shortlist `shortlist`
    tokens and float32 dot products pick among them.
    """

    def __init__(self, lm_head: torch.nn.Linear, shortlist: int = 8):
        self.weight = lm_head.weight.detach().float().clone()
        self.weight_bf16 = self.weight.to(torch.bfloat16)
        self.shortlist = shortlist

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, H] -> [B] token ids."""
        cand = (hidden.to(torch.bfloat16) @ self.weight_bf16.T).topk(self.shortlist, -1).indices
        exact = torch.einsum("bh,bkh->bk", hidden.float(), self.weight[cand])
        return cand.gather(-1, exact.argmax(-1, keepdim=True)).squeeze(-1)


@torch.no_grad()
def generate_with_features(body, head: GreedyHead, prompts: list[list[int]], max_new: int, eos_ids: set[int],
                           batch: int, progress: Progress) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Greedy responses (prompt + new tokens, cut after the first `eos_ids` token) and their features.

    `body` is the target's decoder stack (`model.model`, in the dtype to run it in), `head` its LM head.
    """
    from transformers import DynamicCache

    eos = torch.tensor(sorted(eos_ids)) if eos_ids else torch.tensor([], dtype=torch.int64)
    results: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths pad little
    t0 = time.perf_counter()
    for first in range(0, len(order), batch):
        rows = order[first : first + batch]
        width = max(len(prompts[r]) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.int64)
        mask = torch.zeros(len(rows), width, dtype=torch.int64)
        for j, r in enumerate(rows):  # left padding: every row's next token lands in the last column
            ids[j, width - len(prompts[r]) :] = torch.tensor(prompts[r])
            mask[j, width - len(prompts[r]) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        hidden = body(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                      use_cache=True).last_hidden_state.float()
        feats = {r: [hidden[j, width - len(prompts[r]) :]] for j, r in enumerate(rows)}
        new = {r: [] for r in rows}
        live = torch.arange(len(rows))  # current batch row -> index into rows
        last_pos = positions[:, -1:]
        for step in range(max_new):
            nxt = head(hidden[:, -1])
            for j, r in enumerate(live.tolist()):
                new[rows[r]].append(int(nxt[j]))
            done = torch.isin(nxt, eos) if step + 1 < max_new else torch.ones_like(nxt, dtype=torch.bool)
            if done.all():
                break
            if done.any():  # drop finished rows: later steps cost what the live rows cost
                keep = (~done).nonzero().flatten()
                cache.batch_select_indices(keep)
                live, nxt, mask, last_pos = live[keep], nxt[keep], mask[keep], last_pos[keep]
            mask = torch.cat([mask, torch.ones(len(live), 1, dtype=mask.dtype)], 1)
            last_pos = last_pos + 1
            hidden = body(input_ids=nxt[:, None], attention_mask=mask, position_ids=last_pos,
                          past_key_values=cache, use_cache=True).last_hidden_state.float()
            for j, r in enumerate(live.tolist()):
                feats[rows[r]].append(hidden[j])
        for r in rows:
            tokens = torch.tensor(prompts[r] + new[r])
            # Feature of the last token is never computed (nothing reads past it).
            results[r] = (tokens, torch.cat([f.reshape(-1, f.shape[-1]) for f in feats[r]]).to(torch.bfloat16))
        done_n = min(first + batch, len(order))
        made = sum(len(results[r][0]) for r in order[:done_n])
        progress(f"[responses] {done_n}/{len(prompts)} sequences, {made:,} tokens "
                 f"({time.perf_counter() - t0:.0f}s)")
    return results


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


def build_responses(target_dir: Path, out_dir: Path, spec: ResponsesSpec, progress: Progress = print) -> dict:
    """Generate (or reuse) both splits' responses for the target in `target_dir`; returns responses.json."""
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    target_hash = target_fingerprint(target_dir)
    meta_path = out_dir / META_FILE
    if meta_path.is_file() and all((out_dir / f).is_file() for f in SPLIT_FILES.values()):
        meta = json.loads(meta_path.read_text())
        if meta.get("data_hash") == spec.config_hash() and meta.get("target_hash") == target_hash:
            progress(f"[responses] reusing {out_dir} ({meta['train']['positions']:,} train positions)")
            return meta
    t0 = time.perf_counter()
    torch.manual_seed(spec.seed)
    cfg = read_hf_config(target_dir)
    tok = target_tokenizer(target_dir)
    target = load_causal_lm(target_dir, "float32")
    head = GreedyHead(target.lm_head)
    body = target.model.to(torch.bfloat16) if spec.bf16 else target.model
    eos = eos_token_ids(target_dir, cfg)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    meta = {"data_hash": spec.config_hash(), "target_hash": target_hash, "spec": asdict(spec)}
    for split in ("heldout", "train"):
        prompts = prompt_ids(target_dir, tok, spec, split)
        seqs = []
        for kind, max_new in (("chat", spec.chat_tokens), ("code", spec.code_tokens)):
            mine = [ids for k, ids in prompts if k == kind]
            if not mine:
                continue
            made = generate_with_features(body, head, mine, max_new, eos if kind == "chat" else set(), spec.batch,
                                          progress)
            seqs += [(kind, len(ids), t, f) for ids, (t, f) in zip(mine, made)]
        data = Responses([s[2] for s in seqs], [s[3] for s in seqs], [s[1] for s in seqs], [s[0] for s in seqs])
        data.save(tmp / SPLIT_FILES[split])
        meta[split] = {"sequences": len(seqs), "positions": data.positions,
                       "response_tokens": sum(len(t) - p for t, p in zip(data.tokens, data.prompt_lens)),
                       "by_kind": {k: sum(1 for s in seqs if s[0] == k) for k in ("chat", "code")}}
        progress(f"[responses] {split}: {len(seqs)} sequences, {data.positions:,} positions "
                 f"({time.perf_counter() - t0:.0f}s)")
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
    return finish(lambda: build_responses(args.target, args.out, PRESETS[args.preset], say), "train", "heldout")


if __name__ == "__main__":
    sys.exit(main())
