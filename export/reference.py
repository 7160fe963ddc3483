"""PyTorch references saved beside each graph, for polygraphy to compare against.

Per graph, polygraphy's own formats (so `polygraphy run --load-inputs/--load-outputs` reads them):

  check/<graph>.inputs.json       one feed dict (data-loader JSON)
  check/<graph>.outputs.json      RunResults with two runs of the same wrapper on those feeds:
                                  `pytorch-float64` (the reference) and `pytorch-<dtype>` (the export dtype)
  check/<graph>.error_scale.json  per float output, the max |error| vs float64 of NOISE_RUNS more
                                  export-dtype runs with rounding noise (below)

How far the export dtype lands from float64 is the scale `specdeploy check` holds ONNX Runtime to
(export/check.py): float32 error grows with depth, so no fixed tolerance fits every model. One run
is one draw of that error, and a heavy-tailed one (a deep model's error is a few amplified
perturbations: on SmolLM2-135M, correct ORT graphs measured up to 8x one PyTorch run's error). So
the scale also takes NOISE_RUNS runs that move every op's result by up to one unit in the last
place at random (Monte Carlo arithmetic): more draws of the same dtype's error on the same call.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

CHECK_DIR = "check"
REFERENCE_RUNNER = "pytorch-float64"
TORCH_RUNNER_PREFIX = "pytorch-"  # + the export dtype: pytorch-float32, pytorch-float16, ...
NOISE_RUNS = 4  # with the plain run, the scale is a max of 5 draws (ORT measured <= 1.4x it on SmolLM2)


def random_tree_mask(t: int, rng: np.random.Generator) -> np.ndarray:
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, t)]
    m = np.eye(t, dtype=bool)
    for i in range(1, t):
        m[i] |= m[parents[i]]
    return m


def decoder_feeds(t: int, past: int, spec: dict, vocab: int, dtype: torch.dtype, seed: int) -> dict[str, np.ndarray]:
    """Plausible inputs: random ids, a random tree over the new tokens, past of modest scale."""
    rng = np.random.default_rng(seed)
    np_dtype = torch.empty((), dtype=dtype).numpy().dtype
    feeds = {
        "input_ids": rng.integers(0, vocab, (1, t), dtype=np.int64),
        "position_ids": (past + np.arange(t, dtype=np.int64))[None],
        "tree_mask": random_tree_mask(t, rng)[None],
    }
    for i in range(spec["num_layers"]):
        for kind in ("key", "value"):
            shape = (1, past, spec["num_kv_heads"], spec["head_dim"])
            feeds[f"past_{kind}.{i}"] = rng.standard_normal(shape).astype(np_dtype)
    return feeds


@dataclass
class TorchReference:
    """One call's outputs from PyTorch: in float64 (the reference) and in the export dtype, plus
    the max |error| vs float64 of each rounding-noise run, per float output."""

    reference: dict[str, np.ndarray]
    torch: dict[str, np.ndarray]
    dtype: str
    noise_errors: dict[str, list[float]]

    def map(self, fn: Callable[[dict], dict]) -> TorchReference:
        """The same transform on both runs (the fused graphs place new KV rows into buffers).
        `fn` only moves values (the past rows it adds are exact), so the noise errors carry over."""
        return TorchReference(fn(self.reference), fn(self.torch), self.dtype, self.noise_errors)


def _numpy(o: torch.Tensor) -> np.ndarray:
    return o.float().numpy() if o.dtype == torch.bfloat16 else o.numpy()  # numpy has no bfloat16


def run_torch(module: torch.nn.Module, feeds: dict[str, np.ndarray], input_names,
              output_names) -> dict[str, np.ndarray]:
    """The module as it is (its own dtype)."""
    with torch.no_grad():
        outs = module(*[torch.from_numpy(feeds[n]) for n in input_names])
    return {n: _numpy(o) for n, o in zip(output_names, outs)}


_LOW_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_CAST_METHODS = (torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16)


def _float64_arg(a):
    return torch.float64 if isinstance(a, torch.dtype) and a in _LOW_FLOATS else a


class _Float64Casts(TorchFunctionMode):
    """Inside, every cast to (or creation in) a lower-precision float yields float64 instead.

    The wrappers and HF modules cast on purpose (`scores.float()`, RMSNorm's `.to(torch.float32)`,
    RoPE's `inv_freq.float()`); without this the "float64" run would round to float32 in every layer.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _CAST_METHODS:
            return args[0].to(torch.float64)
        args = tuple(_float64_arg(a) for a in args)
        kwargs = {k: _float64_arg(v) for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


@contextmanager
def float64_weights(module: torch.nn.Module):
    """The module's floating parameters and buffers in float64, restored on exit.

    In place rather than a copy: a float64 copy beside the model would cost 3x its float32 size;
    float32/16 -> float64 -> back is exact, so the export is unaffected."""
    saved = []
    for t in itertools.chain(module.parameters(), module.buffers()):
        if t.is_floating_point() and t.dtype != torch.float64 and all(t is not s for s, _ in saved):
            saved.append((t, t.dtype))
            t.data = t.data.to(torch.float64)
    try:
        yield
    finally:
        for t, dtype in saved:
            t.data = t.data.to(dtype)


def run_float64(module: torch.nn.Module, feeds: dict[str, np.ndarray], input_names,
                output_names) -> dict[str, np.ndarray]:
    """The same module and inputs, computed in float64 throughout (float inputs widen exactly)."""
    args = [torch.from_numpy(feeds[n]) for n in input_names]
    args = [a.to(torch.float64) if a.is_floating_point() else a for a in args]
    with torch.no_grad(), float64_weights(module), _Float64Casts():
        outs = module(*args)
    return {n: o.numpy() for n, o in zip(output_names, outs)}


# Ops that only move or select values: no rounding in any dtype, so no noise.
_EXACT_OPS = frozenset({
    "__get__", "__getitem__", "view", "view_as", "reshape", "reshape_as", "transpose", "t", "permute", "expand",
    "expand_as", "contiguous", "squeeze", "unsqueeze", "flatten", "unflatten", "cat", "concat", "stack", "narrow",
    "select", "clone", "detach", "to", "type", "type_as", "float", "half", "double", "bfloat16", "repeat",
    "index_select", "gather", "masked_fill", "where", "embedding", "tril", "triu", "zeros_like", "ones_like",
    "full_like", "empty_like"})


class _RoundingNoise(TorchFunctionMode):
    """Every op's floating result moved by up to one unit in the last place (of its own dtype), at random."""

    def __init__(self, seed: int):
        super().__init__()
        self.generator = torch.Generator().manual_seed(seed)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if isinstance(out, torch.Tensor) and out.is_floating_point() and name not in _EXACT_OPS \
                and not name.endswith("_"):  # in-place ops return their input: leave them be
            noise = torch.rand(out.shape, generator=self.generator).mul_(2).sub_(1).to(out.dtype)
            out = out + out * noise * torch.finfo(out.dtype).eps
        return out


def rounding_noise_errors(module: torch.nn.Module, feeds: dict[str, np.ndarray], input_names, output_names,
                          reference: dict[str, np.ndarray], runs: int = NOISE_RUNS) -> dict[str, list[float]]:
    """Per float output, max |error| vs `reference` of `runs` export-dtype runs with rounding noise."""
    errors: dict[str, list[float]] = {n: [] for n in output_names if np.issubdtype(reference[n].dtype, np.floating)}
    for seed in range(runs):
        with torch.no_grad(), _RoundingNoise(seed):
            outs = module(*[torch.from_numpy(feeds[n]) for n in input_names])
        for n, o in zip(output_names, outs):
            if n in errors:
                errors[n].append(float(np.max(np.abs(_numpy(o) - reference[n]), initial=0.0)))
    return errors


def module_dtype(module: torch.nn.Module) -> str:
    return str(next(p.dtype for p in module.parameters() if p.is_floating_point())).removeprefix("torch.")


def torch_reference(module: torch.nn.Module, feeds: dict[str, np.ndarray], input_names, output_names) -> TorchReference:
    """The wrapper on the same feeds in float64 (the reference) and in its own dtype, plain and
    with rounding noise (the error scale)."""
    reference = run_float64(module, feeds, input_names, output_names)
    return TorchReference(reference, run_torch(module, feeds, input_names, output_names), module_dtype(module),
                          rounding_noise_errors(module, feeds, input_names, output_names, reference))


def quiet_polygraphy() -> None:
    import logging

    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.CRITICAL  # our own table reports; polygraphy would repeat it
    logging.getLogger("polygraphy").setLevel(logging.ERROR)


def reference_paths(check_dir: Path, graph_name: str) -> tuple[Path, Path, Path]:
    """inputs (polygraphy data-loader JSON), outputs (polygraphy RunResults), the noise errors (JSON)."""
    return (check_dir / f"{graph_name}.inputs.json", check_dir / f"{graph_name}.outputs.json",
            check_dir / f"{graph_name}.error_scale.json")


def save_reference(out_dir: Path, graph_name: str, feeds: dict, ref: TorchReference) -> None:
    from polygraphy.comparator import IterationResult, RunResults
    from polygraphy.json import save_json

    quiet_polygraphy()
    check = out_dir / CHECK_DIR
    check.mkdir(parents=True, exist_ok=True)
    inputs_path, outputs_path, scale_path = reference_paths(check, graph_name)
    save_json([feeds], str(inputs_path))
    results = RunResults()
    for runner, outputs in ((REFERENCE_RUNNER, ref.reference), (TORCH_RUNNER_PREFIX + ref.dtype, ref.torch)):
        results.append((runner, [IterationResult(outputs=outputs, runner_name=runner)]))
    results.save(str(outputs_path))
    scale_path.write_text(json.dumps({"dtype": ref.dtype, "rounding_noise_max_abs_error": ref.noise_errors}, indent=1))


def load_reference(check_dir: Path, graph_name: str) -> tuple[dict, TorchReference]:
    """(feeds, reference) as saved; ValueError when the outputs file is not in this format."""
    from polygraphy.comparator import RunResults
    from polygraphy.json import load_json

    quiet_polygraphy()
    inputs_path, outputs_path, scale_path = reference_paths(check_dir, graph_name)
    (feeds,) = load_json(str(inputs_path))
    runs = {name: iters[0] for name, iters in RunResults.load(str(outputs_path))}
    torch_runs = [n for n in runs if n.startswith(TORCH_RUNNER_PREFIX) and n != REFERENCE_RUNNER]
    if REFERENCE_RUNNER not in runs or len(torch_runs) != 1:
        raise ValueError(f"{outputs_path.name} holds runs {sorted(runs)}, not {REFERENCE_RUNNER} and one "
                         f"{TORCH_RUNNER_PREFIX}<dtype> (an export from an older specdeploy: re-export)")
    (torch_run,) = torch_runs
    noise = json.loads(scale_path.read_text())["rounding_noise_max_abs_error"]
    return feeds, TorchReference(dict(runs[REFERENCE_RUNNER]), dict(runs[torch_run]),
                                 torch_run.removeprefix(TORCH_RUNNER_PREFIX), noise)
