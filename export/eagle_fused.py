"""The EAGLE head as a fused ORT-CPU graph (see fused_graph.py), beside its portable twin.

Same I/O as the portable `eagle_draft` graph (runtime/graph_contract.eagle_draft_io) except that the KV
cache is the whole head-major buffer, bound as past and present and written in
place, with `past_length` saying how many rows are filled. The tree_mask covers
the last S keys (earlier draft levels + the T new rows); keys before them are
visible to every row.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper
from torch import nn

from ..runtime.graph_contract import (
    FEATURES,
    FUSED,
    HIDDEN,
    INPUT_IDS,
    PAST_LENGTH,
    POSITION_IDS,
    TOKENS_DIM,
    TOPK_IDS,
    TOPK_LOGPROBS,
    TREE_MASK,
    KVGeometry,
    eagle_draft_io,
)
from .eagle_heads import EagleHead
from .fused_graph import AttentionShape, GraphBuilder, check_fusable, float32_array


def build_fused_eagle_head(head: EagleHead, tokens: int, width: int, top_k: int,
                           max_positions: int) -> onnx.ModelProto:
    """The head's fused graph reading `width`-wide features, for the record of static T `tokens`.
    T is dynamic (as in fused_graph.py): the graphs of one width are the same file content,
    so the runtime opens one session per width and holds the head's weights once per width."""
    if tokens < 1:
        raise ValueError(f"a head graph needs T >= 1, got {tokens}")
    cfg, t = head.cfg, TOKENS_DIM
    check_fusable(cfg)
    eps = float(cfg.rms_norm_eps)
    shape = AttentionShape(None, KVGeometry(head.num_layers, head.num_heads, head.num_kv_heads, head.head_dim))
    b = GraphBuilder(wide_mask=True)
    rope = b.rope_tables(head.rotary_emb, head.hidden_size, head.head_dim, max_positions)
    lengths = b.attention_lengths()
    (emb,) = b.op("Gather", [b.init("embed.weight", float32_array(head.embed_tokens.weight)), INPUT_IDS])

    def residual(h: str, x: str) -> str:
        (y,) = b.op("Add", [h, x])
        return y

    if head.version == 1:
        (cat,) = b.op("Concat", [emb, FEATURES], axis=2)
        h = b.linear(cat, [head.fc], "fc")
        for i, layer in enumerate(head.layers):
            norm_in = layer.input_layernorm
            x = h if isinstance(norm_in, nn.Identity) else b.rms_norm(h, norm_in.weight, eps, f"layers.{i}.input_norm")
            h = residual(h, b.attention(x, layer.self_attn, i, shape, lengths, rope))
            x = b.rms_norm(h, layer.post_attention_layernorm.weight, eps, f"layers.{i}.post_norm")
            h = residual(h, b.mlp(x, layer.mlp, f"layers.{i}"))
        weight = head.target_lm_head.weight
        if head.vocab_subset is not None:
            weight = weight[head.vocab_subset]
        logits = b.matmul(h, float32_array(weight).T, "lm_head.weight")
    else:
        mid = head.midlayer
        h = b.linear(FEATURES, [head.fc], "fc") if width != head.hidden_size else FEATURES
        (x,) = b.op("Concat", [b.rms_norm(emb, mid.input_layernorm.weight, eps, "input_norm"),
                               b.rms_norm(h, mid.hidden_norm.weight, eps, "hidden_norm")], axis=2)
        h = residual(h, b.attention(x, mid.self_attn, 0, shape, lengths, rope))
        x = b.rms_norm(h, mid.post_attention_layernorm.weight, eps, "post_norm")
        h = residual(h, b.mlp(x, mid.mlp, "mlp"))
        logits = b.linear(b.rms_norm(h, head.norm.weight, eps, "final_norm"), [head.lm_head], "lm_head")
    (logp,) = b.op("LogSoftmax", [logits], axis=-1)
    values, idx = b.op("TopK", [logp, b.init("top_k", np.array([top_k], np.int64))], n_out=2, axis=-1)
    if head.version == 3:  # draft vocabulary -> target ids
        (offset,) = b.op("Gather", [b.init("d2t", head.d2t.numpy().astype(np.int64)), idx])
        (idx,) = b.op("Add", [idx, offset])
    elif head.vocab_subset is not None:
        (idx,) = b.op("Gather", [b.init("vocab_subset", head.vocab_subset.numpy().astype(np.int64)), idx])
    b.rename(values, TOPK_LOGPROBS)
    b.rename(idx, TOPK_IDS)
    b.rename(h, HIDDEN)
    inputs = [helper.make_tensor_value_info(INPUT_IDS, TensorProto.INT64, [1, t]),
              helper.make_tensor_value_info(FEATURES, TensorProto.FLOAT, [1, t, width]),
              helper.make_tensor_value_info(POSITION_IDS, TensorProto.INT64, [1, t]),
              helper.make_tensor_value_info(TREE_MASK, TensorProto.BOOL, [1, t, "mask_len"]),
              helper.make_tensor_value_info(PAST_LENGTH, TensorProto.INT64, [1])]
    outputs = [helper.make_tensor_value_info(TOPK_LOGPROBS, TensorProto.FLOAT, [1, t, top_k]),
               helper.make_tensor_value_info(TOPK_IDS, TensorProto.INT64, [1, t, top_k]),
               helper.make_tensor_value_info(HIDDEN, TensorProto.FLOAT, [1, t, head.hidden_size])]
    return b.model(f"fused_eagle_f{width}", inputs, outputs, shape.kv_heads, shape.head_dim,
                   eagle_draft_io(head.num_layers, FUSED))
