"""`specdeploy check` on a deep model: correct exports pass, planted defects fail naming the output.

The model has SmolLM2-135M's shape (hidden 576, 9 heads / 3 KV heads of 64, MLP 1536, RoPE base
1e5, tied embeddings) with DEEP_LAYERS random layers and the micro tokenizer's vocabulary; a
fixed tolerance tuned on a 2-layer toy says nothing about whether a bound holds at depth.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import run_cli

from specdeploy.runtime.batching.graph import RUNS

DEEP_LAYERS = 8
ROPE_THETA = 100000.0
WRONG_ROPE_THETA = 10000.0
CONFIG = "max_context: 128\nprefill_chunk: 15\n"  # graphs T=1 and T=15 (the verify size of the defaults)
TREE_GRAPH = "target_t15"  # a verify graph: its reference has a branching tree


def _smollm2_shaped(out: Path, tokenizer_dir: Path, rope_theta: float, layers: int = DEEP_LAYERS) -> Path:
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size(),
        hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=2048, rope_theta=rope_theta,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)  # the same weights whatever the RoPE base
    LlamaForCausalLM(config).eval().save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out


def _export(model_dir: Path, out: Path) -> Path:
    from specdeploy.export.exporter import export_all

    config = out.parent / f"{out.name}.yaml"
    config.write_text(CONFIG)
    return export_all(model_dir, out, config=config, progress=lambda m: None)


@pytest.fixture(scope="module")
def deep_models(micro_family, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deep_models")
    tok = micro_family / "tokenizer"
    return {"right": _smollm2_shaped(root / "right", tok, ROPE_THETA),
            "wrong_rope": _smollm2_shaped(root / "wrong_rope", tok, WRONG_ROPE_THETA)}


@pytest.fixture(scope="module")
def deep_export(deep_models, tmp_path_factory) -> Path:
    return _export(deep_models["right"], tmp_path_factory.mktemp("deep_export") / "export")


def _results(path: Path) -> dict:
    from specdeploy.export.check import check_path

    return {r.graph: r for r in check_path(path)}


def _graph_copy(export: Path, graph: str, dest: Path) -> Path:
    """One graph with its saved reference, its weights hard-linked (the defects edit only the .onnx)."""
    (dest / "check").mkdir(parents=True)
    (dest / "weights").mkdir()
    for f in (export / "weights").iterdir():
        os.link(f, dest / "weights" / f.name)
    for f in (export / "check").glob(f"{graph}.*"):
        shutil.copy(f, dest / "check" / f.name)
    shutil.copy(export / f"{graph}.onnx", dest / f"{graph}.onnx")
    return dest / f"{graph}.onnx"


def _ignore_tree_mask(path: Path) -> None:
    """Every consumer of `tree_mask` gets an all-true mask instead (tree_mask OR NOT tree_mask)."""
    m = onnx.load(str(path), load_external_data=False)
    for node in m.graph.node:
        node.input[:] = ["mask_all_true" if i == "tree_mask" else i for i in node.input]
    m.graph.node.insert(0, onnx.helper.make_node("Not", ["tree_mask"], ["mask_negated"]))
    m.graph.node.insert(1, onnx.helper.make_node("Or", ["tree_mask", "mask_negated"], ["mask_all_true"]))
    onnx.save(m, str(path))


def _assert_fails_with_bound(result, output_pattern: str) -> None:
    """The graph fails, and an output matching the pattern is reported with err > bound."""
    assert not result.passed, result.detail
    failed = [o for o in result.outputs if not o.passed]
    assert any(re.fullmatch(output_pattern, o.name) and o.max_err > o.bound > 0 for o in failed), \
        [(o.name, o.max_err, o.bound) for o in failed]
    line = next(line for line in result.table() if re.search(rf"\b{output_pattern}\s+FAIL", line))
    assert re.search(r"max\|err\| \S+ > bound \S+", line), line


def test_correct_deep_export_passes_with_room(deep_export):
    """Every graph, both flavors, within its bound; ORT's error is measured, not zero."""
    results = _results(deep_export)
    assert {"target_t1", "target_t15", "target_fused_t1", "target_fused_t15"} <= set(results)
    bad = [f"{r.graph}: {r.detail}" for r in results.values() if not r.passed]
    assert not bad, bad
    for r in results.values():
        logits = next(o for o in r.outputs if o.name == "logits")
        assert 0 < logits.max_err <= logits.bound and logits.torch_err > 0, (r.graph, logits)
        # logits, hidden, each layer's key and value (the batched graph: its decode part's and each run's)
        kv_sets = 1 + RUNS if r.graph.endswith("_batched") else 1
        assert len(r.outputs) == 2 + 2 * DEEP_LAYERS * kv_sets, r.graph
        assert any(note.startswith("top1 ") for note in logits.notes)


def test_reference_files_are_polygraphy_formats(deep_export):
    """Inputs load as a polygraphy data loader; outputs as RunResults holding the float64 reference
    and the float32 run; the noise errors sit beside them."""
    from polygraphy.comparator import RunResults
    from polygraphy.json import load_json

    check = deep_export / "check"
    (feeds,) = load_json(str(check / f"{TREE_GRAPH}.inputs.json"))
    assert feeds["past_key.0"].dtype == np.float32 and not feeds["tree_mask"].all()
    runs = {name: iters[0] for name, iters in RunResults.load(str(check / f"{TREE_GRAPH}.outputs.json"))}
    assert set(runs) == {"pytorch-float64", "pytorch-float32"}
    assert runs["pytorch-float64"]["logits"].dtype == np.float64
    assert runs["pytorch-float32"]["logits"].dtype == np.float32
    scale = json.loads((check / f"{TREE_GRAPH}.error_scale.json").read_text())
    assert scale["dtype"] == "float32" and len(scale["rounding_noise_max_abs_error"]["logits"]) >= 1


def test_wrong_rope_base_fails(deep_models, deep_export, tmp_path):
    """The same weights exported with RoPE base 1e4 instead of 1e5, checked against the right reference."""
    wrong = _export(deep_models["wrong_rope"], tmp_path / "wrong_rope")
    shutil.rmtree(wrong / "check")
    shutil.copytree(deep_export / "check", wrong / "check")
    results = _results(wrong)
    for graph in ("target_t15", "target_fused_t15", "target_t1", "target_fused_t1"):
        _assert_fails_with_bound(results[graph], "logits")


@pytest.mark.parametrize("graph", [TREE_GRAPH, "target_fused_t15"])
def test_ignored_tree_mask_fails(deep_export, tmp_path, graph):
    """The graph's tree_mask replaced by all-true (every new token sees every other): logits fail."""
    from specdeploy.export.check import check_graph

    path = _graph_copy(deep_export, graph, tmp_path)
    _ignore_tree_mask(path)
    _assert_fails_with_bound(check_graph(path), "logits")


@pytest.mark.parametrize("graph", ["target_t1", "target_fused_t1"])
def test_swapped_layer_weights_fail(deep_export, tmp_path, graph):
    """Layers 2 and 5 trade their MLP down projections (initializers swapped in the ONNX file):
    the KV of layer 3 onwards and the logits fail, the first layers' KV still pass."""
    path = _graph_copy(deep_export, graph, tmp_path)
    m = onnx.load(str(path), load_external_data=False)
    down = [t for t in m.graph.initializer if list(t.dims) == [1536, 576]]
    assert len(down) == DEEP_LAYERS, [t.name for t in down]
    a, b = down[2], down[5]
    a_data, b_data = list(a.external_data), list(b.external_data)
    for tensor, data in ((a, b_data), (b, a_data)):
        del tensor.external_data[:]
        tensor.external_data.extend(data)
    onnx.save(m, str(path))
    from specdeploy.export.check import check_graph

    result = check_graph(path)
    _assert_fails_with_bound(result, "logits")
    _assert_fails_with_bound(result, r"present_key\.3")
    by_name = {o.name: o for o in result.outputs}
    assert all(by_name[f"present_{kind}.{i}"].passed for kind in ("key", "value") for i in (0, 1, 2))


def test_report_prints_error_beside_bound_and_cli_fails(deep_export, tmp_path):
    """The table: a verdict line per graph, then each output's error beside its bound (KV outputs as
    their worst); `specdeploy check` on a broken .onnx prints the failing output and exits non-zero."""
    import io

    from specdeploy.export.check import check_graph, print_report

    table = io.StringIO()
    print_report([check_graph(deep_export / f"{TREE_GRAPH}.onnx")], out=table)
    text = table.getvalue()
    assert re.search(rf"^ok\s+{TREE_GRAPH}$", text, re.MULTILINE), text
    assert re.search(r"^\s+logits\s+max\|err\| \S+ <= bound \S+ \(4x torch float32 \S+ \+ \S+\), top1 15/15",
                     text, re.MULTILINE), text
    kv_line = rf"^\s+present_\*\s+{2 * DEEP_LAYERS} outputs, worst present_\w+\.\d+: max\|err\|"
    assert re.search(kv_line, text, re.MULTILINE), text

    path = _graph_copy(deep_export, TREE_GRAPH, tmp_path)
    _ignore_tree_mask(path)
    bad = run_cli("check", path)
    assert bad.returncode != 0
    assert re.search(rf"^FAIL {TREE_GRAPH}$", bad.stdout, re.MULTILINE), bad.stdout
    assert re.search(r"^\s+logits\s+FAIL max\|err\| \S+ > bound", bad.stdout, re.MULTILINE), bad.stdout
    assert "failed the accuracy check" in bad.stderr


def test_float64_reference_has_no_float32_step(micro_family):
    """The wrappers cast on purpose (`scores.float()`, RMSNorm's float32): the float64 run must
    compute every floating op in float64 anyway, or the reference shares float32's rounding."""
    import torch
    from torch.overrides import TorchFunctionMode

    from specdeploy.export.decoder_graph import DecoderGraph
    from specdeploy.export.hf_loading import load_causal_lm
    from specdeploy.export.reference import decoder_feeds, run_float64

    class FloatDtypes(TorchFunctionMode):
        """The dtypes of every floating result while the wrapper's forward runs."""

        def __init__(self):
            super().__init__()
            self.seen: set = set()
            self.active = False

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if self.active and isinstance(out, torch.Tensor) and out.is_floating_point():
                self.seen.add(out.dtype)
            return out

    model = load_causal_lm(micro_family / "target", "float32")
    cfg = model.config
    layers = range(cfg.num_hidden_layers)
    inputs = ["input_ids", "position_ids", "tree_mask", *(f"past_{kv}.{i}" for i in layers for kv in ("key", "value"))]
    outputs = ["logits", "hidden", *(f"present_{kv}.{i}" for i in layers for kv in ("key", "value"))]
    geometry = {"num_layers": cfg.num_hidden_layers, "num_kv_heads": cfg.num_key_value_heads,
                "head_dim": cfg.head_dim}
    feeds = decoder_feeds(5, 7, geometry, cfg.vocab_size, torch.float32, seed=0)
    wrapper = DecoderGraph(model).eval()
    recorder = FloatDtypes()
    wrapper.register_forward_pre_hook(lambda *_: setattr(recorder, "active", True))
    wrapper.register_forward_hook(lambda *_: setattr(recorder, "active", False))
    with recorder:
        outs = run_float64(wrapper, feeds, inputs, outputs)
    assert torch.float64 in recorder.seen and recorder.seen == {torch.float64}, recorder.seen
    assert outs["logits"].dtype == np.float64
    assert next(model.parameters()).dtype == torch.float32  # weights restored for the export


def test_real_smollm2_layers_pass(smollm2_4l, tmp_path):
    """Real weights (SmolLM2-135M-Instruct's first 4 layers, vocabulary 49152): both flavors pass."""
    results = _results(_export(smollm2_4l, tmp_path / "smollm2"))
    bad = [f"{r.graph}: {r.detail}" for r in results.values() if not r.passed]
    assert results and not bad, bad


def test_reference_from_before_float64_is_refused(deep_export, tmp_path):
    """An export whose outputs file holds one `pytorch` run (fixed tolerances) asks for a re-export."""
    from polygraphy.comparator import IterationResult, RunResults

    from specdeploy.export.check import check_graph

    path = _graph_copy(deep_export, "target_t1", tmp_path)
    outputs = tmp_path / "check" / "target_t1.outputs.json"
    runs = {name: iters[0] for name, iters in RunResults.load(str(outputs))}
    old = RunResults()
    old.append(("pytorch", [IterationResult(outputs=dict(runs["pytorch-float32"]), runner_name="pytorch")]))
    old.save(str(outputs))
    result = check_graph(path)
    assert not result.passed and "re-export" in result.detail, result.detail


def _compare(reference: dict, torch_run: dict, ours: dict) -> dict:
    """polygraphy's view of one comparison: ErrorBound on (onnxrt, pytorch-float64) iteration results."""
    from polygraphy.comparator import IterationResult

    from specdeploy.export.check import ErrorBound
    from specdeploy.export.reference import TorchReference

    bound = ErrorBound(TorchReference(reference, torch_run, "float32", {}))
    return bound(IterationResult(ours, runner_name="onnxrt"), IterationResult(reference, runner_name="pytorch-float64"))


def test_top1_flip_fails_within_the_error_bound():
    """A row whose top-2 margin is beyond PyTorch's reach of a tie must keep its argmax, even when the
    flip stays within the max-error bound; a row within that reach may flip."""
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((1, 3, 50)) * 5
    ref[0, :, 7] = ref.max() + 1  # every row's top-1 is token 7, token 9 its runner-up
    ref[0, :, 9] = ref[0, :, 7] - np.array([5e-4, 5e-4, 1e-4])  # margins; PyTorch's error is 1e-4
    torch_run = ref + 1e-4 * np.sign(rng.standard_normal(ref.shape))
    ours = ref.copy()
    ours[0, 1, 7] -= 3e-4  # row 1 flips: |err| 3e-4 < bound 4e-4, margin 5e-4 > 2 x 1e-4
    ours[0, 1, 9] += 3e-4
    ours[0, 2, 7] -= 1e-4  # row 2 flips at a margin of 1e-4: excused
    ours[0, 2, 9] += 1e-4
    as_f32 = {"logits": torch_run.astype(np.float32)}
    check = _compare({"logits": ref}, as_f32, {"logits": ours.astype(np.float32)})["logits"]
    assert check.max_err <= check.bound, check
    assert not check.passed and "top1 2/3 (1 near-tie rows exempt)" in check.notes, check.notes
    ours[0, 1] = ref[0, 1]
    assert _compare({"logits": ref}, {"logits": torch_run}, {"logits": ours})["logits"].passed


def test_topk_ids_differ_only_at_near_tied_slots():
    values = np.array([[[-0.1, -0.1 - 1e-7, -2.0, -3.0, -4.0]]])
    ids = np.array([[[11, 12, 13, 14, 15]]])
    reference = {"topk_logprobs": values, "topk_ids": ids}
    torch_run = {"topk_logprobs": (values + 1e-7).astype(np.float32), "topk_ids": ids}
    tied_swap = {"topk_logprobs": values.astype(np.float32), "topk_ids": ids[..., [1, 0, 2, 3, 4]]}
    checks = _compare(reference, torch_run, tied_swap)
    assert checks["topk_ids"].passed and "excused" in checks["topk_ids"].notes[0], checks["topk_ids"]
    clear_swap = {"topk_logprobs": values.astype(np.float32), "topk_ids": ids[..., [0, 1, 3, 2, 4]]}
    checks = _compare(reference, torch_run, clear_swap)
    assert not checks["topk_ids"].passed and checks["topk_ids"].notes[0].startswith("2 of 5 differ"), checks["topk_ids"]
    assert list(checks) == ["topk_logprobs", "topk_ids"]
