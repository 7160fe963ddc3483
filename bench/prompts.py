"""The benchmark prompt sets, shipped as JSONL so every machine measures the same text.

They are cut once from train/corpus.py (held-out stdlib functions) and committed:
the stdlib differs between Python versions, the committed files do not.

    python -m specdeploy.bench.prompts      # regenerate bench/prompts/*.jsonl
"""

from __future__ import annotations

import json
from pathlib import Path

from ..runtime.errors import SpecDeployError

PROMPT_DIR = Path(__file__).resolve().parent / "prompts"
SETS = ("code", "grounded")  # held-out code continuation; input-grounded (answer mostly in the prompt)
PER_SET = 16


def load_prompts(path: str | Path) -> list[str]:
    """Prompts of one JSONL file: one {"prompt": "..."} object (or JSON string) per line."""
    path = Path(path)
    if not path.is_file():
        raise SpecDeployError(f"prompt file not found: {path}")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SpecDeployError(f"{path}:{n}: not JSON ({exc.msg})") from None
        text = item.get("prompt") if isinstance(item, dict) else item
        if not isinstance(text, str) or not text:
            raise SpecDeployError(f"{path}:{n}: expected a non-empty string or {{\"prompt\": str}}")
        out.append(text)
    if not out:
        raise SpecDeployError(f"prompt file {path} has no prompts")
    return out


def shipped_sets() -> dict[str, Path]:
    return {name: PROMPT_DIR / f"{name}.jsonl" for name in SETS}


def regenerate(per_set: int = PER_SET) -> None:
    from ..train import corpus  # only here: the corpus walks the stdlib

    texts = {"code": corpus.heldout_prompts(per_set), "grounded": corpus.grounded_prompts(per_set)}
    for name, prompts in texts.items():
        lines = [json.dumps({"prompt": p}, ensure_ascii=False) for p in prompts]
        (PROMPT_DIR / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        print(f"{name}: {len(prompts)} prompts -> {PROMPT_DIR / f'{name}.jsonl'}")


if __name__ == "__main__":
    regenerate()
