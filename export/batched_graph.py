"""Add the batched target graph to an export: `python -m specdeploy.export.batched_graph EXPORT [MODEL]`.

The continuous-batching service (runtime/batching) runs the target as one fused graph with a
dynamic batch dimension (export/fused_graph.build_fused_decoder(batched=True)). It is written
beside the export's graphs, weights in their own file, and is not a manifest record: the
batch-1 runtime never opens it, and adding it leaves the manifest's checksums as they were.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import onnx

from ..runtime.batching.graph import BATCHED_GRAPH, BATCHED_WEIGHTS, EXTRA_ROWS
from ..runtime.errors import SpecDeployError
from ..runtime.graph_contract import TARGET
from ..runtime.manifest import load_manifest
from .fused_graph import build_fused_decoder
from .hf_loading import load_causal_lm
from .onnx_writer import SharedWeights


def write_batched_target(export_dir: Path, model_dir: Path | None = None) -> Path:
    """Write the batched target graph into `export_dir` from the HF model it was exported from
    (`model_dir`, default: the manifest's target source); returns the graph's path."""
    manifest = load_manifest(export_dir, verify_checksums=False)
    if manifest.dtype != "float32":
        raise SpecDeployError(f"the batched graph is float32 only (this export is {manifest.dtype})")
    source = model_dir or manifest.models[TARGET].source
    if not source:
        raise SpecDeployError("the manifest does not say where the target came from: give the model directory")
    # RoPE rows up to max_context inclusive: the slots' trash row (runtime/batching/kv_slots.py)
    model = build_fused_decoder(load_causal_lm(Path(source)), 1, manifest.max_context + EXTRA_ROWS, batched=True)
    path = Path(export_dir) / BATCHED_GRAPH
    SharedWeights(Path(export_dir), BATCHED_WEIGHTS).externalize(model, path)
    onnx.save(model, str(path))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export", type=Path)
    ap.add_argument("model", type=Path, nargs="?", help="HF model directory (default: the manifest's source)")
    args = ap.parse_args(argv)
    print(write_batched_target(args.export, args.model))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
