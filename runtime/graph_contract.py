"""The graph contract: what an export holds and what each graph's inputs and outputs are called.

The exporter writes graphs and manifest records with these names and the runtime
reads them back with the same ones; nothing else spells them out. Torch-free, so
both sides import it (ARCHITECTURE.md documents the shapes).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# -- what a graph is -----------------------------------------------------------------------------

DECODER = "decoder"  # a target or draft model: tokens -> logits, hidden (+ features)
EAGLE_DRAFT = "eagle_draft"  # the EAGLE head: tokens + features -> top-k candidates, next features
MEDUSA_HEADS = "medusa_heads"  # Medusa heads: the target's hidden state -> per-head top-k
KINDS = (DECODER, EAGLE_DRAFT, MEDUSA_HEADS)

PORTABLE = "portable"  # standard ONNX ops, past/present KV as separate tensors: what TensorRT builds from
FUSED = "fused"  # ONNX Runtime CPU contrib ops, the KV cache bound as one buffer written in place
# The target's fused graph with a dynamic batch dimension too, for continuous batching (runtime/batching):
# one record, T dynamic; the batch-1 runtime never opens it (it picks its decoder graphs by flavor).
FUSED_BATCHED = "fused_batched"
FLAVORS = (PORTABLE, FUSED, FUSED_BATCHED)
# The token count T as a named dimension: decoder graphs (and EAGLE's fused head) leave it dynamic,
# so one file content serves every static T of a model (runtime/backends/sessions.py opens it once,
# TensorRT builds one engine with a profile per T); the runtime calls each record at its own T.
TOKENS_DIM = "tokens"

TARGET, DRAFT, EAGLE = "target", "draft", "eagle"  # model names in the manifest

# -- tensor names --------------------------------------------------------------------------------

INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
TREE_MASK = "tree_mask"
PAST_LENGTH = "past_length"  # fused graphs only: rows of the KV buffer already filled
# fused decoder graphs (batch-1) only: logits are computed for the last `logit_rows` rows (output
# [1, logit_rows, vocab]); a prefill asks for one row, a verify for all T. Graphs exported before it
# lack the input and return every row.
LOGIT_ROWS = "logit_rows"
FEATURES = "features"
LOGITS = "logits"
HIDDEN = "hidden"
TOPK_IDS = "topk_ids"
TOPK_LOGPROBS = "topk_logprobs"

KEY, VALUE = "key", "value"
KV_KINDS = (KEY, VALUE)  # index 0 is the key, 1 the value (device caches address them so)
_KV_NAME = re.compile(r"^(past|present)_(key|value)\.(\d+)$")


def past_name(layer: int, kind: str) -> str:
    return f"past_{kind}.{layer}"


def present_name(layer: int, kind: str) -> str:
    return f"present_{kind}.{layer}"


def past_names(num_layers: int) -> list[str]:
    """Key, value per layer: the order the portable graphs take their past in."""
    return [past_name(layer, kind) for layer in range(num_layers) for kind in KV_KINDS]


def present_names(num_layers: int) -> list[str]:
    return [present_name(layer, kind) for layer in range(num_layers) for kind in KV_KINDS]


@dataclass(frozen=True)
class KVName:
    """A parsed past_*/present_* tensor name."""

    present: bool
    kind: str
    layer: int

    @property
    def kind_index(self) -> int:
        return KV_KINDS.index(self.kind)


def parse_kv_name(name: str) -> KVName | None:
    """The KV slot a tensor name addresses, or None for any other tensor."""
    m = _KV_NAME.match(name)
    return None if m is None else KVName(m.group(1) == "present", m.group(2), int(m.group(3)))


def is_past(name: str) -> bool:
    kv = parse_kv_name(name)
    return kv is not None and not kv.present


def is_present(name: str) -> bool:
    kv = parse_kv_name(name)
    return kv is not None and kv.present


def present_of(past: str) -> str:
    """The output a fused graph writes the given past buffer back to (the same memory)."""
    kv = parse_kv_name(past)
    if kv is None or kv.present:
        raise ValueError(f"{past!r} is not a past_* input name")
    return present_name(kv.layer, kv.kind)


def past_of(present: str) -> str:
    kv = parse_kv_name(present)
    if kv is None or not kv.present:
        raise ValueError(f"{present!r} is not a present_* output name")
    return past_name(kv.layer, kv.kind)


@dataclass(frozen=True)
class GraphIO:
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def decoder_io(num_layers: int, features: bool = False, flavor: str = PORTABLE) -> GraphIO:
    """kind decoder: `features` when the target also outputs layer features (EAGLE-3)."""
    inputs = [INPUT_IDS, POSITION_IDS, TREE_MASK] + ([PAST_LENGTH] if flavor != PORTABLE else []) + \
        ([LOGIT_ROWS] if flavor == FUSED else [])
    outputs = [LOGITS, HIDDEN] + ([FEATURES] if features else [])
    return GraphIO(tuple(inputs + past_names(num_layers)), tuple(outputs + present_names(num_layers)))


def eagle_draft_io(num_layers: int, flavor: str = PORTABLE) -> GraphIO:
    inputs = [INPUT_IDS, FEATURES, POSITION_IDS, TREE_MASK] + ([PAST_LENGTH] if flavor == FUSED else [])
    outputs = [TOPK_LOGPROBS, TOPK_IDS, HIDDEN]
    return GraphIO(tuple(inputs + past_names(num_layers)), tuple(outputs + present_names(num_layers)))


MEDUSA_HEADS_IO = GraphIO((HIDDEN,), (TOPK_IDS, TOPK_LOGPROBS))


KV_TYPES = {"float32": "tensor(float)", "float16": "tensor(float16)"}  # an export's dtype -> its KV inputs' ORT type


def decoder_mismatch(file: str, model: ModelRecord, inputs: list, logits_width, dtype: str | None = None) -> str | None:
    """How a decoder graph, as its session describes it (its inputs' names, shapes and types, the logits'
    last dimension), disagrees with the manifest's record of its model (and the export's `dtype`); None
    when it does not. A manifest edited or mixed up after export would otherwise fail inside ONNX Runtime
    ("Missing Input: past_key.2", "Got invalid dimensions for input") or, worse, accept token ids the
    graph has no logits for. `inputs`: onnxruntime NodeArg-likes (name, shape, type)."""
    pasts = {arg.name for arg in inputs if is_past(arg.name)}
    want = set(past_names(model.num_layers))
    if pasts != want:
        count = len({kv.layer for kv in map(parse_kv_name, pasts) if kv is not None})
        if count and pasts == set(past_names(count)):
            return (f"{file} expects {count} layers' KV (past_key.0..{count - 1}) but the manifest says "
                    f"{model.num_layers}: re-export")
        odd = ", ".join(sorted(pasts ^ want)[:4])
        return f"{file}'s KV inputs do not match the manifest's {model.num_layers} layers ({odd}...): re-export"
    width = model.extra.get("draft_vocab_size") or model.vocab_size  # a draft's reduced LM head
    if isinstance(logits_width, int) and logits_width != width:
        return (f"{file} scores {logits_width} tokens per row but the manifest says the vocabulary has {width}: "
                "re-export")
    for arg in inputs:
        if not is_past(arg.name):
            continue
        # KV layouts differ by flavor ([1, P, heads, D] portable, [1, heads, S, D] fused): the record's
        # head count and size must be among the fixed sizes after the batch dimension, whatever the order
        fixed = [d for d in arg.shape[1:] if isinstance(d, int)]
        for size in (model.num_kv_heads, model.head_dim):
            if size not in fixed:
                return (f"{file}'s KV input {arg.name} has shape {arg.shape}, but the manifest says "
                        f"{model.num_kv_heads} KV heads of size {model.head_dim}: re-export")
            fixed.remove(size)
        if dtype in KV_TYPES and arg.type != KV_TYPES[dtype]:
            return f"{file}'s KV input {arg.name} is {arg.type}, but the manifest says the export is {dtype}: re-export"
    return None


def graph_io(kind: str, num_layers: int = 0, features: bool = False, flavor: str = PORTABLE) -> GraphIO:
    if kind == DECODER:
        return decoder_io(num_layers, features, flavor)
    if kind == EAGLE_DRAFT:
        return eagle_draft_io(num_layers, flavor)
    if kind == MEDUSA_HEADS:
        return MEDUSA_HEADS_IO
    raise ValueError(f"unknown graph kind {kind!r} (known: {', '.join(KINDS)})")


# -- file names ----------------------------------------------------------------------------------

MEDUSA_HEADS_GRAPH = "medusa_heads"


def decoder_graph_name(model: str, tokens: int, flavor: str = PORTABLE) -> str:
    return f"{model}_fused_t{tokens}" if flavor == FUSED else f"{model}_t{tokens}"


def batched_graph_name(model: str) -> str:
    return f"{model}_{FUSED_BATCHED}"


def eagle_graph_name(tokens: int, width: int, hidden_size: int, flavor: str = PORTABLE) -> str:
    """`eagle_t{T}` reads hidden-size features; `eagle_f{F}_t{T}` another width (EAGLE-3 catch-up)."""
    fused = "fused_" if flavor == FUSED else ""
    wide = "" if width == hidden_size else f"f{width}_"
    return f"eagle_{fused}{wide}t{tokens}"


def graph_file(name: str) -> str:
    return f"{name}.onnx"


def unpadded_graph_file(model: str) -> str:
    """A quantized model's fused graph without its attention padding rows (export/attention_pad.py): what
    the runtime opens where it pads every call to two rows anyway (quantization.models.<model>.unpadded_graph)."""
    return graph_file(f"{model}_fused_unpadded")


def weights_file(model: str, flavor: str = PORTABLE) -> str:
    """One external-data file per model and flavor, shared by its static-T graphs."""
    return f"weights/{model}.bin" if flavor == PORTABLE else f"weights/{model}.{flavor}.bin"


# -- KV geometry ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class KVGeometry:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, cfg) -> KVGeometry:
        """From a Hugging Face config object or its config.json dict (Llama-family names)."""
        get: Callable[[str], Any] = cfg.get if isinstance(cfg, Mapping) else (lambda key: getattr(cfg, key, None))
        heads = int(get("num_attention_heads"))
        return cls(num_layers=int(get("num_hidden_layers")), num_heads=heads,
                   num_kv_heads=int(get("num_key_value_heads") or heads),
                   head_dim=int(get("head_dim") or get("hidden_size") // heads))

    def past_shape(self, past: int) -> tuple[int, int, int, int]:
        """A portable graph's past_* input: [1, P, kv_heads, head_dim] (sequence-major)."""
        return (1, past, self.num_kv_heads, self.head_dim)


# -- manifest records ----------------------------------------------------------------------------

def _split(data: Mapping, typed: tuple[str, ...]) -> tuple[dict, dict]:
    return {k: data[k] for k in typed if k in data}, {k: v for k, v in data.items() if k not in typed}


@dataclass(frozen=True)
class ModelRecord:
    """manifest.models[name]: a model's geometry; `extra` keeps model-specific facts
    (max_position_embeddings, feature_layers, the EAGLE head's version, top_k...)."""

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    architecture: str = ""
    model_type: str = ""
    source: str = ""
    extra: dict = field(default_factory=dict)

    _INTS = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "vocab_size")
    _TEXTS = ("architecture", "model_type", "source")

    @classmethod
    def from_geometry(cls, name: str, geometry: KVGeometry, hidden_size: int, vocab_size: int,
                      **described) -> ModelRecord:
        return cls(name=name, num_layers=geometry.num_layers, num_heads=geometry.num_heads,
                   num_kv_heads=geometry.num_kv_heads, head_dim=geometry.head_dim, hidden_size=hidden_size,
                   vocab_size=vocab_size, **described)

    @property
    def geometry(self) -> KVGeometry:
        return KVGeometry(self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim)

    def to_json(self) -> dict:
        out = {"architecture": self.architecture, "model_type": self.model_type}
        out.update((k, getattr(self, k)) for k in self._INTS)
        out.update(self.extra)
        if self.source:
            out["source"] = self.source
        return out

    @classmethod
    def from_json(cls, name: str, data: Mapping) -> ModelRecord:
        """Raises KeyError/TypeError/ValueError on a malformed entry."""
        missing = [k for k in cls._INTS if k not in data]
        if missing:
            raise KeyError(f"model {name!r} lacks {', '.join(missing)}")
        typed, extra = _split(data, cls._INTS + cls._TEXTS)
        fields: dict[str, Any] = {k: int(typed[k]) for k in cls._INTS}
        fields.update({k: str(typed.get(k) or "") for k in cls._TEXTS})
        return cls(name=name, extra=extra, **fields)


@dataclass(frozen=True)
class GraphRecord:
    """manifest.graphs[name]: one ONNX file. `features` is an EAGLE draft graph's feature
    width; `extra` keeps kind-specific facts (a Medusa graph's heads and top_k...)."""

    name: str
    file: str
    model: str
    kind: str
    tokens: int
    flavor: str = PORTABLE
    features: int | None = None
    extra: dict = field(default_factory=dict)

    _TYPED = ("file", "model", "kind", "tokens", "flavor", "features")

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"graph {self.name!r} has unknown kind {self.kind!r} (known: {', '.join(KINDS)})")
        if self.flavor not in FLAVORS:
            raise ValueError(f"graph {self.name!r} has unknown flavor {self.flavor!r} (known: {', '.join(FLAVORS)})")

    @classmethod
    def new(cls, name: str, model: str, kind: str, tokens: int, **rest) -> GraphRecord:
        """A record for a graph written as `{name}.onnx`."""
        return cls(name=name, file=graph_file(name), model=model, kind=kind, tokens=tokens, **rest)

    def to_json(self) -> dict:
        out = {"file": self.file, "model": self.model, "kind": self.kind, "tokens": self.tokens}
        if self.flavor != PORTABLE:  # absent means portable (exports before flavors existed)
            out["flavor"] = self.flavor
        if self.features is not None:
            out["features"] = self.features
        out.update(self.extra)
        return out

    @classmethod
    def from_json(cls, name: str, data: Mapping) -> GraphRecord:
        """Raises KeyError/TypeError/ValueError on a malformed entry."""
        typed, extra = _split(data, cls._TYPED)
        features = typed.get("features")
        return cls(name=name, file=str(typed["file"]), model=str(typed["model"]), kind=str(typed["kind"]),
                   tokens=int(typed["tokens"]), flavor=str(typed.get("flavor", PORTABLE)),
                   features=None if features is None else int(features), extra=extra)
