"""Add the batched target graph to an older export: `python -m specdeploy.export.batched_graph EXPORT [MODEL]`.

The exporter writes it (export/exporter.py, for float32 exports with fused graphs); this adds
it to an export made before it did, recording it in the manifest.

The continuous-batching service (runtime/batching) runs the target as one fused graph with a
dynamic batch dimension (export/fused_graph.build_fused_decoder(batched=True)), weights in
their own file. It is the manifest's `fused_batched` record (runtime/graph_contract.py), so
its files are checksummed and kept inside the export like every graph, and its PyTorch
reference is saved for the accuracy check; the batch-1 runtime never opens it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..runtime.batching.graph import EXTRA_ROWS
from ..runtime.errors import SpecDeployError
from ..runtime.graph_contract import (
    DECODER,
    FEATURES,
    FUSED_BATCHED,
    TARGET,
    GraphRecord,
    batched_graph_name,
    decoder_io,
    graph_file,
    weights_file,
)
from ..runtime.manifest import add_graph, load_manifest
from .decoder_graph import DecoderGraph
from .fused_graph import FUSED_DTYPES, build_fused_decoder, write_fused
from .hf_loading import load_causal_lm
from .onnx_writer import SharedWeights
from .reference import CHECK_DIR, TorchReference, decoder_feeds, reference_paths, torch_reference


def write_batched_target(causal_lm, out: Path, max_context: int, ref_feeds: dict, ref_outputs: TorchReference,
                         tokens: int) -> GraphRecord:
    """Write the batched target graph into `out` and its reference: one row of the batch-1
    fused graph's call of `tokens` (`ref_feeds`/`ref_outputs`: the portable graph's). The
    graph outputs logits and hidden states only (no EAGLE-3 features)."""
    name = batched_graph_name(TARGET)
    # RoPE rows up to max_context inclusive: the slots' trash row (runtime/batching/kv_slots.py)
    model = build_fused_decoder(causal_lm, tokens, max_context + EXTRA_ROWS, batched=True)
    ref = TorchReference({k: v for k, v in ref_outputs.reference.items() if k != FEATURES},
                         {k: v for k, v in ref_outputs.torch.items() if k != FEATURES}, ref_outputs.dtype,
                         {k: v for k, v in ref_outputs.noise_errors.items() if k != FEATURES})
    write_fused(model, out, name, SharedWeights(out, weights_file(TARGET, FUSED_BATCHED)), ref_feeds, ref, tokens)
    return GraphRecord.new(name, TARGET, DECODER, 1, flavor=FUSED_BATCHED)  # T is dynamic: 1 is the decode step


def add_batched_target(export_dir: Path, model_dir: Path | None = None) -> Path:
    """Add the batched target graph to an export that lacks it, from the HF model it was exported
    from (`model_dir`, default: the manifest's target source), and record it in the manifest
    (its files' checksums added; the manifest replaced atomically). Returns the graph's path."""
    manifest = load_manifest(export_dir)  # checksums verified: the record joins an intact export
    existing = manifest.batched_graph()
    if existing is not None:
        return manifest.graph_path(existing)
    if manifest.dtype not in FUSED_DTYPES:
        raise SpecDeployError(f"the batched graph is {', '.join(FUSED_DTYPES)} only (this export is {manifest.dtype})")
    if TARGET in (manifest.quantization or {}).get("models", {}):
        raise SpecDeployError("this export's target has quantized weights; the batched graph is float, so its rows "
                              "would not match the export's batch-1 output (export without quantizing the target)")
    source = model_dir or manifest.models[TARGET].source
    if not source:
        raise SpecDeployError("the manifest does not say where the target came from: give the model directory")
    causal_lm = load_causal_lm(Path(source), manifest.dtype)
    spec = manifest.models[TARGET]
    tokens = manifest.prefill_chunk
    feeds = decoder_feeds(tokens, min(37, manifest.max_context - tokens), spec.to_json(), spec.vocab_size,
                          torch.float32, seed=1000 + tokens)
    io = decoder_io(spec.num_layers)
    outputs = torch_reference(DecoderGraph(causal_lm).eval(), feeds, io.inputs, io.outputs)
    root = manifest.root
    name = batched_graph_name(TARGET)
    for path in (root / graph_file(name), root / weights_file(TARGET, FUSED_BATCHED),
                 *reference_paths(root / CHECK_DIR, name)):
        # An unrecorded one from before: new files, not rewritten in place (a hard-linked copy of
        # this export, or a server still running it, keeps the old ones)
        path.unlink(missing_ok=True)
    record = write_batched_target(causal_lm, root, manifest.max_context, feeds, outputs, tokens)
    add_graph(root, record, [record.file, weights_file(TARGET, FUSED_BATCHED)])
    return manifest.graph_path(record)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export", type=Path)
    ap.add_argument("model", type=Path, nargs="?", help="HF model directory (default: the manifest's source)")
    args = ap.parse_args(argv)
    try:
        print(add_batched_target(args.export, args.model))
    except SpecDeployError as exc:
        print(f"error: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
