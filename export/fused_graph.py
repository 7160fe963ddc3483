"""The ORT-CPU form of a decoder graph: ONNX Runtime's fused contrib ops, KV updated in place.

The portable graph (decoder_graph.py, standard ONNX ops only) is what TensorRT
builds engines from. ONNX Runtime's CPU provider runs ~70 fused nodes much faster
than ~1,200 small ones, so the same weights are also written as a graph of
com.microsoft ops, one node per job:

- SkipSimplifiedLayerNormalization: residual add + RMSNorm;
- one MatMul for q, k and v together;
- GroupQueryAttention: RoPE from position_ids, the tree as an additive
  attention bias, and the KV cache as a full-length buffer [1, kv_heads, S, D]
  that the runtime binds as both past and present, so new rows are written at
  positions past_length.. in place and nothing of the cache is copied per step.

Inputs (runtime/graph_contract.decoder_io, flavor fused): input_ids, position_ids [1, T] int64;
tree_mask [1, T, T] bool; past_length [1] int64 (rows of the buffer already filled); logit_rows
[1] int64 (0..T: logits of the last that many rows); past_key.i / past_value.i [1, kv_heads, S, D].
Outputs: logits [1, logit_rows, vocab], hidden [1, T, H], [features], present_key.i /
present_value.i (the same buffers, S rows).

T is a dynamic dimension (graph_contract.TOKENS_DIM): one graph, byte-identical for every
static token count of the model, so the runtime opens one ONNX Runtime session per model
and its prepacked weights exist once, not once per T (runtime/backends/sessions.py). The
runtime still calls it at the manifest's static T, so results match static-T graphs bit
for bit and ORT's kernels (GroupQueryAttention with the in-place KV buffer included)
cost the same per call (ARCHITECTURE.md, "Weights once").
The graph is built directly from the HF modules' weights; the PyTorch reference
of the portable wrapper checks it (export/check.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from ..runtime.batching.graph import (
    CONTEXT_ROWS,
    DECODE_TOKENS,
    LOGIT_TOKENS,
    LONE_ROW,
    RUNS,
    SEGMENTS,
    batched_io,
    batched_kv_pairs,
    run_kv_name,
)
from ..runtime.errors import SpecDeployError
from ..runtime.graph_contract import (
    FEATURES,
    FUSED,
    HIDDEN,
    INPUT_IDS,
    KEY,
    LOGIT_ROWS,
    LOGITS,
    PAST_LENGTH,
    POSITION_IDS,
    TOKENS_DIM,
    TREE_MASK,
    VALUE,
    GraphIO,
    KVGeometry,
    decoder_io,
    graph_file,
    is_past,
    is_present,
    past_name,
    past_of,
    present_name,
)
from .decoder_graph import frequency_window, original_frequencies
from .hf_loading import fused_unsupported

OPSET = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
BATCH_DIM = "batch"  # the batched graph's decode rows (build_fused_decoder(batched=True))
FUSED_DTYPES = ("float32",)  # ORT's CPU kernels for these contrib ops are fastest (and tested) in fp32


def float32_array(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().numpy()


class GraphBuilder:
    """Nodes and initializers of one fused graph, with the blocks every Llama-family graph shares."""

    def __init__(self, wide_mask: bool = False):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.presents: list[tuple[str, str]] = []  # (graph output name, tensor)
        self.kv_shapes: dict[str, list] = {}  # KV inputs/outputs not shaped [1, kv_heads, "cache_len", D]
        self.wide_mask = wide_mask  # tree_mask has columns beyond the T new tokens (EAGLE head)
        # A second branch of an If over the same modules (the batched graph's lone-row branch): an
        # initializer too big to compare that is asked for again by name is the one already held.
        self.reuse_weights = False
        self._n = 0
        self._named: dict[str, np.ndarray | None] = {}  # small constants kept to compare (weights are not)

    def init(self, name: str, array: np.ndarray) -> str:
        """An initializer; asking again for a small constant's name with the same value reuses it."""
        array = np.ascontiguousarray(array)
        if name in self._named:
            known = self._named[name]
            if known is None and self.reuse_weights:
                return name
            if known is None or known.dtype != array.dtype or not np.array_equal(known, array):
                raise AssertionError(f"initializer {name} defined twice with different values")
            return name
        self._named[name] = array if array.size <= 16 else None
        self.inits.append(numpy_helper.from_array(array, name))
        return name

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "", **attrs) -> list[str]:
        self._n += 1
        outs = [f"{op_type.lower()}_{self._n}_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=f"{op_type}_{self._n}", domain=domain, **attrs))
        return outs

    def linear(self, x: str, modules: list[torch.nn.Linear], name: str) -> str:
        """x @ W.T (+ b) for one or several Linear layers sharing the input (their outputs concatenated)."""
        w = np.concatenate([float32_array(m.weight).T for m in modules], axis=1)
        (y,) = self.op("MatMul", [x, self.init(f"{name}.weight", w)])
        if any(m.bias is not None for m in modules):
            b = np.concatenate([float32_array(m.bias) if m.bias is not None else np.zeros(m.out_features, np.float32)
                                for m in modules])
            (y,) = self.op("Add", [y, self.init(f"{name}.bias", b)])
        return y


    def matmul(self, x: str, weight: np.ndarray, name: str) -> str:
        """x @ weight, weight given as [in, out]."""
        (y,) = self.op("MatMul", [x, self.init(name, weight)])
        return y

    def rename(self, src: str, dst: str) -> None:
        self.nodes.append(helper.make_node("Identity", [src], [dst], name=f"out_{dst}"))

    def rope_tables(self, rotary_emb, hidden_size: int, head_dim: int, max_positions: int) -> tuple[str, str]:
        """cos/sin caches [positions, D/2] from the model's own rotary module (any rope_scaling)."""
        # Positions in calls within the module's frequency window (decoder_graph.frequency_window): one call
        # over all of them would take longrope's long factors or dynamic NTK's rescaled frequencies, which
        # transformers uses only past it (the batched graph's table reaches a scratch row past the context).
        step = frequency_window(rotary_emb) or max_positions
        with torch.no_grad():
            parts = [rotary_emb(torch.zeros(1, 1, hidden_size), torch.arange(a, min(a + step, max_positions))[None])
                     for a in range(0, max_positions, step)]
        cos, sin = (torch.cat([p[i] for p in parts], dim=1) for i in (0, 1))
        original_frequencies(rotary_emb)  # a call past the window left other frequencies in the module
        half = head_dim // 2
        return (self.init("rope.cos", float32_array(cos[0, :, :half])),
                self.init("rope.sin", float32_array(sin[0, :, :half])))

    def attention_lengths(self, t: int | None = None) -> tuple[str, str, str]:
        """GroupQueryAttention's lengths (seqlens_k = total - 1, total as a scalar) and the additive
        bias: every key before the tree_mask's columns is visible, the mask decides among its
        last S columns (S = T for decoders; earlier draft rows + T for the EAGLE head).
        `t`: a static token count; None reads T from input_ids (a dynamic-T graph)."""
        if t is None:
            (ids_shape,) = self.op("Shape", [INPUT_IDS])
            (tokens,) = self.op("Slice", [ids_shape, self.init("i1", np.array([1], np.int64)),
                                          self.init("i2", np.array([2], np.int64))])
            (t_count,) = self.op("Cast", [tokens], to=TensorProto.INT32)
            (t_minus_1,) = self.op("Sub", [t_count, self.init("one_i32", np.array([1], np.int32))])
        else:
            tokens = self.init("t_i64", np.array([t], np.int64))
            t_minus_1 = self.init("t_minus_1", np.array([t - 1], np.int32))
            t_count = self.init("t_count", np.array([t], np.int32))
        (past32,) = self.op("Cast", [PAST_LENGTH], to=TensorProto.INT32)
        (seqlens_k,) = self.op("Add", [past32, t_minus_1])
        (total1,) = self.op("Add", [past32, t_count])
        (total,) = self.op("Squeeze", [total1])
        if t == 1 and not self.wide_mask:  # one new token, static: plain causal attention
            return seqlens_k, total, ""
        minf = np.finfo(np.float32).min
        (masked,) = self.op("Where", [TREE_MASK, self.init("zero_f", np.array(0, np.float32)),
                                      self.init("minf", np.array(minf, np.float32))])
        (masked,) = self.op("Unsqueeze", [masked, self.init("axis1", np.array([1], np.int64))])
        if self.wide_mask:  # keys the mask does not cover: total - its S columns
            (mask_shape,) = self.op("Shape", [TREE_MASK])
            (mask_cols,) = self.op("Slice", [mask_shape, self.init("i2", np.array([2], np.int64)),
                                             self.init("i3", np.array([3], np.int64))])
            (free,) = self.op("Cast", [total1], to=TensorProto.INT64)
            (free,) = self.op("Sub", [free, mask_cols])
        else:  # the mask covers the T new rows: every cached row is visible
            free = PAST_LENGTH
        (shape,) = self.op("Concat", [self.init("bias_lead11", np.array([1, 1], np.int64)), tokens, free], axis=0)
        (zeros,) = self.op("ConstantOfShape", [shape], value=numpy_helper.from_array(np.zeros(1, np.float32)))
        (bias,) = self.op("Concat", [zeros, masked], axis=3)
        return seqlens_k, total, bias

    def qkv(self, x: str, attn, layer: int, shape: "AttentionShape") -> list[str]:
        """GroupQueryAttention's q/k/v inputs: one MatMul (packed), or q, k, v apart when the
        model normalizes q and k per head (Qwen3)."""
        p, t = f"layers.{layer}", shape.t if shape.t is not None else -1  # -1: Reshape infers a dynamic T
        heads, kv_heads, head_dim = shape.heads, shape.kv_heads, shape.head_dim
        qkv = self.linear(x, [attn.q_proj, attn.k_proj, attn.v_proj], f"{p}.qkv")
        if not hasattr(attn, "q_norm"):
            return [qkv, "", ""]
        # Qwen3: RMSNorm per head on q and k before RoPE
        q, k, v = self.op("Split", [qkv, self.init(f"{p}.qkv_split",
                          np.array([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], np.int64))],
                          n_out=3, axis=2)
        normed = []
        for tag, x_, n_, mod in (("q", q, heads, attn.q_norm), ("k", k, kv_heads, attn.k_norm)):
            heads_shape = np.array([1, t, n_, head_dim], np.int64)
            (r,) = self.op("Reshape", [x_, self.init(f"{p}.{tag}_heads", heads_shape)])
            gamma = self.init(f"{p}.{tag}_norm", float32_array(mod.weight))
            (r,) = self.op("SimplifiedLayerNormalization", [r, gamma],
                           epsilon=float(mod.variance_epsilon), axis=-1)
            flat_shape = np.array([1, t, n_ * head_dim], np.int64)
            (r,) = self.op("Reshape", [r, self.init(f"{p}.{tag}_flat", flat_shape)])
            normed.append(r)
        return [normed[0], normed[1], v]

    def gqa(self, qkv: list[str], attn, shape: "AttentionShape", kv: tuple[str, str], lengths, rope,
            positions: str) -> tuple[str, str, str]:
        """One GroupQueryAttention node over the KV buffers `kv` (past key, past value names):
        (context, present key, present value)."""
        seqlens_k, total, bias = lengths
        scale = float(getattr(attn, "scaling", shape.head_dim ** -0.5))
        ctx, pk, pv = self.op(
            "GroupQueryAttention", qkv + [*kv, seqlens_k, total, *rope, positions, bias],
            n_out=3, domain="com.microsoft", num_heads=shape.heads, kv_num_heads=shape.kv_heads, scale=scale,
            do_rotary=1, rotary_interleaved=0,
        )
        return ctx, pk, pv

    def attention(self, x: str, attn, layer: int, shape: "AttentionShape", lengths, rope) -> str:
        """q/k/v in one MatMul, GroupQueryAttention with the KV buffers of `layer`, o_proj."""
        qkv = self.qkv(x, attn, layer, shape)
        ctx, pk, pv = self.gqa(qkv, attn, shape, (past_name(layer, KEY), past_name(layer, VALUE)), lengths, rope,
                               POSITION_IDS)
        self.presents += [(present_name(layer, KEY), pk), (present_name(layer, VALUE), pv)]
        return self.linear(ctx, [attn.o_proj], f"layers.{layer}.o")

    def mlp(self, x: str, mlp, name: str) -> str:
        gate = self.linear(x, [mlp.gate_proj], f"{name}.gate")
        up = self.linear(x, [mlp.up_proj], f"{name}.up")
        (sig,) = self.op("Sigmoid", [gate])
        (act,) = self.op("Mul", [gate, sig])
        (act,) = self.op("Mul", [act, up])
        return self.linear(act, [mlp.down_proj], f"{name}.down")

    def last_rows(self, x: str, count: str) -> str:
        """x [1, T, ...] -> its last `count` rows (a [1] int64 graph input, 0..T)."""
        (shape,) = self.op("Shape", [x])
        (rows,) = self.op("Slice", [shape, self.init("i1", np.array([1], np.int64)),
                                    self.init("i2", np.array([2], np.int64))])
        (start,) = self.op("Sub", [rows, count])
        (out,) = self.op("Slice", [x, start, rows, self.init("i1", np.array([1], np.int64))])
        return out

    def rms_norm(self, x: str, weight: torch.Tensor, eps: float, name: str) -> str:
        gamma = self.init(name, float32_array(weight))
        (y,) = self.op("SimplifiedLayerNormalization", [x, gamma], epsilon=eps, axis=-1)
        return y

    def model(self, name: str, inputs: list, outputs: list, kv_heads: int, head_dim: int,
              io: GraphIO) -> onnx.ModelProto:
        """The graph with the KV buffers (the inputs of `io` not in `inputs`) as inputs and (aliased)
        outputs; its I/O must be `io`."""
        kv_shape = [1, kv_heads, "cache_len", head_dim]
        given = {v.name for v in inputs}
        inputs = list(inputs) + [helper.make_tensor_value_info(n, TensorProto.FLOAT, self.kv_shapes.get(n, kv_shape))
                                 for n in io.inputs if n not in given]
        outputs = list(outputs)
        for out_name, src in self.presents:
            self.rename(src, out_name)
            outputs.append(helper.make_tensor_value_info(out_name, TensorProto.FLOAT,
                                                         self.kv_shapes.get(out_name, kv_shape)))
        built = GraphIO(tuple(v.name for v in inputs), tuple(v.name for v in outputs))
        if built != io:
            raise AssertionError(f"fused graph {name} has I/O {built}, the graph contract says {io}")
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.inits)
        model = helper.make_model(graph, opset_imports=OPSET, producer_name="specdeploy")
        model.ir_version = 8
        return model


class AttentionShape:
    def __init__(self, t: int | None, geometry: KVGeometry):  # t None: dynamic
        self.t, self.heads = t, geometry.num_heads
        self.kv_heads, self.head_dim = geometry.num_kv_heads, geometry.head_dim


class BatchPlan:
    """The batched graph's attention (runtime/batching/graph.py lays out its calls): the decode
    rows' one GroupQueryAttention (batch D, T = 1, each row its own past length) and one of
    batch 1 per run of several tokens (its own past, tree and buffers: the batch-1 graph's
    call for that row). Their lengths, positions and biases are computed once per call here;
    each layer gathers (decode part) or slices (runs) its q/k/v from the call's tokens, and
    gathers the parts' contexts back into token order (context_rows), so a part without a
    token of its own (it reads another's) adds no row to the linear layers."""

    def __init__(self, b: GraphBuilder, runs: int, lone: bool = False):
        self.b, self.lone = b, lone
        self.axis1 = b.init("axis_1", np.array([1], np.int64))
        if lone:  # one row's tokens, all of run 0's (build_batched_decoder's lone-row branch)
            self.runs = [self._run(0)]
            return
        (self.rows,) = b.op("Shape", [PAST_LENGTH])  # [1]: D
        (pos,) = b.op("Gather", [POSITION_IDS, DECODE_TOKENS], axis=1)
        (self.decode_positions,) = b.op("Reshape", [pos, b.init("rows_by_1", np.array([-1, 1], np.int64))])
        (past32,) = b.op("Cast", [PAST_LENGTH], to=TensorProto.INT32)
        (total1,) = b.op("Add", [past32, b.init("one_i32", np.array([1], np.int32))])
        (total,) = b.op("ReduceMax", [total1], keepdims=0)  # GQA reads keys up to each row's own seqlens_k
        (total64,) = b.op("Cast", [total], to=TensorProto.INT64)
        (total64,) = b.op("Unsqueeze", [total64, b.init("axis_0", np.array([0], np.int64))])
        (shape,) = b.op("Concat", [self.rows, b.init("ones_2", np.array([1, 1], np.int64)), total64], axis=0)
        (bias,) = b.op("ConstantOfShape", [shape], value=numpy_helper.from_array(np.zeros(1, np.float32)))
        self.decode = (past32, total, bias)  # seqlens_k: the past (the one new token is the last key)
        self.runs = [self._run(r) for r in range(runs)]

    def _run(self, r: int) -> tuple:
        """(first token, end, positions, GQA lengths) of run r: the batch-1 graph's lengths and
        bias (attention_lengths) for its T tokens and past."""
        b = self.b
        (row,) = b.op("Gather", [SEGMENTS, b.init(f"run{r}", np.array([r], np.int64))], axis=0)
        (row,) = b.op("Squeeze", [row, b.init("axis_0", np.array([0], np.int64))])  # [3]
        start, end, past = (b.op("Slice", [row, b.init(f"i{i}", np.array([i], np.int64)),
                                           b.init(f"i{i + 1}", np.array([i + 1], np.int64))])[0] for i in range(3))
        (positions,) = b.op("Slice", [POSITION_IDS, start, end, self.axis1])
        (tokens,) = b.op("Sub", [end, start])
        (lo,) = b.op("Concat", [start, start], axis=0)
        (hi,) = b.op("Concat", [end, end], axis=0)
        (mask,) = b.op("Slice", [TREE_MASK, lo, hi, b.init("axes_01", np.array([0, 1], np.int64))])
        minf = np.finfo(np.float32).min
        (masked,) = b.op("Where", [mask, b.init("zero_f", np.array(0, np.float32)),
                                   b.init("minf", np.array(minf, np.float32))])
        (masked,) = b.op("Unsqueeze", [masked, b.init("axes_01", np.array([0, 1], np.int64))])
        (past32,) = b.op("Cast", [past], to=TensorProto.INT32)
        (t32,) = b.op("Cast", [tokens], to=TensorProto.INT32)
        (total1,) = b.op("Add", [past32, t32])
        (seqlens_k,) = b.op("Sub", [total1, b.init("one_i32", np.array([1], np.int32))])
        (total,) = b.op("Squeeze", [total1])
        (shape,) = b.op("Concat", [b.init("ones_2", np.array([1, 1], np.int64)), tokens, past], axis=0)
        (zeros,) = b.op("ConstantOfShape", [shape], value=numpy_helper.from_array(np.zeros(1, np.float32)))
        (bias,) = b.op("Concat", [zeros, masked], axis=3)
        return start, end, positions, (seqlens_k, total, bias)

    def attention(self, x: str, attn, layer: int, shape: AttentionShape, rope) -> str:
        b = self.b
        qkv = b.qkv(x, attn, layer, shape)
        kv_names = (past_name(layer, KEY), past_name(layer, VALUE))
        present_names_ = (present_name(layer, KEY), present_name(layer, VALUE))
        if self.lone:  # every token is run 0's, in order: its attention alone, the batch-1 graph's
            ctx, pk, pv = b.gqa(qkv, attn, shape, tuple(run_kv_name(0, n) for n in kv_names), self.runs[0][3],
                                rope, POSITION_IDS)
            b.presents += [(run_kv_name(0, present_names_[0]), pk), (run_kv_name(0, present_names_[1]), pv)]
            return b.linear(ctx, [attn.o_proj], f"layers.{layer}.o")
        rows_shape = b.init("rows_tokens", np.array([-1, 1, 0], np.int64))  # [1, D, C] -> [D, 1, C]
        part = [b.op("Reshape", [b.op("Gather", [q, DECODE_TOKENS], axis=1)[0], rows_shape])[0] if q else ""
                for q in qkv]
        ctx, pk, pv = b.gqa(part, attn, shape, kv_names, self.decode, rope, self.decode_positions)
        b.presents += [(present_names_[0], pk), (present_names_[1], pv)]
        for name in (*kv_names, *present_names_):
            b.kv_shapes[name] = [BATCH_DIM, shape.kv_heads, "cache_len", shape.head_dim]
        (ctx,) = b.op("Reshape", [ctx, b.init("one_row", np.array([1, -1, 0], np.int64))])
        contexts = [ctx]
        # each run's q/k/v slice reshaped to its known width: ONNX Runtime 1.30 cannot infer the
        # width of a Slice inside the If, reads GroupQueryAttention's output width as 0 and
        # refuses the Concat below at load (1.32 accepts it). The Reshape changes no data.
        packed = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
        widths = (packed, 0, 0) if not qkv[1] else (shape.heads * shape.head_dim,
                                                     shape.kv_heads * shape.head_dim,
                                                     shape.kv_heads * shape.head_dim)
        for r, (start, end, positions, lengths) in enumerate(self.runs):
            part = [b.op("Reshape", [b.op("Slice", [q, start, end, self.axis1])[0],
                                     b.init(f"run_tokens_{w}", np.array([1, -1, w], np.int64))])[0] if q else ""
                    for q, w in zip(qkv, widths)]
            names = tuple(run_kv_name(r, n) for n in kv_names)
            ctx, pk, pv = b.gqa(part, attn, shape, names, lengths, rope, positions)
            b.presents += [(run_kv_name(r, present_names_[0]), pk), (run_kv_name(r, present_names_[1]), pv)]
            for name in (*names, *(run_kv_name(r, n) for n in present_names_)):
                b.kv_shapes[name] = [1, shape.kv_heads, f"run{r}_len", shape.head_dim]
            contexts.append(ctx)
        (ctx,) = b.op("Concat", contexts, axis=1)
        (ctx,) = b.op("Gather", [ctx, CONTEXT_ROWS], axis=1)
        return b.linear(ctx, [attn.o_proj], f"layers.{layer}.o")

    @staticmethod
    def inputs(runs: int) -> list:
        """The batched graph's inputs beside input_ids and position_ids, KV buffers aside."""
        t = TOKENS_DIM
        return [helper.make_tensor_value_info(TREE_MASK, TensorProto.BOOL, [t, t]),
                helper.make_tensor_value_info(PAST_LENGTH, TensorProto.INT64, [BATCH_DIM]),
                helper.make_tensor_value_info(SEGMENTS, TensorProto.INT64, [runs, 3]),
                helper.make_tensor_value_info(DECODE_TOKENS, TensorProto.INT64, [BATCH_DIM]),
                helper.make_tensor_value_info(CONTEXT_ROWS, TensorProto.INT64, [t]),
                helper.make_tensor_value_info(LOGIT_TOKENS, TensorProto.INT64, [LOGIT_TOKENS]),
                helper.make_tensor_value_info(LONE_ROW, TensorProto.BOOL, [1])]


def check_fusable(cfg) -> None:
    """The exporters skip fused graphs for such a model (export/hf_loading.py, fused_unsupported)."""
    reason = fused_unsupported(cfg)
    if reason:
        raise SpecDeployError(f"no fused graph for this model: {reason}")


def decoder_body(b: GraphBuilder, causal_lm, attend, feature_layers: tuple[int, ...] = ()) -> tuple[str, list[str]]:
    """The embedding, every layer (`attend(x, attn, layer)` its attention) and the final norm:
    (hidden, the feature layers' residual streams)."""
    body = causal_lm.model
    eps = float(causal_lm.config.rms_norm_eps)
    (h,) = b.op("Gather", [b.init("embed.weight", float32_array(body.embed_tokens.weight)), INPUT_IDS])
    pending = None  # the last sub-block's output, not yet added to the residual stream h
    features = []

    def norm(weight: torch.Tensor, name: str) -> str:
        """RMSNorm of h + pending; updates h to the sum (one fused node when there is a pending add)."""
        nonlocal h, pending
        if pending is None:
            return b.rms_norm(h, weight, eps, name)
        gamma = b.init(name, float32_array(weight))
        y, _, _, h = b.op("SkipSimplifiedLayerNormalization", [pending, h, gamma], n_out=4,
                          domain="com.microsoft", epsilon=eps)
        pending = None
        return y

    for i, layer in enumerate(body.layers):
        x = norm(layer.input_layernorm.weight, f"layers.{i}.input_norm")
        if i - 1 in feature_layers:
            features.append(h)
        pending = attend(x, layer.self_attn, i)
        x = norm(layer.post_attention_layernorm.weight, f"layers.{i}.post_norm")
        pending = b.mlp(x, layer.mlp, f"layers.{i}")
    hidden = norm(body.norm.weight, "final_norm")
    if len(body.layers) - 1 in feature_layers:
        features.append(h)
    return hidden, features


def build_fused_decoder(causal_lm, tokens: int, max_positions: int,
                        feature_layers: tuple[int, ...] = (), batched: bool = False,
                        runs: int = RUNS) -> onnx.ModelProto:
    """The fused graph of an HF Llama-family causal LM, for the record of static T `tokens`.

    T is a dynamic dimension, so the graph (and its file) is the same for every `tokens`:
    the runtime opens it once per model. `tokens` only checks the call.
    `batched`: the graph of many rows in one call (runtime/batching/graph.py: decode rows, and
    `runs` runs of several tokens, each row its own past, tree and KV buffers; BatchPlan). Every
    row of a batched call computes what the batch-1 graph does for it."""
    if tokens < 1:
        raise ValueError(f"a decoder graph needs T >= 1, got {tokens}")
    if batched:
        if feature_layers:
            raise ValueError("the batched graph outputs no layer features")
        return build_batched_decoder(causal_lm, max_positions, runs)
    cfg = causal_lm.config
    check_fusable(cfg)
    body = causal_lm.model
    shape = AttentionShape(None, KVGeometry.from_config(cfg))
    t = TOKENS_DIM
    b = GraphBuilder()
    rope = b.rope_tables(body.rotary_emb, cfg.hidden_size, shape.head_dim, max_positions)
    lengths = b.attention_lengths()

    def attend(x: str, attn, layer: int) -> str:
        return b.attention(x, attn, layer, shape, lengths, rope)

    hidden, features = decoder_body(b, causal_lm, attend, feature_layers)
    # The batch-1 graph scores only its last `logit_rows` rows: a prefill chunk needs one row's
    # logits (or none), and the LM head over every row was ~13-20% of a T=64 call on SmolLM2.
    logits = b.linear(b.last_rows(hidden, LOGIT_ROWS), [causal_lm.lm_head], "lm_head")
    b.rename(logits, LOGITS)
    b.rename(hidden, HIDDEN)
    outputs = [helper.make_tensor_value_info(LOGITS, TensorProto.FLOAT, [1, LOGIT_ROWS, cfg.vocab_size]),
               helper.make_tensor_value_info(HIDDEN, TensorProto.FLOAT, [1, t, cfg.hidden_size])]
    if feature_layers:
        (feat,) = b.op("Concat", features, axis=2)
        b.rename(feat, FEATURES)
        outputs.append(helper.make_tensor_value_info(FEATURES, TensorProto.FLOAT,
                                                     [1, t, cfg.hidden_size * len(feature_layers)]))
    inputs = [helper.make_tensor_value_info(INPUT_IDS, TensorProto.INT64, [1, t]),
              helper.make_tensor_value_info(POSITION_IDS, TensorProto.INT64, [1, t]),
              helper.make_tensor_value_info(TREE_MASK, TensorProto.BOOL, [1, t, t]),
              helper.make_tensor_value_info(PAST_LENGTH, TensorProto.INT64, [1]),
              helper.make_tensor_value_info(LOGIT_ROWS, TensorProto.INT64, [1])]
    io = decoder_io(len(body.layers), bool(feature_layers), FUSED)
    return b.model("fused_decoder", inputs, outputs, shape.kv_heads, shape.head_dim, io)


def build_batched_decoder(causal_lm, max_positions: int, runs: int = RUNS) -> onnx.ModelProto:
    """The batched graph (runtime/batching/graph.py): one If on `lone_row` between two branches
    over the same weights (initializers of the main graph: ORT prepacks each weight once per
    session, whatever the nodes that read it): the call of many rows (decode rows and `runs`
    runs, BatchPlan), and one row's tokens alone as run 0 (the batch-1 graph's nodes: a lone
    row's call carries no attention node of the parts it lacks, ~5 of 38 ms on SmolLM2). The
    lone branch passes the other parts' buffers through untouched. Each branch's KV outputs
    are GroupQueryAttention's own, so the buffers bound as the If's outputs are written in
    place as in the batch-1 graph."""
    cfg = causal_lm.config
    check_fusable(cfg)
    shape = AttentionShape(None, KVGeometry.from_config(cfg))
    t = TOKENS_DIM
    b = GraphBuilder()
    rope = b.rope_tables(causal_lm.model.rotary_emb, cfg.hidden_size, shape.head_dim, max_positions)
    io = batched_io(len(causal_lm.model.layers), runs)
    branches = {}
    for lone in (False, True):
        b.nodes, b.presents, b.reuse_weights = [], [], lone
        plan = BatchPlan(b, runs, lone)

        def attend(x: str, attn, layer: int) -> str:
            return plan.attention(x, attn, layer, shape, rope)

        hidden, _ = decoder_body(b, causal_lm, attend)
        # logits of the tokens `logit_tokens` names only (a prefill chunk needs its last row's, if any)
        (head_in,) = b.op("Gather", [hidden, LOGIT_TOKENS], axis=1)
        made = {LOGITS: b.linear(head_in, [causal_lm.lm_head], "lm_head"), HIDDEN: hidden, **dict(b.presents)}
        for past, present in batched_kv_pairs(len(causal_lm.model.layers), runs):
            if present not in made:  # the lone branch: a part it does not compute keeps its buffer
                (made[present],) = b.op("Identity", [past])
        branches[lone] = helper.make_graph(b.nodes, "lone_row" if lone else "rows", [],
                                           [helper.make_tensor_value_info(made[n], TensorProto.FLOAT, None)
                                            for n in io.outputs])
    b.nodes = [helper.make_node("If", [LONE_ROW], list(io.outputs), name="If_lone_row",
                                then_branch=branches[True], else_branch=branches[False])]
    b.presents = []
    outputs = [helper.make_tensor_value_info(LOGITS, TensorProto.FLOAT, [1, LOGIT_TOKENS, cfg.vocab_size]),
               helper.make_tensor_value_info(HIDDEN, TensorProto.FLOAT, [1, t, cfg.hidden_size])]
    outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, b.kv_shapes[n]) for n in io.outputs[2:]]
    inputs = [helper.make_tensor_value_info(INPUT_IDS, TensorProto.INT64, [1, t]),
              helper.make_tensor_value_info(POSITION_IDS, TensorProto.INT64, [1, t]), *BatchPlan.inputs(runs)]
    return b.model("fused_decoder", inputs, outputs, shape.kv_heads, shape.head_dim, io)


def write_fused(model: onnx.ModelProto | None, out_dir: Path, name: str, weights, portable_feeds: dict,
                portable_outputs: dict, tokens: int, same_as: Path | None = None) -> None:
    """Write a fused graph (weights into the shared file) and its polygraphy reference, derived
    from the portable graph's PyTorch reference for the same call. `model` None: the graph is the
    file `same_as` already written in `out_dir` (its T is dynamic), copied."""
    from .reference import save_reference

    path = out_dir / graph_file(name)
    if model is None:
        assert same_as is not None
        shutil.copyfile(same_as, path)
    else:
        weights.externalize(model, path)
        onnx.save(model, str(path))
    feeds = fused_feeds(portable_feeds, tokens)
    save_reference(out_dir, name, feeds, portable_outputs.map(lambda outs: fused_reference(feeds, outs, tokens)))


def fused_feeds(portable_feeds: dict[str, np.ndarray], tokens: int, slack: int = 3) -> dict[str, np.ndarray]:
    """The fused graph's inputs for the same call as a portable graph's feeds.

    The past moves into buffers of past + tokens + slack rows (head-major), so the
    check also sees that rows beyond the new tokens are left alone.
    """
    out = {k: v for k, v in portable_feeds.items() if not is_past(k)}
    past = None
    for name, value in portable_feeds.items():
        if is_past(name):
            past = value.shape[1]
            buf = np.zeros((1, value.shape[2], past + tokens + slack, value.shape[3]), value.dtype)
            buf[0, :, :past] = value[0].transpose(1, 0, 2)
            out[name] = buf
    out[PAST_LENGTH] = np.array([past], np.int64)
    out[LOGIT_ROWS] = np.array([tokens], np.int64)  # every row's logits: the check compares them all
    return out


def fused_reference(feeds: dict[str, np.ndarray], portable_outputs: dict[str, np.ndarray],
                    tokens: int) -> dict[str, np.ndarray]:
    """Expected fused outputs: the portable outputs, with new KV rows written into the buffers."""
    out = {k: v for k, v in portable_outputs.items() if not is_present(k)}
    past = int(feeds[PAST_LENGTH][0])
    for name, value in portable_outputs.items():
        if is_present(name):
            buf = feeds[past_of(name)].astype(value.dtype)  # float64 for the reference
            buf[0, :, past : past + tokens] = value[0].transpose(1, 0, 2)
            out[name] = buf
    return out
