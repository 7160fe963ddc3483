"""Writing an export's decoder graphs: each model's portable and fused graphs at its static T, the
target's batched graph, and the method steps' graphs, with their PyTorch references.

export/exporter.py validates the inputs first and imports this module (torch, transformers)
only then, so a bad input is reported in a second rather than after ~10 s of imports."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ..runtime.config import ExportConfig
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
from .batched_graph import write_batched_target
from .decoder_graph import DecoderGraph
from .draft_vocab import read_draft_vocab, restrict_lm_head, with_input_vocab
from .fused_graph import FUSED_DTYPES, build_fused_decoder, write_fused
from .hf_loading import fused_unsupported, is_self_draft, load_causal_lm, torch_dtype
from .method_export import MethodExport
from .onnx_writer import SharedWeights, decoder_dynamic_axes, export_module
from .reference import CHECK_DIR, decoder_feeds, reference_paths, save_reference, torch_reference

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


SAMPLE_TOKENS, SAMPLE_PAST = 3, 3  # the call the portable graphs are traced with


class DecoderExporter:
    """Exports one model's decoder at several static token counts, weights shared.

    `vocab_subset`: the logits score only these token ids (a draft vocabulary: the LM head keeps
    their rows; DRAFT_VOCAB_IDS maps the columns back, named in the model's record)."""

    def __init__(self, name: str, model, source: Path, out: Path, dtype: str, max_context: int, progress,
                 feature_layers: tuple[int, ...] = (), fused: bool = True, batched_tokens: int | None = None,
                 vocab_subset: list[int] | None = None, reuse: DecoderExporter | None = None,
                 reuse_fused: bool = False):
        """Each payload is stored once (onnx_writer.SharedWeights): the fused graphs read the portable
        file for the weights they keep as they are (all but the fused QKV), and `reuse`, an exporter
        written before, lends its portable file always (never rewritten) and its fused one when
        `reuse_fused` (that model is not quantized after)."""
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
        self.dtype = torch_dtype(dtype)
        self.max_context = max_context
        self.weights = SharedWeights(out, weights_file(name), () if reuse is None else (reuse.weights,))
        io = decoder_io(self.record.num_layers, bool(feature_layers))
        self.inputs, self.outputs = list(io.inputs), list(io.outputs)
        unfused = (f"{dtype} weights (they are {', '.join(FUSED_DTYPES)} only)" if dtype not in FUSED_DTYPES
                   else fused_unsupported(model.config))
        self.fused = fused and unfused is None
        if fused and not self.fused:
            progress(f"  {name}: no fused graphs for {unfused}; ONNX Runtime will run the portable graphs")
        fused_reuse = (self.weights,) + (() if reuse is None else (reuse.weights,))
        if reuse is not None and reuse_fused and reuse.fused_weights is not None:
            fused_reuse += (reuse.fused_weights,)
        self.fused_weights = SharedWeights(out, weights_file(name, FUSED), fused_reuse) if self.fused else None
        # the call whose reference the batched graph (export/batched_graph.py) shares, if it is written
        self.batched_tokens = batched_tokens if self.fused else None
        self.traced: Path | None = None  # the portable graph traced for the first T
        self.fused_built: Path | None = None  # and its fused twin
        self.same_as: DecoderExporter | None = None  # whose written graphs this model's are (same_graphs_as)

    def same_graphs_as(self, other: DecoderExporter, fused: bool) -> None:
        """This model's graphs are `other`'s (a self-draft of a target without feature outputs): copy
        its written graph files rather than trace and build them again (~15 s on SmolLM2); they read
        `other`'s weight files, so its fused one only if `fused` (not rewritten by quantization)."""
        assert other.feature_layers == self.feature_layers == () and other.record.vocab_size == self.record.vocab_size
        self.traced = other.traced
        if fused:
            self.fused_built = other.fused_built
        self.same_as = other

    def _linked_references(self, tokens: int) -> bool:
        """For a copy of `same_as`'s graphs: its references of this T (the same graph, called with the
        same seeded feeds) hard-linked under this model's names, not computed and stored again.
        False where it has none (a T only this model exports) or a graph here is not its copy."""
        other = self.same_as
        names = [(decoder_graph_name(other.name, tokens), decoder_graph_name(self.name, tokens))]
        if self.fused:
            if self.fused_built is None or self.fused_built != other.fused_built:
                return False
            names.append((decoder_graph_name(other.name, tokens, FUSED), decoder_graph_name(self.name, tokens, FUSED)))
        check = self.out / CHECK_DIR
        pairs = [(src, dst) for theirs, ours in names
                 for src, dst in zip(reference_paths(check, theirs), reference_paths(check, ours))]
        if not all(src.is_file() for src, _ in pairs):
            return False
        for src, dst in pairs:
            try:
                os.link(src, dst)
            except OSError:  # a filesystem without hard links
                shutil.copyfile(src, dst)
        return True

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
        if self.same_as is not None and self.batched_tokens != tokens and self._linked_references(tokens):
            made = {graph: GraphRecord.new(graph, self.name, DECODER, tokens, flavor=PORTABLE)}
            if self.fused:
                fused = decoder_graph_name(self.name, tokens, FUSED)
                shutil.copyfile(self.fused_built, self.out / graph_file(fused))
                made[fused] = GraphRecord.new(fused, self.name, DECODER, tokens, flavor=FUSED)
            self.progress(f"  copied {self.same_as.name}'s graphs and references for T={tokens} "
                          f"in {time.perf_counter() - start:.1f}s")
            return made
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
            # its weights are the fused graph's (written by now, and not quantized: no batched graph then)
            batched = write_batched_target(self.model, self.out, self.max_context, ref_feeds, ref_outputs, tokens,
                                           reuse=(self.fused_weights,))
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


def draft_token_counts(cfg: ExportConfig) -> list[int]:
    """1 to draft; 2 to catch up after a fully accepted step (the last draft and the bonus
    token; a padded T=64 call cost 2-6x a T=2 one, two T=1 calls about 2x, and near the context
    end the chunk's graph does not fit); the chunk for the prompt."""
    return sorted(t for t in {1, 2, cfg.prefill_chunk} if t < cfg.max_context)


def write_graphs(out: Path, target: Path, draft: Path | None, dtype: str, cfg: ExportConfig, methods: dict,
                 steps: dict[str, MethodExport], token_counts: list[int], fused: bool, batched: bool, progress,
                 quantized: frozenset[str] = frozenset()):
    """Graphs, references and tokenizer files into `out` (the staging directory); (graphs, models).
    `quantized`: the models whose fused weight files quantization rewrites after: no other model's
    graph may reference those (a payload another model shares is stored once, in the target's files)."""
    torch.manual_seed(0)
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
        same = is_self_draft(target, draft)  # the target's own weights: read once (nothing mutates them)
        progress(f"draft: the target's model ({dtype})" if same else f"loading draft from {draft} ({dtype})")
        draft_model = target_model if same else load_causal_lm(Path(draft), dtype)
        vocab, draft_vocab = target_model.config.vocab_size, draft_model.config.vocab_size
        shared = min(vocab, draft_vocab)  # sizes differ by embedding padding only (hf_loading.check_same_vocab)
        subset = read_draft_vocab(Path(draft), methods["draft"].draft_vocab, shared, DRAFT, progress)
        if subset is not None:
            progress(f"  the draft drafts among the {len(subset)} most frequent tokens (draft_vocab.json)")
        if draft_vocab != vocab:
            progress(f"  the draft's vocab_size is {draft_vocab}, the target's {vocab} (padding): it reads every "
                     f"target token and drafts among the first {shared}")
            draft_model = with_input_vocab(draft_model, vocab)
            subset = subset if subset is not None else list(range(shared))
        dexp = DecoderExporter(DRAFT, draft_model, draft, out, dtype, cfg.max_context, progress, fused=fused,
                               vocab_subset=subset, reuse=exporter, reuse_fused=TARGET not in quantized)
        if subset is None and same and not feature_layers:
            dexp.same_graphs_as(exporter, fused=TARGET not in quantized)
        models[DRAFT] = dexp.record
        for t in draft_token_counts(cfg):
            graphs.update(dexp.export(t))
    ctx = {"out": out, "target_model": target_model, "graphs": graphs, "models": models,
           "methods": methods, "cfg": cfg, "dtype": dtype, "progress": progress,
           "fused": fused and dtype in FUSED_DTYPES,
           # the target's weight files a head's graphs may reference (its embedding), per flavor; the
           # fused one only if quantization does not rewrite it
           "target_weights": {PORTABLE: (exporter.weights,),
                              FUSED: (exporter.weights,) + (() if TARGET in quantized or exporter.fused_weights is None
                                                            else (exporter.fused_weights,))}}
    for step in steps.values():
        step(ctx)
    tok_dir = out / "tokenizer"
    tok_dir.mkdir()
    for fname in TOKENIZER_FILES:
        if (Path(target) / fname).is_file():
            shutil.copy(Path(target) / fname, tok_dir / fname)
    return graphs, models
