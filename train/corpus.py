"""The embedded family's corpus: this interpreter's standard-library sources.

It is on every machine that runs Python, needs no download, and is real code, so
a model trained on it learns something measurable. Files are split train /
held-out by a stable hash of their path relative to the stdlib root, so the split
is the same on every run and every machine with the same Python version, and the
held-out files (benchmark prompts, held-out loss) are never trained on.
"""

from __future__ import annotations

import ast
import hashlib
import random
import sysconfig
import textwrap
from functools import lru_cache
from pathlib import Path
from typing import Iterator

SPLITS = ("train", "heldout")
HELDOUT_PER_MILLE = 50  # ~5% of files
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relpath: str) -> str:
    """'train' or 'heldout' for a posix path relative to the stdlib root."""
    # sha256, not hash(): Python's str hash is salted per process.
    bucket = int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest()[:4], "big") % 1000
    return "heldout" if bucket < HELDOUT_PER_MILLE else "train"


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown corpus split {split!r}; expected one of {SPLITS}")


@lru_cache(maxsize=None)
def _all_files() -> tuple[tuple[str, Path], ...]:
    root = stdlib_root()
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _SKIP_DIRS.intersection(rel.parts) or not path.is_file():
            continue
        out.append((rel.as_posix(), path))
    out.sort()
    return tuple(out)


def stdlib_files(split: str) -> list[Path]:
    """The stdlib `.py` files of one split, sorted by relative path."""
    _check_split(split)
    return [path for rel, path in _all_files() if split_of(rel) == split]


def read_text(path: Path) -> str | None:
    """A source file's text, or None when it is not UTF-8 (a few test fixtures on purpose)."""
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def iter_texts(split: str, shuffle_seed: int | None = None) -> Iterator[str]:
    """The non-empty texts of one split's files.

    In `stdlib_files` order, or shuffled deterministically when `shuffle_seed` is
    given, so that a reader that stops early sees a sample of the whole library
    rather than its alphabetical head (asyncio/, collections/, ...).
    """
    paths = stdlib_files(split)
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(paths)
    for path in paths:
        text = read_text(path)
        if text and text.strip():
            yield text


def _functions(text: str) -> list[ast.AST]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):  # py2 fixtures, null bytes, ...
        return []
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef)
    return [node for node in ast.walk(tree) if isinstance(node, kinds)]


@lru_cache(maxsize=None)
def _functions_of(split: str) -> tuple[tuple[str, str], ...]:
    """(relative path, dedented source) of every function in one split's files."""
    root = stdlib_root()
    out = []
    for path in stdlib_files(split):
        text = read_text(path)
        if not text:
            continue
        lines = text.splitlines(keepends=True)
        for node in _functions(text):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            source = textwrap.dedent("".join(lines[start:node.end_lineno]))
            if source.strip():
                out.append((path.relative_to(root).as_posix(), source))
    return tuple(out)


def _prefix_in_range(source: str, min_chars: int, max_chars: int) -> str | None:
    """The shortest whole-line prefix of `source` with min_chars..max_chars chars."""
    prefix = ""
    for line in source.splitlines(keepends=True):
        prefix += line
        if len(prefix) > max_chars:
            return None
        if len(prefix) >= min_chars:
            return prefix
    return None


def heldout_prompts(n: int, min_chars: int = 80, max_chars: int = 400, seed: int = 0) -> list[str]:
    """`n` code prompts: the first whole lines of functions from held-out files.

    Each prompt ends with a newline, so the model continues the function body.
    Deterministic for a given seed; raises ValueError if fewer than `n` exist.
    """
    return function_prompts("heldout", n, min_chars, max_chars, seed)


def function_prompts(split: str, n: int, min_chars: int = 80, max_chars: int = 400, seed: int = 0) -> list[str]:
    """`n` code prompts shaped like `heldout_prompts`, from one split's functions."""
    _check_split(split)
    if not 0 < min_chars <= max_chars:
        raise ValueError(f"need 0 < min_chars <= max_chars, got {min_chars}, {max_chars}")
    candidates = []
    for _, source in _functions_of(split):
        prefix = _prefix_in_range(source, min_chars, max_chars)
        # A prompt that is the whole function leaves nothing to continue.
        if prefix is not None and len(prefix) < len(source.rstrip()):
            candidates.append(prefix)
    return _sample(candidates, n, seed, f"function_prompts({split!r})")


def sampled_function_prompts(split: str, n: int, seed: int = 0, per_file: int = 2, min_chars: int = 80,
                             max_chars: int = 400) -> list[str]:
    """`n` prompts shaped like `function_prompts`, at most `per_file` from each file, from files in
    a seeded random order: only as many files are parsed as the prompts need (parsing every file of
    the train split took ~25 s, a tenth of `make export`'s data step)."""
    _check_split(split)
    paths = stdlib_files(split)
    random.Random(seed).shuffle(paths)
    out: list[str] = []
    for path in paths:
        text = read_text(path)
        if not text:
            continue
        lines = text.splitlines(keepends=True)
        found = []
        for node in _functions(text):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            source = textwrap.dedent("".join(lines[start:node.end_lineno]))
            prefix = _prefix_in_range(source, min_chars, max_chars)
            if prefix is not None and len(prefix) < len(source.rstrip()) and prefix not in found:
                found.append(prefix)
        out += random.Random(f"{seed}:{path.name}").sample(found, min(per_file, len(found)))
        if len(out) >= n:
            return out[:n]
    raise ValueError(f"sampled_function_prompts({split!r}): asked for {n} prompts, only {len(out)} found")


GROUNDED_HEADER = "# Original:\n"
GROUNDED_FOOTER = "# Same function, with the first variable renamed:\n"


def grounded_prompts(n: int, min_chars: int = 120, max_chars: int = 600, seed: int = 0) -> list[str]:
    """`n` prompts whose answer is mostly in the prompt (a whole held-out function to repeat).

    Shape: ``"# Original:\\n<function>\\n# Same function, with the first variable renamed:\\n"``.
    Copy-heavy continuations like these are where prompt-lookup / n-gram drafters shine.
    """
    candidates = [
        f"{GROUNDED_HEADER}{source.rstrip()}\n{GROUNDED_FOOTER}"
        for _, source in _functions_of("heldout")
        if min_chars <= len(source) <= max_chars
    ]
    return _sample(candidates, n, seed, "grounded_prompts")


def _sample(candidates: list[str], n: int, seed: int, what: str) -> list[str]:
    unique = sorted(set(candidates))
    if n > len(unique):
        raise ValueError(f"{what}: asked for {n} prompts, only {len(unique)} candidates fit")
    return random.Random(seed).sample(unique, n)
