"""Every manifest.json field checked for type and range before the runtime trusts it.

A manifest is input like any other: a `prefill_chunk` of -1 would silently skip the prompt,
a missing `files` map would silently turn off the integrity checks, an unknown dtype or a
huge `max_context` would crash (or allocate) far from the cause. Each check raises one
SpecDeployError naming the field (`manifest: models.target.num_layers must be ...`).
Paths are kept inside the export by runtime/containment.py, called from runtime/manifest.py.
"""

from __future__ import annotations

import math
import re
from typing import NoReturn

from .errors import SpecDeployError
from .graph_contract import DECODER, FLAVORS, FUSED_BATCHED, KINDS, PORTABLE, TARGET, ModelRecord

DTYPES = ("float32", "float16")  # what the runtime's KV caches hold (kv_cache.NP_DTYPES)
MAX_CONTEXT_LIMIT = 1 << 21  # 2M positions: beyond every supported model, and a KV buffer no host holds
# Names become file names (engines/NAME.engine) and message text: plain characters only.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
# What `check` says: the accuracy check passed, was skipped (--no-check), or (only while the
# exporter's staging copy is being checked) has not finished.
CHECK_PASSED, CHECK_SKIPPED, CHECK_PENDING = "passed", "skipped", "pending"

_MODEL_LIMITS = {  # field -> largest accepted value (all at least 1)
    "num_layers": 4096, "num_heads": 1 << 16, "num_kv_heads": 1 << 16, "head_dim": 1 << 16,
    "hidden_size": 1 << 20, "vocab_size": 1 << 24,
}
_MAX_EXTRA_INT = (1 << 31) - 1


def fail(field: str, problem: str) -> NoReturn:
    raise SpecDeployError(f"manifest: {field} {problem}")


def integer(value, field: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        fail(field, f"must be an integer, got {value!r}")
    if not low <= value <= high:
        fail(field, f"must be between {low} and {high}, got {value}")
    return value


def text(value, field: str) -> str:
    if not isinstance(value, str):
        fail(field, f"must be a string, got {value!r}")
    return value


def mapping(value, field: str) -> dict:
    if not isinstance(value, dict):
        fail(field, f"must be a JSON object, got {type(value).__name__}")
    return value


def name(value: str, field: str) -> str:
    if not NAME.match(value):
        fail(field, f"has an unusable name {value!r} (letters, digits, '_', '.', '-')")
    return value


def _extra(value, field: str) -> None:
    """Model- and graph-specific facts: plain JSON, numbers non-negative and finite."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return
    if isinstance(value, int):
        integer(value, field, 0, _MAX_EXTRA_INT)
    elif isinstance(value, float):
        if not math.isfinite(value):
            fail(field, f"must be a finite number, got {value!r}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _extra(item, f"{field}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            _extra(item, f"{field}.{key}")
    else:
        fail(field, f"has an unexpected value {value!r}")


def top_level(raw: dict, path) -> dict:
    """format, dtype, max_context, prefill_chunk and the sections' types; returns the scalars."""
    if isinstance(raw.get("format"), bool) or raw.get("format") != 1:
        raise SpecDeployError(f"manifest {path}: unsupported format {raw.get('format')!r} (expected 1)")
    for key in ("dtype", "max_context", "prefill_chunk", "models", "graphs", "tokenizer", "files"):
        if key not in raw:
            fail(f"'{key}'", "is missing (a manifest written by `specdeploy export` always has it)")
    dtype = text(raw["dtype"], "dtype")
    if dtype not in DTYPES:
        fail("dtype", f"{dtype!r} is not one the runtime runs ({', '.join(DTYPES)})")
    max_context = integer(raw["max_context"], "max_context", 2, MAX_CONTEXT_LIMIT)
    prefill_chunk = integer(raw["prefill_chunk"], "prefill_chunk", 1, max_context - 1)
    for key in ("models", "graphs", "tokenizer", "files"):
        mapping(raw[key], key)
    mapping(raw.get("methods", {}), "methods")
    if "exported_in_s" in raw:
        _extra(raw["exported_in_s"], "exported_in_s")
    return {"dtype": dtype, "max_context": max_context, "prefill_chunk": prefill_chunk}


def check_state(raw: dict, allow_pending: bool) -> str:
    """The accuracy check's outcome as recorded; an export never published ('pending') is refused."""
    state = raw.get("check", CHECK_SKIPPED)  # exports from before the field: not recorded
    if state == CHECK_PENDING and not allow_pending:
        fail("check", "is 'pending': this export was interrupted before its accuracy check finished "
             "(a staging copy, never published); run `specdeploy export` again")
    if state not in (CHECK_PASSED, CHECK_SKIPPED, CHECK_PENDING):
        fail("check", f"is {state!r}: an export that did not pass its accuracy check is not loaded "
             "(re-export it; `specdeploy check OUT` shows the failures)")
    return state


def model(key: str, data, max_context: int) -> ModelRecord:
    where = f"models.{key}"
    name(key, where)
    data = mapping(data, where)
    for field, high in _MODEL_LIMITS.items():
        if field not in data:
            fail(f"{where}.{field}", "is missing")
        integer(data[field], f"{where}.{field}", 1, high)
    if data["num_kv_heads"] > data["num_heads"]:
        fail(f"{where}.num_kv_heads", f"({data['num_kv_heads']}) exceeds num_heads ({data['num_heads']})")
    for field in ModelRecord._TEXTS:
        if field in data:
            text(data[field], f"{where}.{field}")
    for field, value in data.items():
        if field not in _MODEL_LIMITS and field not in ModelRecord._TEXTS:
            _extra(value, f"{where}.{field}")
    limit = data.get("max_position_embeddings")
    if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < max_context:
        fail("max_context", f"({max_context}) exceeds {where}.max_position_embeddings ({limit})")
    return ModelRecord.from_json(key, data)


def graph(key: str, data, models: dict, max_context: int) -> None:
    where = f"graphs.{key}"
    name(key, where)
    data = mapping(data, where)
    for field in ("file", "model", "kind", "tokens"):
        if field not in data:
            fail(f"{where}.{field}", "is missing")
    text(data["file"], f"{where}.file")
    if text(data["model"], f"{where}.model") not in models:
        fail(f"{where}.model", f"names an unknown model {data['model']!r} (models: {', '.join(models)})")
    if text(data["kind"], f"{where}.kind") not in KINDS:
        fail(f"{where}.kind", f"is {data['kind']!r}, not one of {', '.join(KINDS)}")
    if text(data.get("flavor", PORTABLE), f"{where}.flavor") not in FLAVORS:
        fail(f"{where}.flavor", f"is {data['flavor']!r}, not one of {', '.join(FLAVORS)}")
    if data.get("flavor") == FUSED_BATCHED and (data["kind"], data["model"]) != (DECODER, TARGET):
        fail(f"{where}.flavor", f"is {FUSED_BATCHED!r}, which only the target's decoder graph has")
    integer(data["tokens"], f"{where}.tokens", 1, max_context - 1)
    if data.get("features") is not None:
        integer(data["features"], f"{where}.features", 1, _MODEL_LIMITS["hidden_size"])
    for field, value in data.items():
        if field not in ("file", "model", "kind", "tokens", "flavor", "features"):
            _extra(value, f"{where}.{field}")


QUANT_BITS = (4, 8)  # weight-only schemes export/quantize.py writes (MatMulNBits)
QUANT_EMBEDDINGS = ("shared", "float")  # a tied embedding reads the quantized LM head, or stays float


def quantization(data, models: dict) -> dict:
    """`quantization`: which models' fused graphs hold int4/int8 weights, and how (absent: none)."""
    data = mapping(data, "quantization")
    text(data.get("method"), "quantization.method")
    if text(data.get("flavor"), "quantization.flavor") not in FLAVORS:
        fail("quantization.flavor", f"is {data['flavor']!r}, not one of {', '.join(FLAVORS)}")
    for key, scheme in mapping(data.get("models"), "quantization.models").items():
        where = f"quantization.models.{key}"
        if key not in models:
            fail(where, f"names an unknown model (models: {', '.join(models)})")
        scheme = mapping(scheme, where)
        for field in ("bits", "lm_head_bits"):
            if integer(scheme.get(field), f"{where}.{field}", 1, 8) not in QUANT_BITS:
                fail(f"{where}.{field}", f"must be one of {QUANT_BITS}, got {scheme[field]}")
        block = integer(scheme.get("block_size"), f"{where}.block_size", 16, 1 << 16)
        if block & (block - 1):
            fail(f"{where}.block_size", f"must be a power of two, got {block}")
        integer(scheme.get("accuracy_level"), f"{where}.accuracy_level", 0, 4)
        if not isinstance(scheme.get("symmetric"), bool):
            fail(f"{where}.symmetric", f"must be true or false, got {scheme.get('symmetric')!r}")
        if text(scheme.get("embedding"), f"{where}.embedding") not in QUANT_EMBEDDINGS:
            fail(f"{where}.embedding", f"is {scheme['embedding']!r}, not one of {', '.join(QUANT_EMBEDDINGS)}")
        attention_padding(scheme, where)
    return data


def attention_padding(scheme: dict, where: str) -> int:
    """A model's padded attentions, in its `quantization` scheme or in `exact_rows`: the rows a call
    writes past its own (export/attention_pad.py; absent: none), and the same graph without them, for
    a CPU that pads every call to two rows (export/quantize.py, export/exact_rows.py)."""
    pad = integer(scheme.get("attention_pad", 0), f"{where}.attention_pad", 0, 1)
    if "unpadded_graph" in scheme:
        text(scheme["unpadded_graph"], f"{where}.unpadded_graph")
        if not pad:
            fail(f"{where}.unpadded_graph", "names an unpadded graph of a model whose graphs are not padded")
    return pad


def exact_rows(data, models: dict) -> dict:
    """`exact_rows` (export --exact-rows): a float target whose fused attentions are padded (absent: none)."""
    data = mapping(data, "exact_rows")
    entries = mapping(data.get("models"), "exact_rows.models")
    for key, entry in entries.items():
        where = f"exact_rows.models.{key}"
        if key not in models:
            fail(where, f"names an unknown model (models: {', '.join(models)})")
        if not attention_padding(mapping(entry, where), where):
            fail(f"{where}.attention_pad", "must be 1 (the padding rows that make its rows exact)")
    return data


def tokenizer(data: dict, vocab_size: int) -> None:
    text(data.get("dir", "tokenizer"), "tokenizer.dir")
    for field in ("bos_token_id", "pad_token_id"):
        if data.get(field) is not None:
            integer(data[field], f"tokenizer.{field}", 0, vocab_size - 1)
    eos = data.get("eos_token_ids", [])
    if not isinstance(eos, list):
        fail("tokenizer.eos_token_ids", f"must be a list of token ids, got {eos!r}")
    for i, token in enumerate(eos):
        integer(token, f"tokenizer.eos_token_ids[{i}]", 0, vocab_size - 1)


def files(data: dict) -> None:
    for rel, digest in data.items():
        if not isinstance(digest, str) or not SHA256.match(digest):
            fail(f"files[{rel!r}]", f"must be a sha256 hex digest, got {digest!r}")
