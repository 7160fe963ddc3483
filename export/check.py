"""`specdeploy check`: every graph's accuracy against the saved PyTorch outputs, with polygraphy.

Reference inputs/outputs were saved at export (`check/<graph>.{inputs,outputs}.json`);
polygraphy's Comparator runs each graph on ONNX Runtime and compares per output.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..runtime.errors import SpecDeployError
from .reference import CHECK_DIR, quiet_polygraphy

# Per exported dtype: (atol, rtol). fp16 graphs compute attention in fp32 but
# carry fp16 activations, so logits differ by ~1e-2.
TOLERANCES = {"float32": (1e-3, 1e-3), "float16": (5e-2, 5e-2), "bfloat16": (1e-1, 1e-1)}


@dataclass
class GraphCheck:
    graph: str
    passed: bool
    detail: str


def _compare_func(atol: float, rtol: float):
    try:  # polygraphy >= 0.50; CompareFunc.simple is deprecated there
        from polygraphy.comparator import SimpleCompareFunc

        return SimpleCompareFunc(atol=atol, rtol=rtol)
    except ImportError:
        from polygraphy.comparator import CompareFunc

        return CompareFunc.simple(atol=atol, rtol=rtol)


def check_graph(onnx_path: Path, dtype: str = "float32") -> GraphCheck:
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.comparator import Comparator, RunResults
    from polygraphy.json import load_json

    quiet_polygraphy()
    name = onnx_path.stem
    check = onnx_path.parent / CHECK_DIR
    inputs_path, outputs_path = check / f"{name}.inputs.json", check / f"{name}.outputs.json"
    if not inputs_path.is_file() or not outputs_path.is_file():
        return GraphCheck(name, False, f"no saved PyTorch reference in {check} (re-export to create it)")
    atol, rtol = TOLERANCES.get(dtype, TOLERANCES["float32"])
    try:
        feeds = load_json(str(inputs_path))
        reference = RunResults.load(str(outputs_path))
        runner = OnnxrtRunner(SessionFromOnnx(str(onnx_path), providers=["CPUExecutionProvider"]), name="onnxrt")
        ours = Comparator.run([runner], data_loader=feeds)
        ours.extend(reference)
        verdict = Comparator.compare_accuracy(ours, compare_func=_compare_func(atol, rtol))
    except Exception as exc:  # corrupt graph or reference files
        return GraphCheck(name, False, f"could not run: {str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__}")
    passed = bool(verdict)
    detail = f"onnxrt vs pytorch, atol={atol} rtol={rtol}: {'PASS' if passed else 'FAIL'}"
    return GraphCheck(name, passed, detail)


def check_path(path: Path, dtype: str | None = None) -> list[GraphCheck]:
    """An export dir (every graph in its manifest) or a single .onnx file."""
    path = Path(path)
    if path.is_file() and path.suffix == ".onnx":
        return [check_graph(path, dtype or "float32")]
    if not path.is_dir():
        raise SpecDeployError(f"nothing to check at {path} (expected an export directory or a .onnx file)")
    from ..runtime.manifest import load_manifest

    manifest = load_manifest(path)
    return [check_graph(manifest.graph_path(g), dtype or manifest.dtype) for g in manifest.graphs.values()]
