"""HF model directories -> static-shape ONNX graphs + manifest + reference outputs.

`export_all` checks every input (configs, model directories, vocabularies, heads, --out) before
it imports the graph writers (export/decoder_export.py: torch and transformers, ~10 s), so a bad
input is one clear error within a second."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..runtime.config import ExportConfig, load_export_config, load_yaml, to_dict
from ..runtime.errors import SpecDeployError
from ..runtime.graph_contract import DRAFT, TARGET
from ..runtime.manifest import MANIFEST_NAME, Manifest, load_manifest, set_check, sha256_file, write_manifest
from ..runtime.manifest_fields import CHECK_PASSED, CHECK_PENDING, CHECK_SKIPPED
from ..runtime.methods import REGISTRY, method_spec
from ..runtime.tree_files import TreePaths
from .hf_loading import (
    check_loadable,
    check_same_vocab,
    fused_unsupported,
    is_self_draft,
    longrope_window,
    model_json,
    read_hf_config,
)
from .method_export import MethodExport, load_export_step
from .out_dir import OWNED, Staging, checked_out_dir

if TYPE_CHECKING:
    from .quantize import QuantPlan


def context_limit(cfg: dict) -> tuple[int | None, str]:
    """The longest context a model's config lets an export take, and which field says so."""
    limit, why = cfg.get("max_position_embeddings"), "max_position_embeddings"
    window = longrope_window(cfg)
    if window is not None and not (isinstance(limit, int) and limit <= window):
        limit, why = window, "longrope original_max_position_embeddings"
    return (limit if isinstance(limit, int) and not isinstance(limit, bool) else None), why


def check_context(name: str, cfg: dict, max_context: int) -> None:
    limit, why = context_limit(cfg)
    if limit and max_context > limit:
        raise SpecDeployError(f"max_context {max_context} exceeds {name}'s {why} {limit}: set "
                              f"max_context: {limit} (or less) in a --config YAML")
    window = sliding_window(cfg)
    if window and max_context > window:
        raise SpecDeployError(f"max_context {max_context} exceeds {name}'s sliding window {window} (not supported): "
                              f"set max_context: {window} (or less) in a --config YAML")


def check_tokenizer(target: Path, target_cfg: dict) -> None:
    """The target's tokenizer as the runtime will load it: a corrupt tokenizer.json, or one with tokens the
    model has no embedding rows for, is refused here, not published as a checked export that every
    `generate` then refuses."""
    from ..runtime.tokenizer import TextTokenizer

    size, vocab = TextTokenizer(target).vocab_size, target_cfg.get("vocab_size")
    if isinstance(vocab, int) and size > vocab:
        raise SpecDeployError(f"vocabulary mismatch: {target}'s tokenizer has {size} tokens, its config.json "
                              f"vocab_size is {vocab} (tokens added without new embedding rows: resize them, "
                              f"model.resize_token_embeddings(len(tokenizer)), and save the model again)")


def sliding_window(cfg: dict) -> int | None:
    """The window some layer attends within, as transformers reads config.json; None: every layer
    attends the whole context. Mistral's window holds for every layer; Qwen2's and Qwen3's only with
    use_sliding_window, and only for the layers `layer_types` names (by default those from
    max_window_layers on: none when it is at least the layer count)."""
    window = cfg.get("sliding_window")
    if not window or not cfg.get("use_sliding_window", True):
        return None
    types = cfg.get("layer_types")
    if isinstance(types, list):
        return window if "sliding_attention" in types else None
    first = cfg.get("max_window_layers")
    layers = cfg.get("num_hidden_layers")
    if isinstance(first, int) and isinstance(layers, int) and first >= layers:
        return None
    return window


def fit_context(cfg: ExportConfig, config: Path | None, target_cfg: dict, progress) -> ExportConfig:
    """ExportConfig's max_context is a default, and a small model may not reach it: unless the user's
    --config sets max_context, take the target's max_position_embeddings then (said in one line)."""
    limit, why = context_limit(target_cfg)
    if limit is None or not 2 <= limit < cfg.max_context \
            or (config is not None and "max_context" in load_yaml(config)):
        return cfg
    progress(f"max_context {limit}: the target's {why}, below the default {cfg.max_context} "
             "(max_context in a --config YAML chooses)")
    return replace(cfg, max_context=limit, prefill_chunk=min(cfg.prefill_chunk, limit // 2))


def special_tokens(target_dir: Path, cfg: dict) -> dict:
    eos = cfg.get("eos_token_id")
    gen_path = Path(target_dir) / "generation_config.json"
    generation = model_json(gen_path)
    if isinstance(generation, dict):
        eos = generation.get("eos_token_id", eos)
    eos_ids = [] if eos is None else (list(eos) if isinstance(eos, list) else [eos])
    return {"bos_token_id": cfg.get("bos_token_id"), "eos_token_ids": eos_ids, "pad_token_id": cfg.get("pad_token_id")}


def target_token_counts(cfg: ExportConfig, methods: dict) -> list[int]:
    counts = {1, cfg.prefill_chunk}
    for method, config in methods.items():
        tokens = config.verify_tokens
        if tokens >= cfg.max_context:
            raise SpecDeployError(f"config: methods.{method} needs a verify graph of {tokens} tokens, "
                                  f"which does not fit max_context {cfg.max_context}")
        counts.add(tokens)
    if max(counts) >= cfg.max_context:
        raise SpecDeployError(f"a graph of {max(counts)} tokens does not fit max_context {cfg.max_context}")
    return sorted(counts)


def export_methods(overrides: dict[str, dict], sources: dict[str, Path | None]) -> dict:
    """The validated config of every registered method this export can have (one that needs
    an input, MethodSpec.export_input, only when it is given); `overrides` from the config files."""
    for name in overrides:
        method_spec(name)  # an unknown method name is an error even where it would not be exported
    return {name: spec.parse(overrides.get(name)) for name, spec in REGISTRY.items()
            if spec.export_input is None or sources[spec.export_input] is not None}


def tree_files(methods: dict) -> dict[str, Path]:
    """{what names it: path} of each tree file a method's config was read from (--tree, a config's
    `tree`): inputs like the model dirs, which an export must not replace with its --out."""
    files = {}
    for name, config in methods.items():
        resolved = getattr(config, "tree_paths", None)
        if isinstance(resolved, TreePaths) and Path(resolved.name).expanduser().is_file():  # not a name or inline
            files[f"methods.{name}.tree"] = Path(resolved.name).expanduser()
    return files


def export_all(target: Path, out: Path, draft: Path | None = None, dtype: str = "float32",
               config: Path | None = None, progress=print, eagle: Path | None = None,
               medusa: Path | None = None, medusa_tree: str | None = None, fused: bool = True,
               check: Callable[[Manifest], None] | None = None, quantize: QuantPlan | None = None,
               batched: bool = True, exact_rows: bool = False) -> Path:
    """The whole export. `draft` (a draft model), `eagle` (an EAGLE head dir) and `medusa` (a Medusa
    heads dir, published layout) add the methods that need them; `medusa_tree` overrides
    methods.medusa.tree; `fused` adds each decoder's ORT-CPU graphs (export/fused_graph.py)
    beside the portable ones. `quantize` rewrites the fused graphs of its models with int4/int8
    weights (export/quantize.py; the portable graphs stay float) and records the scheme in the
    manifest's `quantization`. `batched` adds the target's batched fused graph (continuous
    batching: export/batched_graph.py) where float fused target graphs are written. `exact_rows`
    pads a float target's fused attentions as a quantized target's are, so that every method's
    greedy output is `ar`'s bit for bit (export/exact_rows.py; the manifest's `exact_rows`).

    Everything is written to a staging directory beside `out` (export/out_dir.py) and swapped in
    only at the end, after `check` (the accuracy check: raises SpecDeployError on a failure) has
    passed on the staged export as the runtime loads it; until then `out` is untouched. The
    manifest records `check: passed`, or `skipped` without one."""
    start = time.perf_counter()
    cfg, overrides = load_export_config(config)
    if medusa_tree is not None:
        if medusa is None:
            raise SpecDeployError("--tree chooses the Medusa tree: it needs --medusa DIR")
        overrides["medusa"] = {**overrides.get("medusa", {}), "tree": medusa_tree}
    sources = {"draft": draft, "eagle": eagle, "medusa": medusa}  # what MethodSpec.export_input names
    for source, what in ((eagle, "EAGLE head"), (medusa, "Medusa heads")):  # before their exporters import torch
        if source is not None and not Path(source).is_dir():  # and transformers (5 s), then load the target
            raise SpecDeployError(f"{what} directory not found: {source}")
    methods = export_methods(overrides, sources)
    steps: dict[str, MethodExport] = {name: load_export_step(spec.export_step)(sources[spec.export_input])
                                      for name, spec in REGISTRY.items() if name in methods and spec.export_step}
    if quantize is not None:
        quantize.check_fused(dtype, fused)
    quantized_target = quantize is not None and TARGET in quantize.schemes
    if exact_rows and not fused:
        raise SpecDeployError("--exact-rows pads the ORT CPU fused graphs: drop --no-fused")
    if exact_rows and quantized_target:
        progress("  --exact-rows: a quantized target's rows are exact already (its attentions are padded)")
    target_cfg = read_hf_config(target)
    cfg = fit_context(cfg, config, target_cfg, progress)
    token_counts = target_token_counts(cfg, methods)  # config errors before anything is written
    check_loadable(target, target_cfg)
    check_context("target", target_cfg, cfg.max_context)
    draft_cfg = None
    if draft is not None:
        draft_cfg = read_hf_config(draft)
        check_loadable(draft, draft_cfg)
        check_same_vocab(Path(target), Path(draft), target_cfg, draft_cfg)
        check_context("draft", draft_cfg, cfg.max_context)
        if is_self_draft(target, draft) and methods["draft"].draft_vocab:
            # the target's whole LM head: its dir holds no draft vocabulary, and the manifest says so
            methods["draft"] = replace(methods["draft"], draft_vocab=0)
    if quantize is not None:
        for model, model_cfg in ((TARGET, target_cfg), (DRAFT, draft_cfg)):
            reason = model_cfg is not None and model in quantize.schemes and fused_unsupported(model_cfg)
            if reason:
                raise SpecDeployError(f"quantized weights rewrite the fused ORT CPU graphs, and the {model} can have "
                                      f"none: {reason}")
    specials = special_tokens(Path(target), target_cfg)  # generation_config.json read before minutes of export
    if not (Path(target) / "tokenizer.json").is_file():
        raise SpecDeployError(f"{target} has no tokenizer.json (a fast tokenizer is required at run time)")
    check_tokenizer(Path(target), target_cfg)
    for name, step in steps.items():  # heads checked against the target before anything is written
        methods[name] = step.check(target_cfg, methods[name], progress)
    inputs = {"--target": target, "--draft": draft, "--eagle": eagle, "--medusa": medusa, "--config": config,
              **tree_files(methods)}
    real_out = checked_out_dir(Path(out), inputs)  # before any model loads: --out never eats an input
    from .decoder_export import write_graphs  # the inputs are checked: now the graph writers (torch)
    from .reference import CHECK_DIR
    with Staging(real_out, progress) as stage:
        # A quantized target's rows would not equal its batch-1 output through a float batched graph,
        # nor a padded one's (its decode rows run the one-row attention: export/exact_rows.py).
        batched = batched and not quantized_target and not exact_rows
        graphs, models = write_graphs(stage.path, target, draft, dtype, cfg, methods, steps, token_counts,
                                      fused, batched, progress,
                                      frozenset(quantize.schemes) if quantize is not None else frozenset())
        facts = {}
        if quantize is not None:  # over the written fused graphs, before their checksums
            from .quantize import quantize_export

            facts["quantization"] = quantize_export(stage.path, graphs, quantize, progress)
        if exact_rows and not quantized_target:
            from .exact_rows import pad_float_target

            facts["exact_rows"] = pad_float_target(stage.path, graphs, progress)
        files = {str(p.relative_to(stage.path)): sha256_file(p) for p in sorted(stage.path.rglob("*"))
                 if p.is_file() and p.relative_to(stage.path).parts[0] not in (CHECK_DIR, OWNED)}
        seconds = round(time.perf_counter() - start, 1)
        write_manifest(stage.path, dtype=dtype, max_context=cfg.max_context, prefill_chunk=cfg.prefill_chunk,
                       models=models, graphs=graphs,
                       tokenizer={"dir": "tokenizer", **specials},
                       methods={name: to_dict(settings) for name, settings in methods.items()}, files=files,
                       check=CHECK_PENDING if check else CHECK_SKIPPED, exported_in_s=seconds, **facts)
        # The staged export as the runtime will load it (every field and path validated); checksums
        # were just computed from these files.
        manifest = load_manifest(stage.path, verify_checksums=False, allow_pending=True)
        if check is not None:
            check(manifest)
            set_check(stage.path, CHECK_PASSED)
        stage.publish()
    progress(f"wrote {Path(out) / MANIFEST_NAME}: {len(graphs)} graphs in {seconds}s"
             f"{'' if check else ' (accuracy check skipped)'}")
    return Path(out)
