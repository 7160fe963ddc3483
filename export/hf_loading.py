"""Load a local Hugging Face model directory, with clear errors for bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

from ..runtime.errors import SpecDeployError
from ..runtime.manifest import parse_json
from .dir_config import read_dir_config

# torch and transformers load in ~10 s: this module imports neither at the top, so a bad model
# directory is reported before they load (`specdeploy export` checks its inputs first).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # export/decoder_graph.py's families
DTYPES = ("float32", "float16", "bfloat16")


def is_self_draft(target: str | Path, draft: str | Path | None) -> bool:
    """Whether the draft model is the target itself (`export --draft self`, or its own dir given as
    --draft): its weights are the target's, read once, its LM head whole (its dir holds no draft
    vocabulary), and peers draft with their own 4-bit build of it (bench/peers.py)."""
    return draft is not None and Path(draft).resolve() == Path(target).resolve()


def read_hf_config(model_dir: Path) -> dict:
    return read_dir_config(model_dir, "config.json", "model", ": not a Hugging Face model directory")


def check_loadable(model_dir: Path, cfg: dict) -> None:
    """What loading `model_dir` (config `cfg`) needs that a glance can tell: a supported family, weights."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise SpecDeployError(
            f"{model_dir}: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if not any(Path(model_dir).glob("*.safetensors")) and not any(Path(model_dir).glob("*.bin")):
        raise SpecDeployError(f"{model_dir} holds no weights (*.safetensors or *.bin)")


def torch_dtype(dtype: str):
    import torch

    if dtype not in DTYPES:
        raise SpecDeployError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    return getattr(torch, dtype)


def _field(config, key: str):
    """A field of a transformers config object or of its config.json as a dict."""
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def rope_theta(config) -> float:
    """The RoPE base of a config (object or config.json dict): transformers 5 keeps it in
    `rope_parameters`, 4.x as `rope_theta` (a default read from the wrong place would silently
    change every position)."""
    params = _field(config, "rope_parameters")
    in_params = isinstance(params, dict) and "rope_theta" in params
    theta = params["rope_theta"] if in_params else _field(config, "rope_theta")
    if theta is None:
        return 10000.0
    try:
        return float(theta)
    except (TypeError, ValueError):
        raise SpecDeployError(f"config.json: rope_theta {theta!r} is not a number") from None


def _scaling(entry) -> dict | None:
    """A scaling dict without its base, or None for none ("default", either key name)."""
    if not isinstance(entry, dict) or entry.get("rope_type", entry.get("type", "default")) == "default":
        return None
    return {k: v for k, v in entry.items() if k != "rope_theta"}


def rope_scaling(config) -> dict | None:
    """The config's RoPE scaling (Llama 3.1's "llama3", "linear", ...) in the 4.x `rope_scaling`
    form that published configs carry, or None."""
    params = _field(config, "rope_parameters")
    return _scaling(params) if isinstance(params, dict) else _scaling(_field(config, "rope_scaling"))


def longrope_window(config) -> int | None:
    """Under "longrope" scaling, the length transformers switches factors at: a call reaching past it
    rotates every one of its positions with the long factors, earlier ones with the short. No table by
    position reproduces that past it, so an export stays within it (export/exporter.py). None otherwise."""
    scaling = rope_scaling(config)
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "longrope":
        return None
    # transformers' rule: original_max_position_embeddings where the config has it, else max_position_embeddings
    window = (scaling.get("original_max_position_embeddings") or _field(config, "original_max_position_embeddings")
              or _field(config, "max_position_embeddings"))
    return window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None


def rope_settings(config) -> dict:
    """The config's RoPE fields as keyword arguments for another LlamaConfig (an EAGLE head's,
    which must rotate positions exactly as its target does): the 4.x spelling, which 4.x reads
    and 5.x folds into its rope_parameters (4.x ignores a rope_parameters argument)."""
    return {"rope_theta": rope_theta(config), "rope_scaling": rope_scaling(config)}


def check_rope_readable(model_dir: Path, cfg: dict, transformers_version: str) -> None:
    """transformers 5 saves RoPE settings only as `rope_parameters`, which 4.x ignores: it would
    rotate with its top-level `rope_theta` (10000 when absent) and no scaling, and export a wrong
    model without a word. So under 4.x the top-level fields must say what rope_parameters says."""
    if not isinstance(cfg.get("rope_parameters"), dict) or int(transformers_version.split(".")[0]) >= 5:
        return
    theta, scaling = cfg.get("rope_theta"), _scaling(cfg.get("rope_scaling"))
    if theta is not None and rope_theta({"rope_theta": theta}) == rope_theta(cfg) and scaling == rope_scaling(cfg):
        return
    fields = {"rope_theta": rope_theta(cfg), **({"rope_scaling": rope_scaling(cfg)} if rope_scaling(cfg) else {})}
    raise SpecDeployError(
        f"{model_dir}/config.json was written by transformers 5 (RoPE in rope_parameters), which "
        f"transformers {transformers_version} cannot read: install transformers>=5, or set "
        f"{json.dumps(fields)[1:-1]} in config.json")


def readable_by_both(config_path: Path) -> None:
    """A config.json transformers wrote, made readable by 4.x too: 5.x writes RoPE only as
    `rope_parameters`, which 4.x ignores (a model converted or trained by one and exported by the
    other). Both spellings must then be written: 5.x reads a rope_scaling without a top-level
    rope_theta with base 10000."""
    cfg = json.loads(config_path.read_text())
    if isinstance(cfg.get("rope_parameters"), dict) and "rope_theta" not in cfg:
        cfg["rope_theta"], cfg["rope_scaling"] = rope_theta(cfg), rope_scaling(cfg)
        config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def load_causal_lm(model_dir: Path, dtype: str = "float32"):
    """An HF causal LM of a supported family, in eval mode, on the CPU; every weight from the checkpoint
    (transformers would initialise missing ones at random, e.g. from an EAGLE or Medusa head's dir)."""
    cfg = read_hf_config(model_dir)
    check_loadable(model_dir, cfg)
    torch_type = torch_dtype(dtype)
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    check_rope_readable(model_dir, cfg, transformers.__version__)

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its "newly initialized" warning would precede our one error
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch_type, attn_implementation="eager", output_loading_info=True)
    except Exception as exc:  # corrupt weights, shape mismatches, unreadable files
        raise SpecDeployError(f"could not load model from {model_dir}: {type(exc).__name__}: {exc}") from None
    finally:
        hf_logging.set_verbosity(level)
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise SpecDeployError(f"{model_dir} is not a complete causal LM checkpoint: its weights lack {shown} "
                              "(an EAGLE or Medusa head's directory goes to --eagle / --medusa)")
    return model.eval()


def model_json(path: Path):
    """A model dir's JSON file, None when absent, one clear error when unreadable."""
    if not path.is_file():
        return None
    try:
        return parse_json(path.read_text())
    except ValueError as exc:
        raise SpecDeployError(f"{path} is not valid JSON: {exc}") from None


def tokenizer_vocab(model_dir: Path) -> dict[str, int] | None:
    """The base vocabulary (token -> id) from tokenizer.json, else vocab.json; None without either."""
    path = Path(model_dir) / "tokenizer.json"
    data = model_json(path)
    if data is not None:
        try:
            vocab = data["model"]["vocab"]
            if isinstance(vocab, list):  # Unigram: [[piece, score], ...], the id is the position
                return {piece: i for i, (piece, _score) in enumerate(vocab)}
            return dict(vocab)
        except (KeyError, TypeError, ValueError) as exc:
            raise SpecDeployError(f"{path} is not a valid tokenizer file: {exc!r}") from None
    vocab = model_json(Path(model_dir) / "vocab.json")
    return dict(vocab) if isinstance(vocab, dict) else None


def _added_tokens(model_dir: Path) -> tuple[dict[int, str], set[int]]:
    """(id -> content, ids marked special) of the added tokens in tokenizer.json and tokenizer_config.json."""
    tokens, special = {}, set()
    for entry in (model_json(Path(model_dir) / "tokenizer.json") or {}).get("added_tokens") or []:
        if isinstance(entry, dict) and isinstance(entry.get("id"), int):
            tokens[entry["id"]] = entry.get("content")
            if entry.get("special"):
                special.add(entry["id"])
    decoder = (model_json(Path(model_dir) / "tokenizer_config.json") or {}).get("added_tokens_decoder") or {}
    for key, entry in decoder.items() if isinstance(decoder, dict) else ():
        if str(key).isdigit() and isinstance(entry, dict):
            tokens.setdefault(int(key), entry.get("content"))
            if entry.get("special"):
                special.add(int(key))
    return tokens, special


def special_token_ids(model_dir: Path, cfg: dict) -> dict[str, list[int]]:
    """bos/eos ids from config.json (eos also from generation_config.json), as lists."""
    gen = model_json(Path(model_dir) / "generation_config.json") or {}
    ids = {}
    for name in ("bos_token", "eos_token"):
        values = [cfg.get(f"{name}_id"), gen.get(f"{name}_id")]
        flat = [v for value in values for v in (value if isinstance(value, list) else [value])]
        ids[name] = sorted({v for v in flat if isinstance(v, int) and not isinstance(v, bool)})
    return ids


def token_table(model_dir: Path, cfg: dict) -> dict[int, str]:
    """What a model dir says its token ids mean, from whatever tokenizer files it has: the
    vocabulary, the added tokens, and special_tokens_map.json's tokens at the config's ids."""
    table = {i: token for token, i in (tokenizer_vocab(model_dir) or {}).items()}
    table.update(_added_tokens(model_dir)[0])
    named = model_json(Path(model_dir) / "special_tokens_map.json") or {}
    for name, ids in special_token_ids(model_dir, cfg).items():
        content = named.get(name)
        content = content.get("content") if isinstance(content, dict) else content
        if isinstance(content, str) and len(ids) == 1:  # several eos ids: which one the map names is unknown
            table.setdefault(ids[0], content)
    return table


SILU_ACTS = ("silu", "swish")  # transformers maps both names to SiLU
# ONNX Runtime's CPU GroupQueryAttention (with its rotary) refuses other head sizes: 100 ("must be a
# multiple of 8", open_llama_3b's 3200 / 32), 24 ("a multiple of 16").
FUSED_HEAD_DIM_MULTIPLE = 16


def fused_unsupported(cfg) -> str | None:
    """Why a model of this HF config (config.json's dict, or a config object) can have no fused
    ORT-CPU graphs (export/fused_graph.py); None when it can. Its portable graphs serve either way."""
    act = _field(cfg, "hidden_act") or "silu"
    if act not in SILU_ACTS:
        return f"hidden_act {act!r} (they have the SiLU MLP only)"
    head_dim = _field(cfg, "head_dim") or _field(cfg, "hidden_size") // _field(cfg, "num_attention_heads")
    if head_dim % FUSED_HEAD_DIM_MULTIPLE:
        return (f"head_dim {head_dim} (ONNX Runtime's CPU GroupQueryAttention takes multiples of "
                f"{FUSED_HEAD_DIM_MULTIPLE})")
    return None


def check_same_vocab(target_dir: Path, draft_dir: Path, target_cfg: dict, draft_cfg: dict) -> None:
    """A draft must speak the target's vocabulary, or its tokens mean nothing. Checked with whatever
    the draft has (it may ship no tokenizer.json): vocab_size, every token id both sides name, the
    draft's bos/eos ids against the target's special tokens, and identical tokenizer.model files."""
    tsize, dsize = target_cfg.get("vocab_size"), draft_cfg.get("vocab_size")
    if not isinstance(dsize, int) or isinstance(dsize, bool) or dsize < 1:
        raise SpecDeployError(f"vocabulary mismatch: the draft's config.json has no valid vocab_size (got {dsize!r})")
    tv, dv = tokenizer_vocab(target_dir), tokenizer_vocab(draft_dir)
    if tv is not None and dv is not None and tv != dv:
        differing = len(set(tv.items()) ^ set(dv.items()))
        raise SpecDeployError(
            f"vocabulary mismatch: target and draft tokenizers differ ({differing} differing entries)")
    target_table, draft_table = token_table(target_dir, target_cfg), token_table(draft_dir, draft_cfg)
    if tsize != dsize:
        # Sizes may differ by embedding padding alone (Qwen2.5-7B: 152,064 rows, its 0.5B draft 151,936):
        # the same tokenizer both sides, every id it names within both.
        named = max([*target_table, *draft_table], default=-1) + 1
        if tv is None or dv is None or named > min(tsize, dsize):
            raise SpecDeployError(f"vocabulary mismatch: target vocab_size {tsize} != draft vocab_size {dsize}"
                                  + (" (sizes may differ by padding only: both need the same tokenizer.json)"
                                     if tv is None or dv is None else
                                     f"; their tokenizer names ids up to {named - 1}"))
    differ = sorted(i for i in set(target_table) & set(draft_table) if target_table[i] != draft_table[i])
    if differ:
        i = differ[0]
        raise SpecDeployError(f"vocabulary mismatch: token {i} is {target_table[i]!r} in the target's tokenizer and "
                              f"{draft_table[i]!r} in the draft's ({len(differ)} ids differ)")
    specials = _added_tokens(target_dir)[1]
    for name, ids in special_token_ids(draft_dir, draft_cfg).items():
        for i in ids:
            if not 0 <= i < tsize:
                raise SpecDeployError(f"vocabulary mismatch: the draft's {name}_id {i} is outside the vocabulary "
                                      f"({tsize} tokens)")
            if specials and i not in specials and i in target_table:
                raise SpecDeployError(f"vocabulary mismatch: the draft's {name}_id {i} is {target_table[i]!r} in the "
                                      "target's tokenizer, not a special token")
    models = [Path(d) / "tokenizer.model" for d in (target_dir, draft_dir)]
    if all(m.is_file() for m in models) and models[0].read_bytes() != models[1].read_bytes():
        raise SpecDeployError("vocabulary mismatch: the target's and the draft's tokenizer.model files differ")
