"""The fused ORT-CPU decoder graphs: accurate against PyTorch for every family, fused for real,
kept out of TensorRT's way, and chosen (or refused) by the runtime as asked."""

from __future__ import annotations

import json

import onnx
import pytest


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "mistral"])
def test_fused_graphs_match_pytorch_per_architecture(arch_exports, arch):
    """polygraphy on every fused graph: logits, hidden and the KV buffers written in place
    (Qwen3's per-head q/k norms, Qwen2's qkv biases, Mistral's config)."""
    from specdeploy.export.check import check_path

    results = {r.graph: r for r in check_path(arch_exports[arch])}
    fused = [name for name in results if "_fused_" in name]
    assert fused and {n.split("_")[0] for n in fused} == {"target", "draft"}
    bad = [f"{r.graph}: {r.detail}" for r in results.values() if not r.passed]
    assert not bad, bad


def test_fused_check_fails_on_a_wrong_graph(micro_export, tmp_path):
    """The fused reference is strict: one layer ignoring the tree (plain causal attention) fails."""
    import shutil

    from specdeploy.export.check import check_graph

    name = "target_fused_t9"  # a verify graph: its reference has a branching tree
    shutil.copy(micro_export / f"{name}.onnx", tmp_path / f"{name}.onnx")
    shutil.copytree(micro_export / "weights", tmp_path / "weights")
    (tmp_path / "check").mkdir()
    for reference_file in (micro_export / "check").glob(f"{name}.*"):
        shutil.copy(reference_file, tmp_path / "check")
    assert check_graph(tmp_path / f"{name}.onnx").passed
    m = onnx.load(str(tmp_path / f"{name}.onnx"), load_external_data=False)
    for node in m.graph.node:  # one attention layer sees the whole tree instead of the ancestors
        if node.op_type == "GroupQueryAttention":
            node.input[10] = ""
            break
    onnx.save(m, str(tmp_path / f"{name}.onnx"))
    assert not check_graph(tmp_path / f"{name}.onnx").passed


def test_fused_graph_is_a_few_nodes_per_layer(micro_export):
    manifest = json.loads((micro_export / "manifest.json").read_text())
    layers = manifest["models"]["target"]["num_layers"]
    portable = onnx.load(str(micro_export / "target_t1.onnx"), load_external_data=False)
    fused = onnx.load(str(micro_export / "target_fused_t1.onnx"), load_external_data=False)
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("GroupQueryAttention") == layers
    assert ops.count("SkipSimplifiedLayerNormalization") == 2 * layers
    # No KV concatenation (the cache is written in place): Concat only builds the attention bias
    # from T, once for all layers (T is a dynamic dimension).
    assert ops.count("Concat") <= 3 and ops.index("GroupQueryAttention") > max(
        i for i, op in enumerate(ops) if op == "Concat")
    assert len(ops) <= 12 * layers + 24 < len(portable.graph.node)  # + lengths and bias from T, once


def test_tensorrt_side_sees_only_portable_graphs(micro_export):
    """Engines, the TensorRT lint and profiles work from the portable graphs; fused ones are ORT-only."""
    from specdeploy.engines.lint import graph_files
    from specdeploy.runtime.manifest import load_manifest

    manifest = load_manifest(micro_export)
    assert set(manifest.trt_graphs()) == {n for n, g in manifest.graphs.items() if g.flavor == "portable"}
    assert all("_fused_" not in p.name for p in graph_files(micro_export))


def test_flavor_choice_is_validated(micro_export, tmp_path):
    import shutil

    from specdeploy.runtime.errors import SpecDeployError
    from specdeploy.runtime.loaded_export import LoadedExport

    with pytest.raises(SpecDeployError, match="unknown flavor"):
        LoadedExport(micro_export, flavor="fast")
    # An export without fused graphs (--no-fused, or float16): "fused" is refused, "auto" falls back.
    bare = tmp_path / "bare"
    shutil.copytree(micro_export, bare)
    manifest = json.loads((bare / "manifest.json").read_text())
    manifest["graphs"] = {k: v for k, v in manifest["graphs"].items() if v.get("flavor") != "fused"}
    (bare / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SpecDeployError, match="fused graphs need"):
        LoadedExport(bare, flavor="fused").decoder("target")
    assert not LoadedExport(bare).decoder("target").fused


def test_a_prefill_chunk_scores_only_its_last_row(micro_export):
    """The fused graph's logit_rows input: a prefill call returns the last row's logits (the
    same values as the full call's last row), every row's hidden state, and the same KV."""
    import numpy as np

    from specdeploy.runtime.loaded_export import LoadedExport

    export = LoadedExport(micro_export)
    target = export.decoder("target")
    assert target.fused
    ids = np.arange(5, 5 + 11)
    mask = np.tril(np.ones((11, 11), bool))
    target.reset()
    full = target.forward(ids, np.arange(11), mask)
    kv_full = {k: v[:, :, :11].copy() for k, v in target.cache.buffers().items()}
    target.reset()
    last = target.forward(ids, np.arange(11), mask, last_logits=True)
    assert full.logits.shape[0] == 11 and last.logits.shape[0] == 1
    # one row through the LM head may take another kernel than eleven: equal up to rounding
    np.testing.assert_allclose(last.logits[0], full.logits[-1], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(last.hidden, full.hidden)
    for name, buf in target.cache.buffers().items():
        np.testing.assert_array_equal(buf[:, :, :11], kv_full[name])
    target.reset()
    assert target.prefill(ids, chunk=4).logits.shape[0] == 1  # chunks of 4, 4, 3: the last row's logits


def test_a_long_prompt_is_prefilled_in_calls_past_the_largest_graph(micro_export):
    """On the fused dynamic-T graph a prefill call takes up to LONG_PREFILL rows (fewer calls, each
    streaming the weights once), and gives the same KV and logits, to the bit, as the export's chunks."""
    import numpy as np

    from specdeploy.runtime.backends.ort_decoder import LONG_PREFILL
    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.loaded_export import LoadedExport

    export = LoadedExport(micro_export)
    target = export.decoder("target")
    chunk = export.prefill_chunk
    limit = target.prefill_limit(chunk)
    assert limit == min(LONG_PREFILL, export.manifest.max_context - 1) > chunk == target.sizes[-1]
    ids = 5 + np.arange(limit + 100) % 90  # one full long call and a remainder (100 rows) at a T no binding keeps

    def prefilled(rows: int):
        target.reset()
        calls = target.calls
        step = target.prefill(ids, rows)
        kv = {k: v[:, :, : len(ids)].copy() for k, v in target.cache.buffers().items()}
        return target.calls - calls, step.logits, step.hidden, kv

    short_calls, *short = prefilled(chunk)
    long_calls, *long = prefilled(limit)
    assert (short_calls, long_calls) == (-(-len(ids) // chunk), 2)
    assert list(target._long_bindings) == [limit]  # the remainder's binding was made for its call alone
    for a, b in zip(short[:2], long[:2]):  # the last row's logits and hidden state
        np.testing.assert_array_equal(a[-1], b[-1])
    for name in short[2]:
        np.testing.assert_array_equal(short[2][name], long[2][name])
    # a generation prefills that way; all_logits (scoring a text) keeps the export's chunks
    result = generate(export, ids.tolist(), max_new_tokens=2, ignore_eos=True)
    assert result.stats["prefill_calls"] == 2
    target.reset()
    assert target.prefill(ids, limit, all_logits=True).logits.shape == (len(ids) - (len(ids) // chunk) * chunk,
                                                                        export.manifest.models["target"].vocab_size)


def test_rope_tables_are_built_within_the_rotary_modules_frequency_window():
    """transformers switches a longrope module to its long factors, and rescales a dynamic-NTK one, once a call
    reaches past the window (longrope without original_max_position_embeddings: max_position_embeddings): the
    batched graph's table, one scratch row longer than the context, took the other frequencies at every row."""
    import numpy as np
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from specdeploy.export.decoder_graph import frequency_window
    from specdeploy.export.fused_graph import GraphBuilder

    class Tables:
        def init(self, name, array):
            return np.array(array)

    short = [1.0 + 0.1 * i for i in range(8)]
    longrope = {"rope_type": "longrope", "factor": 2.0, "short_factor": short, "long_factor": [2 * f for f in short]}
    for scaling in (longrope,
                    {"rope_type": "dynamic", "factor": 2.0}):
        cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                          num_hidden_layers=1, vocab_size=100, max_position_embeddings=96, rope_scaling=scaling)
        assert frequency_window(LlamaRotaryEmbedding(cfg)) == 96
        with torch.no_grad():  # transformers' own rotation of the context's positions, in one call within it
            want = LlamaRotaryEmbedding(cfg)(torch.zeros(1, 1, 64), torch.arange(96)[None])[0][0, :, :8].numpy()
        module = LlamaRotaryEmbedding(cfg)
        cos, _ = GraphBuilder.rope_tables(Tables(), module, 64, 16, 97)  # the context and one scratch row
        assert np.array_equal(cos[:96], want), scaling["rope_type"]
        with torch.no_grad():  # and the module is left as within its window
            assert torch.equal(module(torch.zeros(1, 1, 64), torch.arange(96)[None])[0][0, :, :8],
                               torch.from_numpy(want))
