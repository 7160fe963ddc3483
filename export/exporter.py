"""HF model directories -> static-shape ONNX graphs + manifest + reference outputs."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ..runtime.config import ExportConfig, load_export_config, to_dict
from ..runtime.errors import SpecDeployError
from ..runtime.graph_contract import (
    DECODER,
    DRAFT,
    FUSED,
    PORTABLE,
    TARGET,
    GraphRecord,
    KVGeometry,
    ModelRecord,
    decoder_graph_name,
    decoder_io,
    graph_file,
    weights_file,
)
from ..runtime.manifest import MANIFEST_NAME, Manifest, load_manifest, set_check, sha256_file, write_manifest
from ..runtime.manifest_fields import CHECK_PASSED, CHECK_PENDING, CHECK_SKIPPED
from ..runtime.methods import REGISTRY, method_spec
from .batched_graph import write_batched_target
from .decoder_graph import DecoderGraph
from .draft_vocab import read_draft_vocab, restrict_lm_head
from .fused_graph import FUSED_DTYPES, build_fused_decoder, write_fused
from .hf_loading import DTYPES, check_same_vocab, load_causal_lm, read_hf_config
from .method_export import MethodExport, load_export_step
from .onnx_writer import SharedWeights, decoder_dynamic_axes, export_module
from .out_dir import Staging, checked_out_dir
from .quantize import QuantPlan, quantize_export
from .reference import CHECK_DIR, decoder_feeds, save_reference, torch_reference

DRAFT_VOCAB_IDS = "draft_vocab.npy"  # int64 [N]: the target id of each column of a restricted LM head's logits
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json")  # a chat template as transformers writes it


def model_spec(name: str, model, source: Path, feature_layers: tuple[int, ...] = ()) -> ModelRecord:
    """The manifest record of an HF causal LM exported as `name`."""
    cfg = model.config
    extra = {"max_position_embeddings": getattr(cfg, "max_position_embeddings", None)}
    if feature_layers:
        extra["feature_layers"] = list(feature_layers)
    return ModelRecord.from_geometry(name, KVGeometry.from_config(cfg), cfg.hidden_size, cfg.vocab_size,
                                     architecture=(cfg.architectures or [type(model).__name__])[0],
                                     model_type=cfg.model_type, source=str(Path(source).resolve()), extra=extra)


def check_context(name: str, cfg: dict, max_context: int) -> None:
    limit = cfg.get("max_position_embeddings")
    if limit and max_context > limit:
        raise SpecDeployError(f"max_context {max_context} exceeds {name}'s max_position_embeddings {limit}")
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    if window and max_context > window:
        raise SpecDeployError(f"max_context {max_context} exceeds {name}'s sliding window {window} (not supported)")


def special_tokens(target_dir: Path, cfg: dict) -> dict:
    eos = cfg.get("eos_token_id")
    gen_path = Path(target_dir) / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id", eos)
    eos_ids = [] if eos is None else (list(eos) if isinstance(eos, list) else [eos])
    return {"bos_token_id": cfg.get("bos_token_id"), "eos_token_ids": eos_ids, "pad_token_id": cfg.get("pad_token_id")}


SAMPLE_TOKENS, SAMPLE_PAST = 3, 3  # the call the portable graphs are traced with


class DecoderExporter:
    """Exports one model's decoder at several static token counts, weights shared.

    `vocab_subset`: the logits score only these token ids (a draft vocabulary: the LM head keeps
    their rows; DRAFT_VOCAB_IDS maps the columns back, named in the model's record)."""

    def __init__(self, name: str, model, source: Path, out: Path, dtype: str, max_context: int, progress,
                 feature_layers: tuple[int, ...] = (), fused: bool = True, batched_tokens: int | None = None,
                 vocab_subset: list[int] | None = None):
        self.name, self.out, self.progress = name, out, progress
        self.feature_layers = tuple(feature_layers)
        self.record = model_spec(name, model, source, self.feature_layers)  # input ids: the full vocabulary
        if vocab_subset is not None:
            model = restrict_lm_head(model, vocab_subset)
            np.save(out / DRAFT_VOCAB_IDS, np.asarray(vocab_subset, dtype=np.int64))
            self.record = replace(self.record, extra={**self.record.extra, "draft_vocab_size": len(vocab_subset),
                                                      "draft_vocab_file": DRAFT_VOCAB_IDS})
        self.model = model
        self.wrapper = DecoderGraph(model, feature_layers).eval()
        self.dtype = DTYPES[dtype]
        self.max_context = max_context
        self.weights = SharedWeights(out, weights_file(name))
        io = decoder_io(self.record.num_layers, bool(feature_layers))
        self.inputs, self.outputs = list(io.inputs), list(io.outputs)
        self.fused = fused and dtype in FUSED_DTYPES
        if fused and not self.fused:
            progress(f"  {name}: no fused graphs for {dtype} (they are {', '.join(FUSED_DTYPES)} only); "
                     "ONNX Runtime will run the portable graphs")
        self.fused_weights = SharedWeights(out, weights_file(name, FUSED)) if self.fused else None
        # the call whose reference the batched graph (export/batched_graph.py) shares, if it is written
        self.batched_tokens = batched_tokens if self.fused else None
        self.traced: Path | None = None  # the portable graph traced for the first T
        self.fused_built: Path | None = None  # and its fused twin

    def export(self, tokens: int) -> dict[str, GraphRecord]:
        """The portable graph for `tokens` (and its fused twin), each with its PyTorch reference."""
        graph = decoder_graph_name(self.name, tokens)
        start = time.perf_counter()
        geometry = self.record.to_json()  # what decoder_feeds reads: num_layers, num_kv_heads, head_dim
        vocab = self.record.vocab_size
        dynamic = decoder_dynamic_axes(self.inputs, self.outputs)  # T too: one graph content for every T
        path = self.out / graph_file(graph)
        if self.traced is None:
            # A non-trivial past and T (not 1, which a tracer may specialize) keep both dynamic.
            feeds = decoder_feeds(SAMPLE_TOKENS, SAMPLE_PAST, geometry, vocab, self.dtype, seed=SAMPLE_TOKENS)
            args = [torch.from_numpy(feeds[n]) for n in self.inputs]
            export_module(self.wrapper, args, path, self.inputs, self.outputs, dynamic, self.weights)
            self.traced = path
        else:  # the same graph for this T: copied, not traced again (~15 s a graph on SmolLM2), then
            shutil.copyfile(self.traced, path)  # checked against this T's own reference like every graph
        ref_feeds = decoder_feeds(tokens, min(37, self.max_context - tokens), geometry, vocab, self.dtype,
                                  seed=1000 + tokens)
        ref_outputs = torch_reference(self.wrapper, ref_feeds, self.inputs, self.outputs)
        save_reference(self.out, graph, ref_feeds, ref_outputs)
        self.progress(f"  exported {graph_file(graph)} (T={tokens}) in {time.perf_counter() - start:.1f}s")
        made = {graph: GraphRecord.new(graph, self.name, DECODER, tokens, flavor=PORTABLE)}
        if self.fused:
            fused = self._export_fused(tokens, ref_feeds, ref_outputs)
            made[fused.name] = fused
        if tokens == self.batched_tokens:
            start = time.perf_counter()
            batched = write_batched_target(self.model, self.out, self.max_context, ref_feeds, ref_outputs, tokens)
            made[batched.name] = batched
            self.progress(f"  wrote {batched.file} (batched, for serve --batch) in {time.perf_counter() - start:.1f}s")
        return made

    def _export_fused(self, tokens: int, ref_feeds: dict, ref_outputs) -> GraphRecord:
        graph = decoder_graph_name(self.name, tokens, FUSED)
        # The same file for every T (build_fused_decoder): built once, then copied.
        model = None if self.fused_built else build_fused_decoder(self.model, tokens, self.max_context,
                                                                  self.feature_layers)
        write_fused(model, self.out, graph, self.fused_weights, ref_feeds, ref_outputs, tokens, self.fused_built)
        self.fused_built = self.fused_built or self.out / graph_file(graph)
        self.progress(f"  wrote {graph_file(graph)} (ORT fused ops, KV in place)")
        return GraphRecord.new(graph, self.name, DECODER, tokens, flavor=FUSED)


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


def draft_token_counts(cfg: ExportConfig) -> list[int]:
    """1 to draft; 2 to catch up after a fully accepted step (the last draft and the bonus
    token; a padded T=64 call cost 2-6x a T=2 one, two T=1 calls about 2x, and near the context
    end the chunk's graph does not fit); the chunk for the prompt."""
    return sorted(t for t in {1, 2, cfg.prefill_chunk} if t < cfg.max_context)


def export_methods(overrides: dict[str, dict], sources: dict[str, Path | None]) -> dict:
    """The validated config of every registered method this export can have (one that needs
    an input, MethodSpec.export_input, only when it is given); `overrides` from the config files."""
    for name in overrides:
        method_spec(name)  # an unknown method name is an error even where it would not be exported
    return {name: spec.parse(overrides.get(name)) for name, spec in REGISTRY.items()
            if spec.export_input is None or sources[spec.export_input] is not None}


def export_all(target: Path, out: Path, draft: Path | None = None, dtype: str = "float32",
               config: Path | None = None, progress=print, eagle: Path | None = None,
               medusa: Path | None = None, medusa_tree: str | None = None, fused: bool = True,
               check: Callable[[Manifest], None] | None = None, quantize: QuantPlan | None = None,
               batched: bool = True) -> Path:
    """The whole export. `draft` (a draft model), `eagle` (an EAGLE head dir) and `medusa` (a Medusa
    heads dir, published layout) add the methods that need them; `medusa_tree` overrides
    methods.medusa.tree; `fused` adds each decoder's ORT-CPU graphs (export/fused_graph.py)
    beside the portable ones. `quantize` rewrites the fused graphs of its models with int4/int8
    weights (export/quantize.py; the portable graphs stay float) and records the scheme in the
    manifest's `quantization`. `batched` adds the target's batched fused graph (continuous
    batching: export/batched_graph.py) where float fused target graphs are written.

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
    methods = export_methods(overrides, sources)
    steps: dict[str, MethodExport] = {name: load_export_step(spec.export_step)(sources[spec.export_input])
                                      for name, spec in REGISTRY.items() if name in methods and spec.export_step}
    token_counts = target_token_counts(cfg, methods)  # config errors before anything is written
    if quantize is not None:
        quantize.check_fused(dtype, fused)
    torch.manual_seed(0)
    target_cfg = read_hf_config(target)
    check_context("target", target_cfg, cfg.max_context)
    draft_cfg = None
    if draft is not None:
        draft_cfg = read_hf_config(draft)
        check_same_vocab(Path(target), Path(draft), target_cfg, draft_cfg)
        check_context("draft", draft_cfg, cfg.max_context)
    if not (Path(target) / "tokenizer.json").is_file():
        raise SpecDeployError(f"{target} has no tokenizer.json (a fast tokenizer is required at run time)")
    for name, step in steps.items():  # heads checked against the target before anything is written
        methods[name] = step.check(target_cfg, methods[name], progress)
    inputs = {"target": target, "draft": draft, "eagle": eagle, "medusa": medusa, "config": config}
    real_out = checked_out_dir(Path(out), inputs)  # before any model loads: --out never eats an input
    with Staging(real_out, progress) as stage:
        # A quantized target's rows would not equal its batch-1 output through a float batched graph.
        batched = batched and (quantize is None or TARGET not in quantize.schemes)
        graphs, models = _write_export(stage.path, target, draft, dtype, cfg, methods, steps, token_counts,
                                       fused, batched, progress)
        facts = {}
        if quantize is not None:  # over the written fused graphs, before their checksums
            facts["quantization"] = quantize_export(stage.path, graphs, quantize, progress)
        files = {str(p.relative_to(stage.path)): sha256_file(p) for p in sorted(stage.path.rglob("*"))
                 if p.is_file() and p.relative_to(stage.path).parts[0] != CHECK_DIR}
        seconds = round(time.perf_counter() - start, 1)
        write_manifest(stage.path, dtype=dtype, max_context=cfg.max_context, prefill_chunk=cfg.prefill_chunk,
                       models=models, graphs=graphs,
                       tokenizer={"dir": "tokenizer", **special_tokens(Path(target), target_cfg)},
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


def _write_export(out: Path, target: Path, draft: Path | None, dtype: str, cfg: ExportConfig, methods: dict,
                  steps: dict[str, MethodExport], token_counts: list[int], fused: bool, batched: bool, progress):
    """Graphs, references and tokenizer files into `out` (the staging directory); (graphs, models)."""
    graphs, models = {}, {}
    progress(f"loading target from {target} ({dtype})")
    target_model = load_causal_lm(Path(target), dtype)
    feature_layers = tuple(layer for step in steps.values() for layer in step.prepare(target_model, progress))
    # The batched graph's reference is one row of the prefill chunk's call (a tree mask, a past).
    exporter = DecoderExporter(TARGET, target_model, target, out, dtype, cfg.max_context, progress, feature_layers,
                               fused, batched_tokens=cfg.prefill_chunk if batched else None)
    models[TARGET] = exporter.record
    for t in token_counts:
        graphs.update(exporter.export(t))
    if draft is not None:
        progress(f"loading draft from {draft} ({dtype})")
        draft_model = load_causal_lm(Path(draft), dtype)
        subset = read_draft_vocab(Path(draft), methods["draft"].draft_vocab, draft_model.config.vocab_size, DRAFT,
                                  progress)
        dexp = DecoderExporter(DRAFT, draft_model, draft, out, dtype, cfg.max_context, progress, fused=fused,
                               vocab_subset=subset)
        if subset is not None:
            progress(f"  the draft drafts among the {len(subset)} most frequent tokens (draft_vocab.json)")
        models[DRAFT] = dexp.record
        for t in draft_token_counts(cfg):
            graphs.update(dexp.export(t))
    ctx = {"out": out, "target_model": target_model, "graphs": graphs, "models": models,
           "methods": methods, "cfg": cfg, "dtype": dtype, "progress": progress,
           "fused": fused and dtype in FUSED_DTYPES}
    for step in steps.values():
        step(ctx)
    tok_dir = out / "tokenizer"
    tok_dir.mkdir()
    for fname in TOKENIZER_FILES:
        if (Path(target) / fname).is_file():
            shutil.copy(Path(target) / fname, tok_dir / fname)
    return graphs, models
