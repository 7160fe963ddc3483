"""The benchmark prompt sets, shipped as JSONL so every machine measures the same text.

One prompt per line, in one of two forms:
- `{"prompt": "..."}` (or a bare JSON string): raw text, tokenized as is;
- `{"chat": "...", "system": "..."}` (system optional): one user turn, rendered through the
  model's own chat template (runtime/chat_template.py, the renderer `generate --chat` and the
  server use) with the assistant's turn opened.

Shipped sets (written once, never tuned on: no method's settings were chosen by them):
- `chat`: held-out everyday questions (chat template);
- `code`: the first lines of held-out Python standard library functions, to continue (raw);
- `grounded`: input-grounded requests, the answer mostly in the prompt: summarize, correct or
  restructure a given text, or edit / explain a given function (chat template);
- `grounded-raw`: the toy family's grounded set, which has no chat template: repeat a given
  function with a variable renamed (raw; cut from train/corpus.py);
- `repeated`: a repeated-task workload, the same kind of request many times with other data,
  as agents send (extract fields from a record as JSON; chat template); `repeated-raw`, the toy
  family's: the same kind of small function many times (raw, hand-written).
A model with a chat template gets chat, code, grounded and repeated; one without gets code,
grounded-raw and repeated-raw (shown as `grounded`, `repeated`).

A set named `repeated...` (a --prompts file's stem too) is a warm-cache set: the bench keeps
suffix decoding's cross-request cache across its prompts (each pass over the set starts empty),
the workload that cache is for; every other set runs each prompt with an empty cache.

    python -m specdeploy.bench.prompts      # regenerate the raw sets from train/corpus.py
"""

from __future__ import annotations

import json
from pathlib import Path

from ..runtime.errors import SpecDeployError
from ..runtime.manifest import parse_json

PROMPT_DIR = Path(__file__).resolve().parent / "prompts"
CHAT_SETS = ("chat", "code", "grounded", "repeated")  # models with a chat template (the real default model)
RAW_SETS = ("code", "grounded-raw", "repeated-raw")  # models without one (the toy family)
PER_SET = 16


def warm_cache(set_name: str) -> bool:
    """A repeated-task set: its prompts may be drafted from the set's earlier outputs."""
    return set_name.startswith("repeated")


def load_items(path: str | Path) -> list[dict]:
    """Prompts of one JSONL file as dicts: {"prompt": str} or {"chat": str, "system": str | None}."""
    path = Path(path)
    if not path.is_file():
        raise SpecDeployError(f"prompt file not found: {path}")
    out = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecDeployError(f"cannot read prompt file {path}: {exc}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = parse_json(line)
        except ValueError as exc:
            raise SpecDeployError(f"{path}:{n}: not JSON ({exc})") from None
        if isinstance(item, str):
            item = {"prompt": item}
        if not isinstance(item, dict):
            raise SpecDeployError(f"{path}:{n}: expected a string, {{\"prompt\": str}} or {{\"chat\": str}}")
        if isinstance(item.get("chat"), str) and item["chat"]:
            system = item.get("system")
            if system is not None and not isinstance(system, str):
                raise SpecDeployError(f"{path}:{n}: \"system\" must be a string")
            out.append({"chat": item["chat"], "system": system})
        elif isinstance(item.get("prompt"), str) and item["prompt"]:
            out.append({"prompt": item["prompt"]})
        else:
            raise SpecDeployError(f"{path}:{n}: expected a non-empty string, {{\"prompt\": str}} or {{\"chat\": str}}")
    if not out:
        raise SpecDeployError(f"prompt file {path} has no prompts")
    return out


def uses_chat(items: list[dict]) -> bool:
    return any("chat" in item for item in items)


def encode_items(items: list[dict], export) -> list[list[int]]:
    """Token ids of each prompt, by the export's tokenizer (and its chat template for chat items)."""
    template = None
    if uses_chat(items):
        from ..runtime.chat_template import ChatTemplate

        template = ChatTemplate.from_tokenizer_dir(export.tokenizer.directory)
        if template is None:
            raise SpecDeployError("chat prompts need a chat template; this export's tokenizer has none")
    out = []
    for item in items:
        if "chat" in item:
            from ..runtime.chat_template import chat_messages, encode_rendered

            out.append(encode_rendered(export.tokenizer, template.render(chat_messages(item["chat"], item["system"]))))
        else:
            out.append(export.tokenizer.encode(item["prompt"]))
    return out


def has_chat_template(export) -> bool:
    from ..runtime.chat_template import ChatTemplate

    return ChatTemplate.from_tokenizer_dir(export.tokenizer.directory) is not None


def shipped_sets(chat: bool = True) -> dict[str, Path]:
    """Set name -> file: chat, code, grounded, repeated for a chat model; code, grounded and repeated
    (raw) otherwise."""
    names = CHAT_SETS if chat else RAW_SETS
    return {name.removesuffix("-raw"): PROMPT_DIR / f"{name}.jsonl" for name in names}


def regenerate(per_set: int = PER_SET) -> None:
    """Rewrite the raw sets (code, grounded-raw) from train/corpus.py; chat, grounded and the
    repeated sets are hand-written."""
    from ..train import corpus  # only here: the corpus walks the stdlib

    texts = {"code": corpus.heldout_prompts(per_set), "grounded-raw": corpus.grounded_prompts(per_set)}
    for name, prompts in texts.items():
        lines = [json.dumps({"prompt": p}, ensure_ascii=False) for p in prompts]
        (PROMPT_DIR / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        print(f"{name}: {len(prompts)} prompts -> {PROMPT_DIR / f'{name}.jsonl'}")


if __name__ == "__main__":
    regenerate()
