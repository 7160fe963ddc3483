"""EAGLE draft heads in SafeAILab's published layouts: build, load, check against a target, save.

EAGLE-1/2 (`cnets1.py` upstream): `fc` (2H -> H, with bias) over [token embedding,
target feature], then `layers.N.*` Llama decoder layers whose layer 0 has no
input_layernorm; the target's own LM head turns the predicted feature into logits.
The feature is the target's last hidden state after its final norm.

EAGLE-3 (`cnets.py` upstream): `fc` (3H_target -> H, no bias) over three target
layers' hidden states (only when the input is a target feature; the head's own
output is fed back as is), then `midlayer.*`: one Llama layer whose attention input
is [input_layernorm(embedding), hidden_norm(feature)] (2H wide), then its own `norm`
and `lm_head` over a draft vocabulary mapped to target ids by `d2t` (target = draft
+ d2t[draft]); `t2d` marks target tokens present in the draft vocabulary.

Both are built from transformers' own LlamaDecoderLayer / LlamaRMSNorm / nn.Linear;
`EagleHead.step` is the one forward (training and export share it). It takes an
explicit KV past and a tree mask over the trailing keys, like the decoder graphs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)

from ..runtime.errors import SpecDeployError
from .dir_config import read_dir_config
from .hf_loading import rope_scaling, rope_settings, rope_theta

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# Keys published checkpoints may carry that the head does not need (or takes from the target).
OPTIONAL_KEYS = ("embed_tokens.weight",)


class EagleHead(nn.Module):
    """One EAGLE head; `version` 1 (EAGLE-1/2 layout) or 3 (EAGLE-3 layout)."""

    def __init__(self, version: int, cfg: LlamaConfig, target_hidden: int, target_vocab: int,
                 embed: nn.Embedding, target_lm_head: nn.Linear | None, fc_bias: bool = True):
        super().__init__()
        if version not in (1, 3):
            raise ValueError(f"EAGLE version must be 1 or 3, got {version}")
        self.version, self.cfg = version, cfg
        h = cfg.hidden_size
        self.hidden_size, self.target_hidden, self.target_vocab = h, target_hidden, target_vocab
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
        self.embed_tokens = embed  # frozen: the target's (or the checkpoint's own) embeddings
        self.vocab_subset: torch.Tensor | None = None  # restrict_vocab()
        self.rotary_emb = LlamaRotaryEmbedding(cfg)
        if version == 1:
            self.fc = nn.Linear(2 * h, h, bias=fc_bias)
            self.layers = nn.ModuleList([LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
            self.layers[0].input_layernorm = nn.Identity()  # upstream layer 0 has no input norm
            self.target_lm_head = target_lm_head  # frozen, shared with the target
        else:
            self.fc = nn.Linear(3 * target_hidden, h, bias=False)
            mid = LlamaDecoderLayer(cfg, 0)
            # The attention reads [embedding, feature] side by side: 2H inputs.
            for name in ("q_proj", "k_proj", "v_proj"):
                old = getattr(mid.self_attn, name)
                setattr(mid.self_attn, name, nn.Linear(2 * h, old.out_features, bias=old.bias is not None))
            mid.hidden_norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
            self.midlayer = mid
            self.norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
            draft_vocab = getattr(cfg, "draft_vocab_size", None) or target_vocab
            self.lm_head = nn.Linear(h, draft_vocab, bias=False)
            self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(target_vocab, dtype=torch.bool))

    # ------------------------------------------------------------------ shapes
    @property
    def num_layers(self) -> int:
        return len(self.layers) if self.version == 1 else 1

    @property
    def feature_dim(self) -> int:
        """Width of the target features the head reads (catch-up input)."""
        return self.hidden_size if self.version == 1 else 3 * self.target_hidden

    @property
    def draft_vocab(self) -> int:
        if self.version == 3:
            return self.lm_head.out_features
        return self.target_vocab if self.vocab_subset is None else len(self.vocab_subset)

    def restrict_vocab(self, token_ids) -> None:
        """Draft only among these target tokens (EAGLE-1/2): the LM head shrinks to their rows.

        EAGLE-3's draft vocabulary, applied at export: each draft level reads the LM head
        once, and on a CPU that read is most of a level's cost. Verification is unchanged.
        """
        if self.version != 1:
            raise ValueError("only EAGLE-1/2 heads draft over the target's vocabulary")
        self.vocab_subset = torch.as_tensor(token_ids, dtype=torch.int64)

    def head_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights a published checkpoint holds (not the target's embeddings / LM head)."""
        skip = ("embed_tokens.", "target_lm_head.", "rotary_emb.")
        return {k: v for k, v in self.state_dict().items() if not k.startswith(skip)}

    def _decoder_layers(self) -> list[nn.Module]:
        return list(self.layers) if self.version == 1 else [self.midlayer]

    # ------------------------------------------------------------------ forward
    def _attention(self, attn, x, cos, sin, past_k, past_v, tree_mask):
        b, t = x.shape[:2]
        q = attn.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        new_k = k.transpose(1, 2)  # [b, T, kv_heads, D], sequence-major like the decoder graphs
        groups = self.num_heads // self.num_kv_heads
        keys = repeat_kv(torch.cat([past_k, new_k], 1).transpose(1, 2), groups)
        vals = repeat_kv(torch.cat([past_v, v], 1).transpose(1, 2), groups)
        scores = torch.matmul(q, keys.transpose(2, 3)).float() * self.head_dim**-0.5  # [b, H, T, P+T]
        # Keys before the last S are visible to every row (committed past); the tree
        # mask decides among the last S (earlier draft levels + the new rows).
        s = tree_mask.shape[-1]
        free, masked = scores[..., :-s], scores[..., -s:]
        masked = masked.masked_fill(~tree_mask[:, None], torch.finfo(torch.float32).min)
        probs = torch.softmax(torch.cat([free, masked], -1), dim=-1).to(vals.dtype)
        out = torch.matmul(probs, vals).transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        return attn.o_proj(out), new_k, v

    def step(self, input_ids, features, position_ids, tree_mask, past):
        """-> (next features [b, T, H], presents). `features` is a target feature or the head's own output."""
        emb = self.embed_tokens(input_ids).to(features.dtype)
        cos, sin = self.rotary_emb(emb, position_ids)
        presents = []
        if self.version == 1:
            h = self.fc(torch.cat([emb, features], -1))
            for i, layer in enumerate(self.layers):
                a, k, v = self._attention(layer.self_attn, layer.input_layernorm(h), cos, sin,
                                          past[2 * i], past[2 * i + 1], tree_mask)
                h = h + a
                h = h + layer.mlp(layer.post_attention_layernorm(h))
                presents += [k, v]
            return h, presents
        mid = self.midlayer
        h = self.fc(features) if features.shape[-1] != self.hidden_size else features
        x = torch.cat([mid.input_layernorm(emb), mid.hidden_norm(h)], -1)
        a, k, v = self._attention(mid.self_attn, x, cos, sin, past[0], past[1], tree_mask)
        h = h + a
        h = h + mid.mlp(mid.post_attention_layernorm(h))
        return h, [k, v]

    def logits(self, hidden):
        """Logits over the draft vocabulary (the target's, or a subset of it, for EAGLE-1/2)."""
        if self.version == 3:
            return self.lm_head(self.norm(hidden))
        if self.vocab_subset is None:
            return self.target_lm_head(hidden)
        return nn.functional.linear(hidden, self.target_lm_head.weight[self.vocab_subset])

    def to_target_ids(self, draft_ids):
        if self.version == 3:
            return draft_ids + self.d2t[draft_ids]
        return draft_ids if self.vocab_subset is None else self.vocab_subset[draft_ids]


# ---------------------------------------------------------------- target features (EAGLE-3)


def eagle3_feature_layers(num_layers: int, aux_ids=None) -> tuple[int, ...]:
    """Target decoder layers whose outputs EAGLE-3 reads (DecoderGraph `extra_feature_layers`).

    Upstream collects the hidden states entering layers (2, L//2, L-3), i.e. the
    outputs of layers (1, L//2-1, L-4); a config's `eagle_aux_hidden_state_layer_ids`
    (same convention) overrides. Targets too shallow for that get three layers
    spread low / mid / high below the last (whose output HF reports after the norm).
    """
    if aux_ids is not None:
        ids = [int(i) for i in aux_ids]
        if len(ids) != 3 or len(set(ids)) != 3 or not all(1 <= i <= num_layers for i in ids):
            raise SpecDeployError(f"EAGLE-3 head: eagle_aux_hidden_state_layer_ids {ids} must be 3 distinct "
                                  f"layer ids in [1, {num_layers}] for a {num_layers}-layer target")
        return tuple(sorted(i - 1 for i in ids))
    if num_layers < 4:
        raise SpecDeployError(f"EAGLE-3 reads three target layers below the last; the target has only {num_layers}")
    upstream = (2, num_layers // 2, num_layers - 3)
    if len(set(upstream)) == 3 and list(upstream) == sorted(upstream):
        return tuple(i - 1 for i in upstream)
    return tuple(round(i * (num_layers - 2) / 2) for i in range(3))


# ---------------------------------------------------------------- loading


def read_weights(head_dir: Path) -> dict[str, torch.Tensor]:
    """model.safetensors or pytorch_model.bin, as published."""
    for name in WEIGHT_FILES:
        path = head_dir / name
        if not path.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(path))
            return torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as exc:  # truncated or foreign files
            raise SpecDeployError(f"could not read EAGLE head weights {path}: {type(exc).__name__}: {exc}") from None
    raise SpecDeployError(f"{head_dir} holds no EAGLE head weights ({' or '.join(WEIGHT_FILES)})")


def detect_version(weights: dict) -> int:
    if any(k.startswith("midlayer.") for k in weights):
        return 3
    if any(k.startswith("layers.0.") for k in weights):
        return 1
    sample = ", ".join(sorted(weights)[:5]) or "none"
    raise SpecDeployError("not an EAGLE head: expected layers.0.* (EAGLE-1/2) or midlayer.* (EAGLE-3) "
                          f"weights, found {sample}")


def _llama_config(cfg: dict, num_layers: int) -> LlamaConfig:
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "max_position_embeddings", "hidden_act",
            "attention_bias", "mlp_bias", "draft_vocab_size", "vocab_size", "target_hidden_size")
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads") if k not in cfg]
    if missing:
        raise SpecDeployError(f"EAGLE head config.json lacks {', '.join(missing)}")
    args = {k: cfg[k] for k in keep if cfg.get(k) is not None}
    try:
        args.update(rope_settings(cfg))  # either transformers' spelling in, one both read out
        out = LlamaConfig(**args, num_hidden_layers=num_layers)
    except (TypeError, ValueError) as exc:
        raise SpecDeployError(f"EAGLE head config.json is not a usable Llama config: {exc}") from None
    if out.hidden_size % out.num_attention_heads and "head_dim" not in args:
        raise SpecDeployError(f"EAGLE head: hidden_size {out.hidden_size} is not divisible by "
                              f"num_attention_heads {out.num_attention_heads}")
    return out


def _check_shapes(head: EagleHead, weights: dict, head_dir: Path) -> None:
    """Every tensor the head needs is there with the shape this target implies."""
    expected = head.head_state_dict()
    missing = [k for k in expected if k not in weights]
    if missing:
        raise SpecDeployError(f"EAGLE head {head_dir}: missing weights {', '.join(missing[:6])}"
                              + (" ..." if len(missing) > 6 else ""))
    for key, ref in expected.items():
        got = tuple(weights[key].shape)
        if got != tuple(ref.shape):
            hint = (f"target hidden_size {head.target_hidden}, vocab_size {head.target_vocab}; "
                    f"head hidden_size {head.hidden_size}")
            raise SpecDeployError(f"EAGLE head {head_dir}: {key} has shape {list(got)} but this target needs "
                                  f"{list(ref.shape)} ({hint})")


def read_head_config(head_dir: Path, target_vocab: int) -> dict:
    """A head dir's config.json, checked against the target's vocabulary: what can be checked from the
    target's HF config alone, before the target model loads (seconds)."""
    cfg = read_dir_config(head_dir, "config.json", "EAGLE head", ": not an EAGLE head directory")
    if cfg.get("vocab_size") not in (None, target_vocab):
        raise SpecDeployError(f"EAGLE head {head_dir}: vocab_size {cfg['vocab_size']} does not match the "
                              f"target's vocab_size {target_vocab}")
    return cfg


def load_eagle_head(head_dir: Path, target_model, dtype: torch.dtype = torch.float32) -> EagleHead:
    """A published-layout head (EAGLE-1/2 or EAGLE-3) attached to `target_model`, checked for fit."""
    head_dir = Path(head_dir)
    cfg = read_head_config(head_dir, target_model.config.vocab_size)
    weights = read_weights(head_dir)
    version = detect_version(weights)
    tcfg = target_model.config
    t_hidden, t_vocab = tcfg.hidden_size, tcfg.vocab_size
    n_layers = 1
    if version == 1:
        n_layers = 1 + max(int(k.split(".")[1]) for k in weights if k.startswith("layers."))
    lcfg = _llama_config(cfg, n_layers)
    if version == 1 and lcfg.hidden_size != t_hidden:
        raise SpecDeployError(f"EAGLE head {head_dir}: hidden_size {lcfg.hidden_size} does not match the "
                              f"target's hidden_size {t_hidden} (EAGLE-1/2 heads reuse its features and LM head)")
    if version == 3 and cfg.get("target_hidden_size") not in (None, t_hidden):
        raise SpecDeployError(f"EAGLE head {head_dir}: target_hidden_size {cfg['target_hidden_size']} does not "
                              f"match the target's hidden_size {t_hidden}")
    embed = target_model.get_input_embeddings()
    own_embed = weights.get("embed_tokens.weight")
    if own_embed is not None:
        if tuple(own_embed.shape) != (t_vocab, lcfg.hidden_size):
            raise SpecDeployError(f"EAGLE head {head_dir}: embed_tokens.weight has shape {list(own_embed.shape)} "
                                  f"but needs {[t_vocab, lcfg.hidden_size]}")
        embed = nn.Embedding.from_pretrained(own_embed.float(), freeze=True)
    elif embed.weight.shape[1] != lcfg.hidden_size:
        raise SpecDeployError(f"EAGLE head {head_dir}: hidden_size {lcfg.hidden_size} differs from the target's "
                              f"embedding width {embed.weight.shape[1]} and the head has no embed_tokens.weight")
    fc_bias = "fc.bias" in weights if version == 1 else False
    head = EagleHead(version, lcfg, t_hidden, t_vocab, embed, target_model.get_output_embeddings(), fc_bias)
    _check_shapes(head, weights, head_dir)
    head.load_state_dict({**head.state_dict(), **{k: weights[k] for k in head.head_state_dict()}})
    if version == 3:
        d2t = head.d2t
        mapped = torch.arange(len(d2t)) + d2t
        if len(d2t) and (mapped.min() < 0 or mapped.max() >= t_vocab):
            raise SpecDeployError(f"EAGLE head {head_dir}: d2t maps draft ids outside the target vocabulary "
                                  f"[0, {t_vocab})")
    head.aux_layer_ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    head.source = str(head_dir.resolve())
    for p in head.parameters():
        p.requires_grad_(False)
    return head.to(dtype).eval()


# ---------------------------------------------------------------- saving (published layout)


def head_config(head: EagleHead, target_config) -> dict:
    """config.json in the upstream style: a Llama config with the head's own sizes."""
    c = head.cfg
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": head.head_dim, "num_hidden_layers": head.num_layers, "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": rope_theta(c),
        "max_position_embeddings": c.max_position_embeddings, "vocab_size": head.target_vocab,
        "bos_token_id": target_config.bos_token_id, "eos_token_id": target_config.eos_token_id,
        "pad_token_id": target_config.pad_token_id, "tie_word_embeddings": False, "torch_dtype": "float32",
    }
    if rope_scaling(c):
        cfg["rope_scaling"] = rope_scaling(c)
    if head.version == 1:
        cfg["bias"] = head.fc.bias is not None
    else:
        cfg["draft_vocab_size"] = head.draft_vocab
        cfg["target_hidden_size"] = head.target_hidden
    return cfg


def save_head(head: EagleHead, target_config, out_dir: Path, fmt: str = "safetensors", extra_config=None) -> Path:
    """Write config.json + model.safetensors (or pytorch_model.bin) as SafeAILab publishes them."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in WEIGHT_FILES:
        (out_dir / name).unlink(missing_ok=True)
    state = {k: v.detach().contiguous().clone() for k, v in head.head_state_dict().items()}
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(state, str(out_dir / "model.safetensors"))
    elif fmt == "bin":
        torch.save(state, str(out_dir / "pytorch_model.bin"))
    else:
        raise ValueError(f"unknown weight format {fmt!r}")
    (out_dir / "config.json").write_text(json.dumps({**head_config(head, target_config), **(extra_config or {})},
                                                    indent=2) + "\n")
    return out_dir


def new_head(version: int, target_model, seed: int = 0, draft_vocab: int | None = None,
             intermediate: int | None = None, num_heads: int | None = None, num_kv_heads: int | None = None):
    """A freshly initialised head for `target_model` (training start, or random heads for tests)."""
    tcfg = target_model.config
    h = tcfg.hidden_size
    heads = num_heads or tcfg.num_attention_heads
    cfg = LlamaConfig(
        hidden_size=h, intermediate_size=intermediate or tcfg.intermediate_size, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=num_kv_heads or getattr(tcfg, "num_key_value_heads", heads),
        head_dim=h // heads, rms_norm_eps=getattr(tcfg, "rms_norm_eps", 1e-6),
        **rope_settings(tcfg),
        max_position_embeddings=getattr(tcfg, "max_position_embeddings", 2048),
        draft_vocab_size=draft_vocab if version == 3 else None, vocab_size=tcfg.vocab_size,
    )
    torch.manual_seed(seed)
    return EagleHead(version, cfg, h, tcfg.vocab_size, target_model.get_input_embeddings(),
                     target_model.get_output_embeddings())
