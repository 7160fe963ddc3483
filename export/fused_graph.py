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

Inputs: input_ids, position_ids [1, T] int64; tree_mask [1, T, T] bool;
past_length [1] int64 (rows of the buffer already filled); past_key.i /
past_value.i [1, kv_heads, S, D]. Outputs: logits, hidden, [features],
present_key.i / present_value.i (the same buffers, S rows).
The graph is built directly from the HF modules' weights; the PyTorch reference
of the portable wrapper checks it (export/check.py).
"""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from ..runtime.errors import SpecDeployError

OPSET = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
FUSED_DTYPES = ("float32",)  # ORT's CPU kernels for these contrib ops are fastest (and tested) in fp32


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().numpy()


class _Builder:
    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0

    def init(self, name: str, array: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "", **attrs) -> list[str]:
        self._n += 1
        outs = [f"{op_type.lower()}_{self._n}_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=f"{op_type}_{self._n}", domain=domain, **attrs))
        return outs

    def linear(self, x: str, modules: list[torch.nn.Linear], name: str) -> str:
        """x @ W.T (+ b) for one or several Linear layers sharing the input (their outputs concatenated)."""
        w = np.concatenate([_np(m.weight).T for m in modules], axis=1)
        (y,) = self.op("MatMul", [x, self.init(f"{name}.weight", w)])
        if any(m.bias is not None for m in modules):
            b = np.concatenate([_np(m.bias) if m.bias is not None else np.zeros(m.out_features, np.float32)
                                for m in modules])
            (y,) = self.op("Add", [y, self.init(f"{name}.bias", b)])
        return y


def _check_supported(cfg) -> None:
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise SpecDeployError(f"fused graphs support the silu MLP only (this model has hidden_act={act!r})")


def build_fused_decoder(causal_lm, tokens: int, max_positions: int,
                        feature_layers: tuple[int, ...] = ()) -> onnx.ModelProto:
    """The fused graph of an HF Llama-family causal LM for a static token count `tokens`."""
    cfg = causal_lm.config
    _check_supported(cfg)
    body = causal_lm.model
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    eps = float(cfg.rms_norm_eps)
    t = tokens
    b = _Builder()

    # RoPE tables from the model's own rotary module, so every rope_scaling variant is honoured.
    with torch.no_grad():
        probe = torch.zeros(1, 1, cfg.hidden_size)
        cos, sin = body.rotary_emb(probe, torch.arange(max_positions)[None])
    half = head_dim // 2
    cos_cache = b.init("rope.cos", _np(cos[0, :, :half]))
    sin_cache = b.init("rope.sin", _np(sin[0, :, :half]))

    # Lengths GroupQueryAttention wants: seqlens_k = total - 1 per batch row, total as a scalar.
    (past32,) = b.op("Cast", ["past_length"], to=TensorProto.INT32)
    (seqlens_k,) = b.op("Add", [past32, b.init("t_minus_1", np.array([t - 1], np.int32))])
    (total1,) = b.op("Add", [past32, b.init("t_count", np.array([t], np.int32))])
    (total,) = b.op("Squeeze", [total1])
    attn_bias = ""
    if t > 1:  # the tree among the new tokens as an additive bias; the whole past is visible
        minf = np.finfo(np.float32).min
        (new_bias,) = b.op("Where", ["tree_mask", b.init("zero_f", np.array(0, np.float32)),
                                     b.init("minf", np.array(minf, np.float32))])
        (new_bias,) = b.op("Unsqueeze", [new_bias, b.init("axis1", np.array([1], np.int64))])
        (shape,) = b.op("Concat", [b.init("bias_lead", np.array([1, 1, t], np.int64)), "past_length"], axis=0)
        (past_bias,) = b.op("ConstantOfShape", [shape], value=numpy_helper.from_array(np.zeros(1, np.float32)))
        (attn_bias,) = b.op("Concat", [past_bias, new_bias], axis=3)

    (h,) = b.op("Gather", [b.init("embed.weight", _np(body.embed_tokens.weight)), "input_ids"])
    pending = None  # the last sub-block's output, not yet added to the residual stream h
    features, presents = [], []

    def norm(weight: torch.Tensor, name: str) -> str:
        """RMSNorm of h + pending; updates h to the sum (one fused node when there is a pending add)."""
        nonlocal h, pending
        gamma = b.init(name, _np(weight))
        if pending is None:
            (y,) = b.op("SimplifiedLayerNormalization", [h, gamma], epsilon=eps, axis=-1)
            return y
        y, _, _, h = b.op("SkipSimplifiedLayerNormalization", [pending, h, gamma], n_out=4,
                          domain="com.microsoft", epsilon=eps)
        pending = None
        return y

    for i, layer in enumerate(body.layers):
        attn, p = layer.self_attn, f"layers.{i}"
        x = norm(layer.input_layernorm.weight, f"{p}.input_norm")
        if i - 1 in feature_layers:
            features.append(h)
        qkv = b.linear(x, [attn.q_proj, attn.k_proj, attn.v_proj], f"{p}.qkv")
        gqa_in = [qkv, "", ""]
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm per head on q and k before RoPE
            q, k, v = b.op("Split", [qkv, b.init(f"{p}.qkv_split",
                           np.array([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], np.int64))],
                           n_out=3, axis=2)
            normed = []
            for tag, x_, n_, mod in (("q", q, heads, attn.q_norm), ("k", k, kv_heads, attn.k_norm)):
                (r,) = b.op("Reshape", [x_, b.init(f"{p}.{tag}_heads", np.array([1, t, n_, head_dim], np.int64))])
                (r,) = b.op("SimplifiedLayerNormalization", [r, b.init(f"{p}.{tag}_norm", _np(mod.weight))],
                            epsilon=float(mod.variance_epsilon), axis=-1)
                (r,) = b.op("Reshape", [r, b.init(f"{p}.{tag}_flat", np.array([1, t, n_ * head_dim], np.int64))])
                normed.append(r)
            gqa_in = [normed[0], normed[1], v]
        past_k, past_v = f"past_key.{i}", f"past_value.{i}"
        scale = float(getattr(attn, "scaling", head_dim ** -0.5))
        (ctx, pk, pv) = b.op(
            "GroupQueryAttention",
            gqa_in + [past_k, past_v, seqlens_k, total, cos_cache, sin_cache, "position_ids", attn_bias],
            n_out=3, domain="com.microsoft", num_heads=heads, kv_num_heads=kv_heads, scale=scale,
            do_rotary=1, rotary_interleaved=0,
        )
        presents += [(f"present_key.{i}", pk), (f"present_value.{i}", pv)]
        pending = b.linear(ctx, [attn.o_proj], f"{p}.o")
        x = norm(layer.post_attention_layernorm.weight, f"{p}.post_norm")
        mlp = layer.mlp
        gate = b.linear(x, [mlp.gate_proj], f"{p}.gate")
        up = b.linear(x, [mlp.up_proj], f"{p}.up")
        (sig,) = b.op("Sigmoid", [gate])
        (act,) = b.op("Mul", [gate, sig])
        (act,) = b.op("Mul", [act, up])
        pending = b.linear(act, [mlp.down_proj], f"{p}.down")
    hidden = norm(body.norm.weight, "final_norm")
    if len(body.layers) - 1 in feature_layers:
        features.append(h)
    logits = b.linear(hidden, [causal_lm.lm_head], "lm_head")

    def rename(src: str, dst: str) -> None:
        b.nodes.append(helper.make_node("Identity", [src], [dst], name=f"out_{dst}"))

    rename(logits, "logits")
    rename(hidden, "hidden")
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, t, cfg.vocab_size]),
               helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [1, t, cfg.hidden_size])]
    if feature_layers:
        (feat,) = b.op("Concat", features, axis=2)
        rename(feat, "features")
        outputs.append(helper.make_tensor_value_info("features", TensorProto.FLOAT,
                                                     [1, t, cfg.hidden_size * len(feature_layers)]))
    kv_shape = [1, kv_heads, "cache_len", head_dim]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, t]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, t]),
              helper.make_tensor_value_info("tree_mask", TensorProto.BOOL, [1, t, t]),
              helper.make_tensor_value_info("past_length", TensorProto.INT64, [1])]
    for i in range(len(body.layers)):
        inputs += [helper.make_tensor_value_info(f"past_{kind}.{i}", TensorProto.FLOAT, kv_shape)
                   for kind in ("key", "value")]
    for name, src in presents:
        rename(src, name)
        outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, kv_shape))
    graph = helper.make_graph(b.nodes, f"fused_decoder_t{t}", inputs, outputs, b.inits)
    model = helper.make_model(graph, opset_imports=OPSET, producer_name="specdeploy")
    model.ir_version = 8
    return model


def fused_feeds(portable_feeds: dict[str, np.ndarray], tokens: int, slack: int = 3) -> dict[str, np.ndarray]:
    """The fused graph's inputs for the same call as a portable graph's feeds.

    The past moves into buffers of past + tokens + slack rows (head-major), so the
    check also sees that rows beyond the new tokens are left alone.
    """
    out = {k: portable_feeds[k] for k in ("input_ids", "position_ids", "tree_mask")}
    past = None
    for name, value in portable_feeds.items():
        if name.startswith("past_"):
            past = value.shape[1]
            buf = np.zeros((1, value.shape[2], past + tokens + slack, value.shape[3]), value.dtype)
            buf[0, :, :past] = value[0].transpose(1, 0, 2)
            out[name] = buf
    out["past_length"] = np.array([past], np.int64)
    return out


def fused_reference(feeds: dict[str, np.ndarray], portable_outputs: dict[str, np.ndarray],
                    tokens: int) -> dict[str, np.ndarray]:
    """Expected fused outputs: the portable outputs, with new KV rows written into the buffers."""
    out = {k: v for k, v in portable_outputs.items() if not k.startswith("present_")}
    past = int(feeds["past_length"][0])
    for name, value in portable_outputs.items():
        if name.startswith("present_"):
            buf = feeds[name.replace("present_", "past_")].copy()
            buf[0, :, past : past + tokens] = value[0].transpose(1, 0, 2)
            out[name] = buf
    return out
