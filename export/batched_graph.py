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

import numpy as np
import onnx
import torch

from ..runtime.batching.graph import (
    CONTEXT_ROWS,
    DECODE_TOKENS,
    EXTRA_ROWS,
    LOGIT_TOKENS,
    LONE_ROW,
    RUNS,
    SEGMENTS,
    run_kv_name,
)
from ..runtime.errors import SpecDeployError
from ..runtime.graph_contract import (
    DECODER,
    FEATURES,
    FUSED,
    FUSED_BATCHED,
    HIDDEN,
    INPUT_IDS,
    LOGITS,
    PAST_LENGTH,
    POSITION_IDS,
    TARGET,
    TREE_MASK,
    GraphRecord,
    batched_graph_name,
    decoder_io,
    graph_file,
    is_past,
    is_present,
    present_of,
    weights_file,
)
from ..runtime.manifest import add_graph, load_manifest
from .decoder_graph import DecoderGraph
from .fused_graph import FUSED_DTYPES, build_fused_decoder, fused_feeds, fused_reference
from .hf_loading import load_causal_lm
from .onnx_writer import SharedWeights
from .reference import CHECK_DIR, TorchReference, decoder_feeds, reference_paths, save_reference, torch_reference


def batched_reference_call(feeds: dict, ref: TorchReference, runs: int) -> tuple[dict, TorchReference]:
    """The batched graph's reference call, from one batch-1 fused call of T tokens (its tree puts
    parents before children, so every prefix of the call is a call of its own with the same
    outputs): the decode part is the first token, run 0 the whole call, each further run the
    first two tokens, each over its own copy of the buffers."""
    t = feeds[INPUT_IDS].shape[1]
    past = int(feeds[PAST_LENGTH][0])
    lengths = [1, t] + [min(2, t)] * (runs - 1)  # the decode row's, then each run's
    n = sum(lengths)
    mask = np.zeros((n, n), bool)
    segments, at = [], 0
    for j in lengths:
        mask[at:at + j, at:at + j] = feeds[TREE_MASK][0, :j, :j]
        segments.append((at, at + j, past))
        at += j
    out = {INPUT_IDS: np.concatenate([feeds[INPUT_IDS][:, :j] for j in lengths], axis=1),
           POSITION_IDS: np.concatenate([feeds[POSITION_IDS][:, :j] for j in lengths], axis=1),
           TREE_MASK: mask, PAST_LENGTH: feeds[PAST_LENGTH].copy(), SEGMENTS: np.array(segments[1:], np.int64),
           DECODE_TOKENS: np.zeros(1, np.int64), CONTEXT_ROWS: np.arange(n, dtype=np.int64),
           LOGIT_TOKENS: np.arange(n, dtype=np.int64),  # every token's logits: the check compares them all
           LONE_ROW: np.array([False])}  # rows of every part (tests/test_batched_logits.py checks a lone row's)
    kv = [n for n in feeds if is_past(n)]
    for prefix, j in ((None, 1), *enumerate(lengths[1:])):
        for name in kv:
            out[name if prefix is None else run_kv_name(prefix, name)] = feeds[name].copy()

    def outputs(fused: dict) -> dict:
        got = {name: np.concatenate([fused[name][:, :j] for j in lengths], axis=1) for name in (LOGITS, HIDDEN)}
        for prefix, j in ((None, 1), *enumerate(lengths[1:])):
            for name in kv:  # the buffer with the first j new rows written
                buf = feeds[name].astype(fused[present_of(name)].dtype)
                buf[:, :, past:past + j] = fused[present_of(name)][:, :, past:past + j]
                got[present_of(name) if prefix is None else run_kv_name(prefix, present_of(name))] = buf
        return got

    noise = {k: v for k, v in ref.noise_errors.items() if k != FEATURES}
    noise.update({run_kv_name(r, k): v for r in range(runs) for k, v in noise.items() if is_present(k)})
    return out, TorchReference(outputs(ref.reference), outputs(ref.torch), ref.dtype, noise)


def write_batched_target(causal_lm, out: Path, max_context: int, ref_feeds: dict, ref_outputs: TorchReference,
                         tokens: int, reuse: tuple[SharedWeights, ...] = ()) -> GraphRecord:
    """Write the batched target graph into `out` and its reference (batched_reference_call of the
    batch-1 fused graph's call of `tokens`; `ref_feeds`/`ref_outputs`: the portable graph's).
    The graph outputs logits and hidden states only (no EAGLE-3 features). `reuse`: weight files
    already written that hold its weights (the fused target's: all but its longer RoPE tables)."""
    name = batched_graph_name(TARGET)
    # RoPE rows up to max_context inclusive: the slots' trash row (runtime/batching/kv_slots.py)
    model = build_fused_decoder(causal_lm, tokens, max_context + EXTRA_ROWS, batched=True, runs=RUNS)
    path = out / graph_file(name)
    SharedWeights(out, weights_file(TARGET, FUSED_BATCHED), reuse).externalize(model, path)
    onnx.save(model, str(path))
    fused = fused_feeds(ref_feeds, tokens)
    feeds, ref = batched_reference_call(fused, ref_outputs.map(lambda outs: fused_reference(fused, outs, tokens)),
                                        RUNS)
    save_reference(out, name, feeds, ref)
    return GraphRecord.new(name, TARGET, DECODER, 1, flavor=FUSED_BATCHED)  # T is dynamic: 1 is the decode step


def is_current(path: Path) -> bool:
    """Whether the batched graph at `path` is this specdeploy's (runs of several tokens per call,
    parts without a token of their own reading another's, logits of the tokens asked for only,
    a lone row's call without the other parts). One without logit_tokens or lone_row still
    serves (every token scored, every part's attention run); the step replaces it."""
    graph = onnx.load(str(path), load_external_data=False)
    names = {i.name for i in graph.graph.input}
    return CONTEXT_ROWS in names and LOGIT_TOKENS in names and LONE_ROW in names


def add_batched_target(export_dir: Path, model_dir: Path | None = None) -> Path:
    """Add the batched target graph to an export that lacks it, from the HF model it was exported
    from (`model_dir`, default: the manifest's target source), and record it in the manifest
    (its files' checksums added; the manifest replaced atomically). Returns the graph's path."""
    manifest = load_manifest(export_dir)  # checksums verified: the record joins an intact export
    existing = manifest.batched_graph()
    if existing is not None and is_current(manifest.graph_path(existing)):
        return manifest.graph_path(existing)
    if manifest.dtype not in FUSED_DTYPES:
        raise SpecDeployError(f"the batched graph is {', '.join(FUSED_DTYPES)} only (this export is {manifest.dtype})")
    if TARGET in (manifest.quantization or {}).get("models", {}):
        raise SpecDeployError("this export's target has quantized weights; the batched graph is float, so its rows "
                              "would not match the export's batch-1 output (export without quantizing the target)")
    if manifest.exact_rows:
        raise SpecDeployError("this export was made with --exact-rows: the batched graph's decode rows run the "
                              "one-row attention its batch-1 graphs pad away, so they would not match its batch-1 "
                              "output (export without --exact-rows)")
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
    # the weights the fused target's graphs already store (checksummed, never rewritten) are read there
    fused = [manifest.graph_path(g) for g in manifest.graphs.values() if g.model == TARGET and g.flavor == FUSED]
    record = write_batched_target(causal_lm, root, manifest.max_context, feeds, outputs, tokens,
                                  SharedWeights.written(fused))
    own = weights_file(TARGET, FUSED_BATCHED)  # none if every payload were stored elsewhere already
    add_graph(root, record, [record.file] + ([own] if (root / own).is_file() else []))
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
