"""Peer systems' artifacts: the onnxruntime-genai venv and models, the optimum export
(llama.cpp's venv and GGUF files: bench/llamacpp.py).

onnxruntime-genai's model builder needs transformers >= 5, which our export side
cannot take, so it gets its own venv (build/peers/ortgenai-venv) and its runner is a
subprocess there. Models are cached under build/peers/ by a hash of the HF dir's
config and weights, so a retrained family is rebuilt and an unchanged one is not.

    python -m specdeploy.bench.peers --export OUT               # what `make peers` runs
    python -m specdeploy.bench.peers --target DIR [--draft DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..export.hf_loading import is_self_draft
from ..runtime.errors import SpecDeployError

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PEERS_DIR = REPO_ROOT / "build" / "peers"
GENAI_VENV = "ortgenai-venv"
# torch pinned to the CPU build this machine already has: a bare `torch` would pull
# several GB of CUDA wheels into a venv that only runs the model builder.
GENAI_REQUIREMENTS = ["torch==2.13.0", "transformers>=5", "onnxruntime-genai>=0.11", "onnx", "onnx_ir"]
RUNNER = Path(__file__).resolve().parent / "ortgenai_runner.py"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


class PeerUnavailable(SpecDeployError):
    """A peer that cannot run here; its message is the reason shown in the report."""


def model_key(hf_dir: str | Path) -> str:
    """Content hash of an HF model dir (config + weights), 12 hex digits."""
    hf_dir = Path(hf_dir)
    weights = sorted(hf_dir.glob("*.safetensors")) or sorted(hf_dir.glob("*.bin"))
    if not (hf_dir / "config.json").is_file() or not weights:
        raise PeerUnavailable(f"{hf_dir} is not a Hugging Face model dir (config.json + weights)")
    h = hashlib.sha256((hf_dir / "config.json").read_bytes())
    for path in weights:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:12]


def _atomic_build(final: Path, build) -> Path:
    """Run build(tmp_dir) and move the result into place, so a half-built dir is never reused."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=final.parent))
    try:
        build(tmp)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# ----------------------------------------------------------------- optimum


def optimum_model_dir(target: str | Path, peers_dir: str | Path, build: bool = False) -> Path:
    """optimum's own ONNX export of the target (text-generation-with-past), cached."""
    final = Path(peers_dir) / "optimum" / model_key(target)
    if final.is_dir() or not build:
        return final

    def export(tmp: Path) -> None:
        from optimum.exporters.onnx import main_export

        main_export(str(target), output=str(tmp), task="text-generation-with-past", device="cpu",
                    do_validation=False)

    return _atomic_build(final, export)


# ----------------------------------------------------------------- onnxruntime-genai


def genai_python(peers_dir: str | Path) -> Path:
    return Path(peers_dir) / GENAI_VENV / "bin" / "python"


def genai_env() -> dict:
    """The peer venv's environment: ours minus anything that would leak our venv into it."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(OFFLINE_ENV)
    return env


def ensure_genai_venv(peers_dir: str | Path, progress=print) -> Path:
    py = genai_python(peers_dir)
    if py.exists() and _genai_version(py):
        return py
    venv = py.parent.parent
    progress(f"creating {venv} ({' '.join(GENAI_REQUIREMENTS)})")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", *GENAI_REQUIREMENTS], check=True, env=genai_env())
    if not _genai_version(py):
        raise PeerUnavailable(f"onnxruntime-genai did not import in {venv}")
    return py


def _genai_version(py: Path) -> str | None:
    proc = subprocess.run([str(py), "-c", "import onnxruntime_genai as og; print(og.__version__)"],
                          capture_output=True, text=True, env=genai_env())
    return proc.stdout.strip() if proc.returncode == 0 else None


def _build_genai(py: Path, hf_dir: Path, out: Path, log: Path, precision: str = "fp32") -> None:
    """genai's model builder for the CPU: `fp32`, or `int4` with its CPU defaults (MatMulNBits,
    block 32, symmetric, accuracy level 4: int8 activations), as a user of genai gets it."""
    cmd = [str(py), "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out),
           "-p", precision, "-e", "cpu", "-c", str(out.parent / "hf-cache")]
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=genai_env())
    if proc.returncode != 0 or not (out / "genai_config.json").is_file():
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise PeerUnavailable(f"onnxruntime-genai model builder failed on {hf_dir} ({tail[0][:200]}); log: {log}")


def genai_model_dirs(target: str | Path, draft: str | Path | None, peers_dir: str | Path,
                     build: bool = True, progress=print, int4: bool = False) -> dict[str, Path]:
    """{"plain": dir, "speculative": dir (target + draft), "int4": dir (`int4`: the target's int4
    build)} for onnxruntime-genai, built on first use. A self-draft drafts with the int4 build, never
    with a float copy that costs what the target does."""
    py = genai_python(peers_dir)
    if not py.exists():
        raise PeerUnavailable(f"no onnxruntime-genai venv at {py.parent.parent}: run `make peers`")
    root = Path(peers_dir) / "ortgenai"
    tkey = model_key(target)
    out = {"plain": root / tkey / "target"}
    if is_self_draft(target, draft):
        int4, draft = True, None
        out["draft"] = root / tkey / "target-int4"
        out["speculative"] = root / tkey / "spec-self-int4"
    elif draft is not None:
        dkey = model_key(draft)
        out["draft"] = root / tkey / f"draft-{dkey}"
        out["speculative"] = root / tkey / f"spec-{dkey}"
    if int4:
        out["int4"] = root / tkey / "target-int4"
    if not build:
        return out
    for name, src in (("plain", target), ("draft", draft)):
        if src is None:
            continue
        if name in out and not out[name].is_dir():
            progress(f"onnxruntime-genai model builder: {src} -> {out[name]}")
            log = out[name].parent / f"{out[name].name}.build.log"
            _atomic_build(out[name], lambda tmp, src=src, log=log: _build_genai(py, Path(src), tmp, log))
    if "int4" in out and not out["int4"].is_dir():
        progress(f"onnxruntime-genai model builder (int4): {target} -> {out['int4']}")
        log = out["int4"].parent / "target-int4.build.log"
        _atomic_build(out["int4"], lambda tmp: _build_genai(py, Path(target), tmp, log, "int4"))
    if "speculative" in out:
        _atomic_build(out["speculative"], lambda tmp: _compose_speculative(out["plain"], out["draft"], tmp))
    return out


def _compose_speculative(plain: Path, draft: Path, out: Path) -> None:
    """genai's speculative config: the target's config plus a `model.draft` decoder block.

    genai rejects `..` in config paths, so the folder holds links to the target's files
    and a `draft/` link to the draft's build.
    """
    config = json.loads((plain / "genai_config.json").read_text())
    draft_cfg = json.loads((draft / "genai_config.json").read_text())
    # plain, draft and out are siblings (out is built under a temporary sibling name)
    for item in plain.iterdir():
        if item.name != "genai_config.json":
            (out / item.name).symlink_to(Path("..", plain.name, item.name))
    (out / "draft").symlink_to(Path("..", draft.name))
    block = dict(draft_cfg["model"]["decoder"])
    block["filename"] = f"draft/{block['filename']}"
    config["model"]["draft"] = block
    config["speculative"] = {"max_draft_tokens": 4}  # the runner sets k per run
    (out / "genai_config.json").write_text(json.dumps(config, indent=2))


# ----------------------------------------------------------------- make peers


def _export_sources(export_dir: Path) -> tuple[Path, Path | None, str]:
    """(target HF dir, draft HF dir or None, dtype) named by an export's manifest."""
    try:
        manifest = json.loads((Path(export_dir) / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: {export_dir} is not an export ({exc}); run `make export` first") from None
    models = manifest.get("models") or {}
    target = (models.get("target") or {}).get("source")
    draft = (models.get("draft") or {}).get("source")
    if not target:
        raise SystemExit(f"error: {export_dir}/manifest.json names no target source (models.target.source)")
    return Path(target), Path(draft) if draft else None, manifest.get("dtype", "float32")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Prepare the benchmark peers (venvs + models) for one model.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--export", type=Path, help="export dir: its manifest names the target and draft HF dirs")
    src.add_argument("--target", type=Path, help="HF dir of the target")
    p.add_argument("--draft", type=Path, help="HF dir of the draft (with --target)")
    p.add_argument("--dtype", default="float32", help="precision of llama.cpp's GGUF (with --target)")
    p.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS_DIR)
    p.add_argument("--only", help="comma list of ortgenai,optimum,llamacpp (default: all)")
    args = p.parse_args(argv)
    if args.export:
        target, draft, dtype = _export_sources(args.export)
    else:
        target, draft, dtype = args.target, args.draft, args.dtype
    only = set((args.only or "ortgenai,optimum,llamacpp").split(","))
    status = {}
    if "ortgenai" in only:
        try:
            py = ensure_genai_venv(args.peers_dir)
            dirs = genai_model_dirs(target, draft, args.peers_dir, int4=True)  # int4 beside our int4 exports
            status["ortgenai"] = f"ok (onnxruntime-genai {_genai_version(py)}): {', '.join(map(str, dirs.values()))}"
        except (PeerUnavailable, subprocess.CalledProcessError) as exc:
            status["ortgenai"] = f"unavailable: {exc}"
    if "optimum" in only:
        try:
            status["optimum"] = f"ok: {optimum_model_dir(target, args.peers_dir, build=True)}"
        except Exception as exc:  # a peer that cannot be prepared is reported, never fatal
            status["optimum"] = f"unavailable: {type(exc).__name__}: {str(exc)[:300]}"
    if "llamacpp" in only:
        from . import llamacpp

        try:
            py = llamacpp.ensure_venv(args.peers_dir)
            files = llamacpp.gguf_files(target, None, args.peers_dir, dtype)
            q8_0 = llamacpp.quantized_gguf(files["target"], "q8_0", args.peers_dir)  # beside our int8 exports
            py = llamacpp.ensure_runs(args.peers_dir, q8_0)  # its quantized kernels too (AMX: see there)
            if draft is not None:
                try:
                    files = llamacpp.gguf_files(target, draft, args.peers_dir, dtype)
                except (PeerUnavailable, OSError) as exc:
                    status["llamacpp draft"] = f"unavailable: {exc}"
            files["q8_0"] = q8_0
            note = llamacpp.build_note(args.peers_dir)
            status["llamacpp"] = (f"ok (llama-cpp-python {llamacpp.version(py)}{', ' + note if note else ''}): "
                                  + ", ".join(f"{k} {v}" for k, v in files.items()))
        except (PeerUnavailable, subprocess.CalledProcessError, OSError) as exc:
            status["llamacpp"] = f"unavailable: {exc}"
    for name, line in status.items():
        print(f"{name}: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
