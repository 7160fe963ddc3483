"""A Triton model repository over an export: what a stock `tritonserver --model-repository DIR` loads.

    DIR/<name>_stream/config.pbtxt    decoupled Python-backend model holding the Service (triton_model.py)
    DIR/<name>_stream/1/model.py
    DIR/<name>/config.pbtxt           plain request/response model for HTTP and gRPC infer (triton_front.py)
    DIR/<name>/1/model.py

The export is referenced by absolute path (it must be readable there by the server), and so,
when the repository is written from a virtual environment, is that environment: Triton's
Python backend activates it (EXECUTION_ENV_PATH) before starting a model's stub, which then
imports this specdeploy and its packages. It needs numpy<2 (the stub's own tensor code does
not work with numpy 2) and the Python minor version the stub was built for. In a container
where specdeploy is installed for the server's own Python, pass `python_env=None`.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

from ..runtime.errors import SpecDeployError

HERE = Path(__file__).resolve().parent

# (name, Triton type, dims): the inputs of Triton's LLM backends that mean something here, all optional.
INPUTS = [("text_input", "TYPE_STRING", [1]), ("input_ids", "TYPE_INT32", [-1]), ("max_tokens", "TYPE_INT32", [1]),
          ("temperature", "TYPE_FP32", [1]), ("top_k", "TYPE_INT32", [1]), ("top_p", "TYPE_FP32", [1]),
          ("min_p", "TYPE_FP32", [1]),
          ("random_seed", "TYPE_UINT64", [1]), ("stop_words", "TYPE_STRING", [-1]), ("ignore_eos", "TYPE_BOOL", [1]),
          ("method", "TYPE_STRING", [1]), ("stream", "TYPE_BOOL", [1]), ("repetition_penalty", "TYPE_FP32", [1]),
          ("presence_penalty", "TYPE_FP32", [1]), ("frequency_penalty", "TYPE_FP32", [1]),
          ("return_log_probs", "TYPE_BOOL", [1])]
# output_log_probs and cum_log_probs come only with return_log_probs, finish_reason and stats in the last response
OUTPUTS = [("text_output", "TYPE_STRING", [-1]), ("output_ids", "TYPE_INT32", [-1]),
           ("finish_reason", "TYPE_STRING", [1]), ("stats", "TYPE_STRING", [1]),
           ("output_log_probs", "TYPE_FP32", [-1]), ("cum_log_probs", "TYPE_FP32", [1])]
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}")


def _quote(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # JSON's string escapes are valid protobuf text


def _tensors(kind: str, specs, optional: bool) -> str:
    rows = [f'  {{ name: "{name}" data_type: {dtype} dims: [ {", ".join(map(str, dims))} ]'
            + (" optional: true" if optional else "") + " }" for name, dtype, dims in specs]
    return f"{kind} [\n" + ",\n".join(rows) + "\n]\n"


def _config(name: str, decoupled: bool, instances: int, params: dict[str, str]) -> str:
    text = f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
    text += f"model_transaction_policy {{ decoupled: {'true' if decoupled else 'false'} }}\n"
    text += _tensors("input", INPUTS, optional=True) + _tensors("output", OUTPUTS, optional=False)
    text += f"instance_group [ {{ count: {instances} kind: KIND_CPU }} ]\n"
    for key, value in params.items():
        text += f"parameters {{ key: {_quote(key)} value: {{ string_value: {_quote(value)} }} }}\n"
    return text


def current_env() -> str | None:
    """This interpreter's virtual environment, if it runs in one."""
    return sys.prefix if sys.prefix != sys.base_prefix and (Path(sys.prefix) / "bin" / "activate").is_file() else None


def write_repo(export_dir: str | Path, repo: str | Path, *, name: str | None = None, instances: int = 1,
               pool_size: int = 1, queue_size: int = 8, queue_timeout: float = 30.0, method: str | None = None,
               backend: str = "auto", threads: int | None = None, front_instances: int | None = None,
               python_env: str | None = "current") -> Path:
    """Write (or overwrite) the two models of `name` into `repo`; returns the repository path.

    `instances`: Triton instances of the stream model, each a Service of `pool_size` workers.
    `front_instances`: instances of the plain model; each waits on one generation at a time, so
    more than the workers in all (the default) gain nothing.
    """
    from ..runtime.manifest import load_manifest
    from ..runtime.methods import AUTO

    export_dir = Path(export_dir).resolve()
    manifest = load_manifest(export_dir, verify_checksums=False)  # a bad export fails here, not in the server
    name = name or export_dir.name
    if not _NAME.fullmatch(name):
        raise SpecDeployError(f"model name {name!r}: use letters, digits, '_', '.', '-'")
    for value, what in ((instances, "instances"), (pool_size, "pool size")):
        if value < 1:
            raise SpecDeployError(f"{what} must be >= 1, got {value}")
    if method not in (None, AUTO) and method not in manifest.methods:
        raise SpecDeployError(f"method {method!r} is not in this export (available: {', '.join(manifest.methods)})")
    if python_env == "current":
        python_env = current_env()
    stream_name = f"{name}_stream"
    repo = Path(repo)
    params = {"export_dir": str(export_dir), "pool_size": str(pool_size), "queue_size": str(queue_size),
              "queue_timeout": str(queue_timeout), "method": method or "", "backend": backend,
              "threads": str(threads or "")}
    front_params = {"stream_model": stream_name}
    if python_env:
        params["EXECUTION_ENV_PATH"] = front_params["EXECUTION_ENV_PATH"] = str(Path(python_env).resolve())
    front = front_instances or instances * pool_size
    for model, source, config in (
            (stream_name, "triton_model.py", _config(stream_name, True, instances, params)),
            (name, "triton_front.py", _config(name, False, front, front_params))):
        (repo / model / "1").mkdir(parents=True, exist_ok=True)
        (repo / model / "config.pbtxt").write_text(config)
        shutil.copyfile(HERE / source, repo / model / "1" / "model.py")
    return repo
