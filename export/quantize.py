"""Weight-only int4/int8 quantization of the fused (ONNX Runtime CPU) graphs, after they are written.

Decoding one token on a CPU streams every weight matrix through the cores once, so the
decode step's cost is the weights' bytes. ONNX Runtime's `MatMulNBits` contrib op keeps a
MatMul's weight as 4- or 8-bit integers in blocks of `block_size` input rows, each block with
a float scale (and a zero point unless symmetric), and dequantizes inside its kernel;
`accuracy_level` 4 lets MLAS quantize the activations to int8 per block too, so the inner
loop is an int8 dot product (VNNI) over a quarter (int4) of float32's bytes.

What is quantized, per model (target, draft and the EAGLE head independently: QuantPlan):

* every MatMul with a constant weight of the model's fused graphs (q/k/v, o, gate, up, down,
  the EAGLE head's fc) at the scheme's bits, and the LM head, the largest matrix (576 x 49152
  on SmolLM2; found as the widest output), at 8 bits (LM_HEAD_BITS);
* a tied input embedding (its table equal to the LM head's weight transposed) reads the
  quantized LM head's own initializers through `GatherBlockQuantized`: one copy of the
  vocabulary matrix, at 8 bits. An untied embedding stays a float Gather (a gather reads
  one row per token, so it costs no bandwidth, only file size).

The portable graphs stay float: they are TensorRT's source and this pass's accuracy
reference (export/task_check.py). TensorRT's weight-only path is a different graph form
(DequantizeLinear -> MatMul, export/quantize_trt.py), documented and linted, not built here.

Greedy output stays exactly the quantized target's own `ar`: every row must come out the same
from any call size, and with int8-quantized activations a single-row call does not by itself.
A quantized target's attentions each get one padding row (export/attention_pad.py:
GroupQueryAttention sums a lone row differently), so it keeps its one-row calls, where its
MatMulNBits are row-exact too: up to block 32 at 4 bits and block 64 at 8 bits (ROW_EXACT_BLOCK;
larger blocks take another kernel for one row). A larger block's T=1 record becomes T=2
(`_no_single_row_calls`). The runtime re-checks this on the machine it runs on
(runtime/backends/ort_decoder.py) and gives one-row calls a padding row where it does not hold;
its calls then run the copy of the graph written here without the attention padding
(`unpadded_graph` in the manifest's scheme: the same weights).

Weights once (ARCHITECTURE.md): a model's fused graphs are one file content for every static
T and share one external-data file. Each distinct content is quantized once, the result is
written to the model's same weights file (weights/<model>.fused.bin, now holding the
quantized tensors) and to every graph file of that content, so the runtime still opens one
session per model and the quantized weights exist once on disk and in memory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..runtime.errors import SpecDeployError
from ..runtime.graph_contract import (
    DECODER,
    FUSED,
    TARGET,
    GraphRecord,
    decoder_graph_name,
    unpadded_graph_file,
    weights_file,
)
from .attention_pad import can_pad, pad_attention

WEIGHT_CHOICES = ("float", "int8", "int4")
BITS = {"int8": 8, "int4": 4}
DEFAULT_BLOCK_SIZE = 32  # input rows per scale: ORT's CPU default; 576 = 18 x 32 (SmolLM2), no padding
# MLAS computes int8 x int4/int8 (activations quantized per block): the fast path on AVX2/AVX512-VNNI.
ACCURACY_LEVEL = 4
SYMMETRIC = False  # a zero point per block: closer than symmetric at int4 for the same bytes
# The LM head (and a tied embedding reading it) stays 8-bit under an int4 body by default
# (`--lm-head-bits`), as llama.cpp's Q4_K_M keeps its output tensor at higher precision: the logits
# are what the task check and greedy decoding compare, and on SmolLM2-135M an int4 LM head cost
# 5 points of top-1.
LM_HEAD_BITS = 8
# bits -> the largest block at which MatMulNBits (accuracy level 4) gives a row the same from a
# one-row call as from any other (measured on ORT 1.32 with AVX512-VNNI, every SmolLM2 shape and
# 1-16 rows: larger blocks sum a lone row differently; rows of 2 and more always agree). Kernels
# are per CPU: on AVX2 without VNNI 4-bit is row-exact at block 16 only (8-bit at 16-64), and the
# runtime pads there (runtime/backends/ort_decoder.py); block 16 unpadded decoded slower than block
# 32 padded on that CPU, so the default block stays 32.
ROW_EXACT_BLOCK = {4: 32, 8: 64}
METHOD = "matmul_nbits"  # what the manifest says was applied (ORT's MatMulNBitsQuantizer, round to nearest)


@dataclass(frozen=True)
class WeightScheme:
    bits: int  # the body's MatMuls
    block_size: int = DEFAULT_BLOCK_SIZE
    symmetric: bool = SYMMETRIC
    accuracy_level: int = ACCURACY_LEVEL
    lm_head_bits: int = LM_HEAD_BITS

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    def to_json(self, embedding: str) -> dict:
        return {"bits": self.bits, "lm_head_bits": self.lm_head_bits, "block_size": self.block_size,
                "symmetric": self.symmetric, "accuracy_level": self.accuracy_level, "embedding": embedding}


BLOCK_SIZES = (16, 32, 64, 128, 256)  # what ONNX Runtime's CPU MatMulNBits kernels (MLAS) take


def check_block_size(block_size: int) -> int:
    """MatMulNBits and GatherBlockQuantized take a power of two, at least 16; MLAS's CPU kernels at most 256
    (512 exported every graph, then failed in the quantizer as an internal error)."""
    if block_size not in BLOCK_SIZES:
        raise SpecDeployError(f"--block-size must be one of {', '.join(map(str, BLOCK_SIZES))} (got {block_size})")
    return block_size


@dataclass(frozen=True)
class QuantPlan:
    """Which models' fused graphs are quantized, and how (model name -> scheme)."""

    schemes: dict[str, WeightScheme]

    @classmethod
    def from_choices(cls, block_size: int = DEFAULT_BLOCK_SIZE, lm_head_bits: int = LM_HEAD_BITS,
                     **choices: str | None) -> QuantPlan | None:
        """`target="int4", draft="int8", eagle="float"`: None when nothing is quantized."""
        check_block_size(block_size)
        if lm_head_bits not in BITS.values():
            raise SpecDeployError(f"--lm-head-bits must be 4 or 8 (got {lm_head_bits})")
        schemes = {}
        for model, choice in choices.items():
            if choice is None or choice == "float":
                continue
            if choice not in BITS:
                raise SpecDeployError(f"weights for {model}: {choice!r} is not one of {', '.join(WEIGHT_CHOICES)}")
            schemes[model] = WeightScheme(BITS[choice], block_size, lm_head_bits=lm_head_bits)
        return cls(schemes) if schemes else None

    def check_fused(self, dtype: str, fused: bool) -> None:
        """Before anything is written: quantization rewrites fused graphs, so there must be some."""
        if not fused or dtype != "float32":
            raise SpecDeployError("quantized weights (--weights/--draft-weights/--heads-weights) rewrite the ORT CPU "
                                  "fused graphs: they need --dtype float32 and no --no-fused")



# -- one graph ------------------------------------------------------------------------------------

def _initializers(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in graph.initializer}


def _tied_embedding(graph: onnx.GraphProto) -> tuple[onnx.NodeProto, str] | None:
    """(the embedding Gather, the name of the LM head MatMul's weight) when the gathered table
    is that weight transposed (tied word embeddings), else None."""
    inits = _initializers(graph)
    matmul_weights = {n.input[1] for n in graph.node if n.op_type == "MatMul" and n.input[1] in inits}
    for node in graph.node:
        if node.op_type != "Gather" or node.input[0] not in inits:
            continue
        table = inits[node.input[0]]
        if table.data_type != onnx.TensorProto.FLOAT or len(table.dims) != 2:
            continue
        rows, cols = table.dims
        for name in matmul_weights:
            w = inits[name]
            if list(w.dims) == [cols, rows] and w.data_type == table.data_type and \
                    np.array_equal(numpy_helper.to_array(w).T, numpy_helper.to_array(table)):
                return node, name
    return None


def _share_embedding(graph: onnx.GraphProto, gather: onnx.NodeProto, lm_weight: str, scheme: WeightScheme) -> bool:
    """Replace the float embedding Gather by GatherBlockQuantized over the LM head's MatMulNBits
    initializers ([N, blocks, blob] uint8 viewed as [N, blocks * blob]; rows padded to whole
    blocks are sliced back to the hidden size). False when the LM head was left float."""
    lm = next((n for n in graph.node if n.op_type == "MatMulNBits" and n.input[1].startswith(lm_weight + "_Q")), None)
    if lm is None:
        return False
    inits = _initializers(graph)
    qweight = inits[lm.input[1]]
    vocab, blocks, blob = qweight.dims
    attrs = {a.name: helper.get_attribute_value(a) for a in lm.attribute}
    hidden, bits = int(attrs["K"]), int(attrs["bits"])
    prefix = f"{gather.name or 'embed'}_shared"
    graph.initializer.append(numpy_helper.from_array(np.array([vocab, blocks * blob], np.int64), f"{prefix}.shape"))
    nodes = [helper.make_node("Reshape", [lm.input[1], f"{prefix}.shape"], [f"{prefix}.q"], name=f"{prefix}_reshape"),
             helper.make_node("GatherBlockQuantized", [f"{prefix}.q", gather.input[1], *lm.input[2:]],
                              [gather.output[0] if blocks * scheme.block_size == hidden else f"{prefix}.padded"],
                              name=f"{prefix}_gather", domain="com.microsoft", bits=bits,
                              block_size=scheme.block_size, gather_axis=0, quantize_axis=1)]
    if blocks * scheme.block_size != hidden:
        for name, value in (("starts", 0), ("ends", hidden), ("axes", -1)):
            graph.initializer.append(numpy_helper.from_array(np.array([value], np.int64), f"{prefix}.{name}"))
        nodes.append(helper.make_node("Slice", [f"{prefix}.padded", f"{prefix}.starts", f"{prefix}.ends",
                                                f"{prefix}.axes"], [gather.output[0]], name=f"{prefix}_slice"))
    at = list(graph.node).index(gather)
    kept = [n for n in graph.node if n is not gather]
    graph.ClearField("node")
    graph.node.extend(kept[:at] + nodes + kept[at:])
    return True


def _drop_unused_initializers(graph: onnx.GraphProto) -> None:
    used = {name for n in graph.node for name in n.input}
    kept = [t for t in graph.initializer if t.name in used]
    graph.ClearField("initializer")
    graph.initializer.extend(kept)


def quantizer_class():
    """ORT's MatMulNBitsQuantizer; its module calls logging.basicConfig(INFO) on import, which
    would turn on every library's INFO lines in this process: the root logger is put back."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    root.handlers[:] = handlers
    root.setLevel(level)
    return MatMulNBitsQuantizer


def _lm_head(graph: onnx.GraphProto) -> onnx.NodeProto | None:
    """The LM head: the constant-weight MatMul with the widest output (the vocabulary)."""
    inits = _initializers(graph)
    heads = [n for n in graph.node
             if n.op_type == "MatMul" and n.input[1] in inits and len(inits[n.input[1]].dims) == 2]
    return max(heads, key=lambda n: inits[n.input[1]].dims[1], default=None)


def _matmul_nbits(model: onnx.ModelProto, bits: int, scheme: WeightScheme, exclude: list[str]) -> onnx.ModelProto:
    """ORT's MatMulNBitsQuantizer over every constant-weight MatMul not named in `exclude`."""
    MatMulNBitsQuantizer = quantizer_class()
    quiet = logging.getLogger("onnxruntime.quantization")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # it logs every node it skips
    try:
        quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=scheme.block_size,
                                         is_symmetric=scheme.symmetric, accuracy_level=scheme.accuracy_level,
                                         nodes_to_exclude=exclude, op_types_to_quantize=("MatMul",))
        quantizer.process()
    finally:
        quiet.setLevel(level)
    return quantizer.model.model


def quantize_model(model: onnx.ModelProto, scheme: WeightScheme) -> tuple[onnx.ModelProto, str]:
    """The graph with every constant-weight MatMul as MatMulNBits (weights loaded in `model`; the
    LM head at scheme.lm_head_bits), and how its embedding is held: "shared" (tied, reads the
    quantized LM head) or "float"."""
    tied = _tied_embedding(model.graph)
    lm = _lm_head(model.graph)
    if lm is not None and not lm.name:
        lm.name = "lm_head"
    mixed = lm is not None and scheme.lm_head_bits != scheme.bits
    out = _matmul_nbits(model, scheme.bits, scheme, [lm.name] if mixed else [])
    if mixed:
        out = _matmul_nbits(out, scheme.lm_head_bits, scheme, [])  # only the LM head is still a MatMul
    if not any(n.op_type == "MatMulNBits" for n in out.graph.node):
        raise SpecDeployError("weight-only quantization found no MatMul with a constant weight to quantize")
    embedding = "float"
    if tied is not None:
        gather = next(n for n in out.graph.node if n.op_type == "Gather" and n.output[0] == tied[0].output[0])
        if _share_embedding(out.graph, gather, tied[1], scheme):
            embedding = "shared"
    _drop_unused_initializers(out.graph)
    return out, embedding


# -- an export ------------------------------------------------------------------------------------

def quantize_export(out: Path, graphs: dict[str, GraphRecord], plan: QuantPlan, progress) -> dict:
    """Rewrite the fused graphs of each planned model in the export at `out` (its staging dir);
    returns the manifest's `quantization` entry."""
    from .onnx_writer import SharedWeights, files_by_content
    from .reference import CHECK_DIR, reference_paths

    models = {}
    for model in plan.schemes:
        _no_foreign_readers(out, graphs, model)
    # the weight files no quantization rewrites: what the graphs it leaves alone read
    kept = SharedWeights.written(out / g.file for g in graphs.values()
                                 if not (g.model in plan.schemes and g.flavor == FUSED))
    for model, scheme in plan.schemes.items():
        records = [g for g in graphs.values() if g.model == model and g.flavor == FUSED]
        if not records:
            raise SpecDeployError(f"--weights for {model}: the export has no fused {model} graphs to quantize")
        # Load every content (weights into memory) before the shared weights file is rewritten.
        loaded = [(paths, onnx.load(str(paths[0]), load_external_data=True))
                  for paths in files_by_content(out / g.file for g in records)]
        # the float payload (a self-draft's lives in the target's file, which is not rewritten)
        before = sum(size for _, size in {(t.name, len(t.raw_data)) for _, m in loaded for t in m.graph.initializer})
        # the float file is removed and rewritten below; what stays float (norms, an untied embedding,
        # RoPE tables) is read where the export's other files already hold it
        weights = SharedWeights(out, weights_file(model, FUSED), kept)
        embeddings = set()
        # every content padded or none: the manifest's attention_pad speaks for the model
        pad = model == TARGET and row_exact_matmuls(scheme) and all(can_pad(m.graph) for _, m in loaded)
        # the one dynamic-T content also unpadded, for a CPU whose one-row calls get a padding row anyway
        unpadded = unpadded_graph_file(model) if pad and len(loaded) == 1 else None
        for paths, float_model in loaded:
            quantized, embedding = quantize_model(float_model, scheme)
            embeddings.add(embedding)
            if unpadded:  # the same payloads as the padded graph's: written once, read by both
                plain = onnx.ModelProto()
                plain.CopyFrom(quantized)
                weights.externalize(plain, out / unpadded)
                onnx.save(plain, str(out / unpadded))
            if pad and not pad_attention(quantized.graph):
                raise AssertionError("an attention that can_pad accepted was not padded")
            weights.externalize(quantized, paths[0])
            onnx.save(quantized, str(paths[0]))
            data = paths[0].read_bytes()
            for other in paths[1:]:  # the same content for every static T: written once, copied
                other.write_bytes(data)
        for g in records:  # their float references describe graphs no more: the task check holds them
            for ref in reference_paths(out / CHECK_DIR, g.name):
                ref.unlink(missing_ok=True)
        after = weights.path.stat().st_size if weights.path.exists() else 0  # all its payloads stored before
        kept += (weights,)  # written once: a model quantized after this one may read it (RoPE tables, a head)
        models[model] = scheme.to_json("shared" if embeddings == {"shared"} else "float")
        if pad:  # a call writes one key and value past its rows (runtime/decoder.py: spare)
            models[model]["attention_pad"] = 1
        if unpadded:
            models[model]["unpadded_graph"] = unpadded
        progress(f"  quantized {model}'s fused graphs ({len(records)} records, {len(loaded)} distinct) to "
                 f"{scheme.name}, block {scheme.block_size}: {weights_file(model, FUSED)} "
                 f"{before / 2**20:.1f} -> {after / 2**20:.1f} MiB"
                 + (", embedding shared with the LM head" if models[model]["embedding"] == "shared" else ""))
        if pad:
            progress(f"  {model}'s attentions padded by one row: one-row calls give the rows of any call size")
        elif model == TARGET:
            _no_single_row_calls(out, graphs, progress)
    return {"method": METHOD, "flavor": FUSED, "models": models}


def _no_foreign_readers(out: Path, graphs: dict[str, GraphRecord], model: str) -> None:
    """Quantizing `model` rewrites its fused weight file: no other model's graph may read it
    (export/onnx_writer.SharedWeights reuses only files that stay; this holds it to that)."""
    from ..runtime.onnx_external import external_data_locations

    rewritten = (out / weights_file(model, FUSED)).resolve()
    for g in graphs.values():
        if g.model == model and g.flavor == FUSED:
            continue
        path = out / g.file
        if any((path.parent / loc).resolve() == rewritten for loc in external_data_locations(path)):
            raise AssertionError(f"{g.file} reads {weights_file(model, FUSED)}, which quantizing {model} rewrites")


def row_exact_matmuls(scheme: WeightScheme) -> bool:
    """Whether every MatMulNBits of the scheme (body and LM head) gives a row the same from one row
    as from several (ROW_EXACT_BLOCK)."""
    return all(scheme.block_size <= ROW_EXACT_BLOCK[bits] for bits in (scheme.bits, scheme.lm_head_bits))


def _no_single_row_calls(out: Path, graphs: dict[str, GraphRecord], progress) -> None:
    """A target whose MatMulNBits are not row-exact decodes with its T=2 graph (one real row, one
    padding row), never T=1.

    Greedy output must equal the target's own `ar` whatever the call size, so every row must come
    out the same from any call. GroupQueryAttention (export/attention_pad.py) and MatMulNBits of a
    large block take other kernel paths for a single row (ulp-level differences, which float32
    graphs tolerate); with accuracy_level 4 the next MatMulNBits quantizes its activations to int8,
    and a rounding flipped by one ulp grows through the layers to logits differing by whole units:
    `ar` (T=1) and a method verifying at T=k+1 then diverged. From two rows up every call size gives
    bit-identical rows (padding included), so the T=1 record becomes T=2 (the same file content).
    The cost: a padded row through every weight per decode step (13% of an int4 step on SmolLM2
    against the padded attention), and the last position of the context is not decoded (the runtime
    stops there)."""
    ones = [name for name, g in graphs.items()
            if g.model == TARGET and g.flavor == FUSED and g.kind == DECODER and g.tokens == 1]
    for name in ones:
        record = graphs.pop(name)
        two = decoder_graph_name(TARGET, 2, FUSED)
        if two not in graphs:
            graphs[two] = GraphRecord.new(two, TARGET, DECODER, 2, flavor=FUSED)
            (out / record.file).rename(out / graphs[two].file)
        else:
            (out / record.file).unlink()
        progress(f"  {name} -> {two}: the quantized target never runs single-row calls (rows identical at any T)")


def quantized_graphs(manifest) -> set[str]:
    """Names of the graphs a `quantization` entry covers (the fused graphs of its models)."""
    models = (manifest.quantization or {}).get("models", {})
    return {name for name, g in manifest.graphs.items() if g.flavor == FUSED and g.model in models}

