"""Thin export wrapper: an HF Llama-family causal LM as a graph with plain tensor I/O.

It reuses the HF model's own submodules (embeddings, projections, norms, MLP,
rotary embedding) and rewrites only the attention glue, so past KV comes in as
plain tensors, the tree mask is explicit, and only the new tokens' KV comes out.
Nothing of transformers is forked or patched.
"""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

from ..runtime.graph_contract import KVGeometry
from .hf_loading import longrope_window


class DecoderGraph(torch.nn.Module):
    """forward(input_ids, position_ids, tree_mask, *past) -> logits, hidden, *presents
    (runtime/graph_contract.decoder_io names them).

    past and presents alternate key/value per layer, each [1, len, kv_heads, head_dim]
    (sequence-major so the runtime can feed a prefix of its cache buffer without a copy).
    `extra_feature_layers` adds a `features` output: the listed decoder layers'
    output hidden states concatenated (EAGLE-3 drafts from three of them).
    """

    def __init__(self, causal_lm: torch.nn.Module, extra_feature_layers: tuple[int, ...] = ()):
        super().__init__()
        self.lm = causal_lm
        geometry = KVGeometry.from_config(causal_lm.config)
        self.num_heads, self.num_kv_heads, self.head_dim = geometry.num_heads, geometry.num_kv_heads, geometry.head_dim
        self.extra_feature_layers = tuple(extra_feature_layers)
        original_frequencies(causal_lm.model.rotary_emb)

    def _attention(self, layer, x, cos, sin, past_k, past_v, tree_mask):
        attn = layer.self_attn
        t = x.shape[1]
        q = attn.q_proj(x).view(1, t, self.num_heads, self.head_dim)
        k = attn.k_proj(x).view(1, t, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(x).view(1, t, self.num_kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3 normalizes each head before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        new_k = k.transpose(1, 2)  # back to [1, T, kv_heads, D]
        keys = repeat_kv(torch.cat([past_k, new_k], 1).transpose(1, 2), self.num_heads // self.num_kv_heads)
        vals = repeat_kv(torch.cat([past_v, v], 1).transpose(1, 2), self.num_heads // self.num_kv_heads)
        scale = getattr(attn, "scaling", self.head_dim**-0.5)
        scores = torch.matmul(q, keys.transpose(2, 3)).float() * scale  # [1, H, T, P+T]
        # All past is visible; among the new tokens the tree mask decides.
        past_scores, new_scores = scores[..., :-t], scores[..., -t:]
        new_scores = new_scores.masked_fill(~tree_mask[:, None], torch.finfo(torch.float32).min)
        probs = torch.softmax(torch.cat([past_scores, new_scores], -1), dim=-1).to(vals.dtype)
        out = torch.matmul(probs, vals).transpose(1, 2).reshape(1, t, self.num_heads * self.head_dim)
        return attn.o_proj(out), new_k, v

    def forward(self, input_ids, position_ids, tree_mask, *past):
        body = self.lm.model
        h = body.embed_tokens(input_ids)
        cos, sin = rotate(body.rotary_emb, h, position_ids)
        presents, features = [], []
        for i, layer in enumerate(body.layers):
            attn_out, new_k, new_v = self._attention(
                layer, layer.input_layernorm(h), cos, sin, past[2 * i], past[2 * i + 1], tree_mask
            )
            h = h + attn_out
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            presents += [new_k, new_v]
            if i in self.extra_feature_layers:
                features.append(h.float())
        hidden = body.norm(h)
        logits = self.lm.lm_head(hidden).float()
        outs = [logits, hidden.float()]
        if self.extra_feature_layers:
            outs.append(torch.cat(features, -1))
        return (*outs, *presents)



def rotate(rotary_emb, h, position_ids):
    """cos/sin of the model's own rotary module at `position_ids`. A longrope module first picks its
    factors by the call's length, and transformers 5 does it with an in-place copy the ONNX exporter
    cannot trace; an export stays within the window where it picks the short ones (export/exporter.py),
    so its rotation is called without that step, on the short factors."""
    if longrope_window(rotary_emb.config) is not None:
        plain = getattr(type(rotary_emb).forward, "__wrapped__", None)
        if plain is not None:
            return plain(rotary_emb, h, position_ids)
    return rotary_emb(h, position_ids)


def frequency_window(rotary_emb) -> int | None:
    """The length past which the model's rotary module rotates every position of a call differently:
    a longrope module's switch to its long factors (hf_loading.longrope_window), a dynamic-NTK module's
    rescaling (transformers rescales once a call reaches past `original_max_seq_len`, the config's
    max_position_embeddings). A RoPE table built in calls within it holds the rotation each position
    gets inside the context. None: the module's frequencies never change."""
    window = longrope_window(rotary_emb.config)
    if window is None and "dynamic" in str(getattr(rotary_emb, "rope_type", "")):
        window = getattr(rotary_emb, "original_max_seq_len", None)
    return window


def original_frequencies(rotary_emb) -> None:
    """Put back a rotary module's frequencies as within its window (outside any trace), as transformers'
    own reset does: a call past it (the fused RoPE table's last rows, scratch positions past the
    context) leaves longrope's long factors, or dynamic NTK's rescaled ones, in the module."""
    if frequency_window(rotary_emb) is not None and hasattr(rotary_emb, "original_inv_freq"):
        # a copy: transformers 5 switches longrope's factors by copying into inv_freq in place, which would
        # overwrite the original frequencies were inv_freq that very tensor
        rotary_emb.register_buffer("inv_freq", rotary_emb.original_inv_freq.clone(), persistent=False)
        if hasattr(rotary_emb, "original_max_seq_len") and hasattr(rotary_emb, "max_seq_len_cached"):
            rotary_emb.max_seq_len_cached = rotary_emb.original_max_seq_len
