"""The roofline: how many bytes one forward pass reads, and how fast the machine can read them.

A decode step on this CPU is memory-bound: it streams every weight matrix once and does a
few FLOPs per byte. So `bandwidth / bytes read per pass` bounds target passes per second,
for every system and method alike (a speculative method gets more tokens per pass, never
more passes per second). Bytes are counted as the step reads them:

- every weight is read whole, once per pass (a pass of T tokens reads it once, not T times);
  a quantized weight (MatMulNBits) is its packed blob plus its scales and zero points;
- an embedding *gather* reads one row per token, not the table (a quantized embedding's
  GatherBlockQuantized: one row of the blob, its scales and zero points);
- a tied embedding is also the LM head, which reads it whole: counted once, as the head;
- plus the KV cache the attention reads: every layer's keys and values up to the position.

The bandwidth (bench/machine.py) is the best CPU-clock figure of large streaming reads on 1
and 2 threads. A row's *share* = (its target passes per second x bytes per pass) / bandwidth;
no row can exceed 100%, and the report says so if one does (a wrong count or bandwidth).
Draft models' reads are not counted (the share is the target's), which keeps it a lower bound.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

ONNX_ITEMSIZE = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8, 16: 2,
                 17: 1, 18: 1, 19: 1, 20: 1}  # TensorProto data type -> bytes per element
ONNX_4BIT = (21, 22, 23)  # UINT4, INT4, FLOAT4E2M1: two per byte
# (op, input slot) pairs that read one row per token of an initializer: an embedding lookup
GATHER_SLOTS = {("Gather", 0), ("GatherBlockQuantized", 0), ("GatherBlockQuantized", 2),
                ("GatherBlockQuantized", 3)}
SAFETENSORS_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                        "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def onnx_weight_bytes(graph_path: str | Path, tokens: int = 1) -> dict:
    """Weight bytes one call of this graph reads, for `tokens` new tokens.

    Each initializer is read whole, except one whose every use is the table of a Gather or
    GatherBlockQuantized (an embedding lookup, its scales and zero points included): that reads
    `tokens` rows. An initializer a gather and a MatMul/MatMulNBits share (a tied embedding) is
    read whole once, by the MatMul. Identity nodes pass an initializer on: their consumers count
    as its uses.
    """
    import onnx

    model = onnx.load(str(graph_path), load_external_data=False)
    uses: dict[str, list[tuple[str, int]]] = {}
    alias: dict[str, str] = {}

    def source(name: str) -> str:
        while name in alias:
            name = alias[name]
        return name

    def walk(graph) -> None:
        for node in graph.node:
            if node.op_type == "Identity":
                alias[node.output[0]] = node.input[0]
                continue
            for slot, name in enumerate(node.input):
                uses.setdefault(source(name), []).append((node.op_type, slot))
            for attr in node.attribute:  # subgraphs (If/Loop/Scan) use outer initializers too
                for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    walk(sub)

    walk(model.graph)
    total, gathered, full = 0, 0, 0
    for init in model.graph.initializer:
        count = int(np.prod(init.dims, dtype=np.int64))
        size = (count + 1) // 2 if init.data_type in ONNX_4BIT else count * ONNX_ITEMSIZE.get(init.data_type, 4)
        use = uses.get(init.name, [])
        if not use:
            continue  # never read
        if init.dims and all(u in GATHER_SLOTS for u in use):
            rows = int(init.dims[0])
            read = min(size, tokens * (size // max(rows, 1)))
            gathered += read
        else:
            read = size
            full += read
        total += read
    return {"bytes_per_pass": total, "whole_bytes": full, "gathered_bytes": gathered, "tokens": tokens,
            "source": str(graph_path)}


def hf_weight_bytes(hf_dir: str | Path, tokens: int = 1) -> dict:
    """The same count for a Hugging Face dir's safetensors, as a PyTorch forward reads them.

    The embedding gathers `tokens` rows; with tie_word_embeddings the LM head is that same
    tensor, read whole once (safetensors stores it once); untied, lm_head.weight is read whole.
    """
    hf_dir = Path(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    tied = bool(config.get("tie_word_embeddings", False))
    shapes = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, meta in header.items():
            if name != "__metadata__":
                shapes[name] = (meta["shape"], SAFETENSORS_ITEMSIZE.get(meta["dtype"], 4))
    total, gathered = 0, 0
    for name, (shape, item) in shapes.items():
        size = int(np.prod(shape, dtype=np.int64)) * item
        if name.endswith("embed_tokens.weight") and not tied:
            read = min(size, tokens * size // max(int(shape[0]), 1))
            gathered += read
        else:
            read = size
        total += read
    return {"bytes_per_pass": total, "gathered_bytes": gathered, "tied": tied, "tokens": tokens, "source": str(hf_dir)}


def kv_bytes(num_layers: int, num_kv_heads: int, head_dim: int, context: float, itemsize: int) -> float:
    """Bytes of keys and values the attention of one pass reads at `context` past positions."""
    return 2.0 * num_layers * num_kv_heads * head_dim * context * itemsize


def share(passes_per_s: float, bytes_per_pass: float, bandwidth_gbs: float) -> float:
    """Fraction of the machine's read bandwidth a system's target passes use."""
    return passes_per_s * bytes_per_pass / (bandwidth_gbs * 1e9)
