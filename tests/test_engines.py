"""TensorRT side without TensorRT, on the micro export: lint, profiles, engine bookkeeping, skip lines,
backend errors, and the device-resident decoders' binding logic (driven on host memory through ONNX
Runtime). The lint on hand-built graphs, profiles from shapes and row runs: tests/unit/."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest
from conftest import run_cli
from trt_standin import FAKE_TRT, StandInEngine

from specdeploy.engines import lint
from specdeploy.engines.engine_manifest import engine_status, graph_sources, make_record, save_engines
from specdeploy.runtime.backends.device_memory import HostMemory
from specdeploy.runtime.backends.engine_records import engine_rel, file_digests, load_engines, stale_reasons
from specdeploy.runtime.backends.ort_decoder import OrtDecoder
from specdeploy.runtime.backends.trt import unavailable_reason
from specdeploy.runtime.backends.trt_profiles import graph_profile, profile_json
from specdeploy.runtime.errors import SpecDeployError
from specdeploy.runtime.manifest import load_manifest

NO_TRT = unavailable_reason() is not None


# -- lint ---------------------------------------------------------------------------------------

def test_lint_passes_exported_micro_graphs(micro_export, capsys):
    manifest = load_manifest(micro_export, verify_checksums=False)
    for g in manifest.trt_graphs().values():
        findings, nodes = lint.lint_file(micro_export / g.file)
        assert nodes > 100 and findings == [], (g.name, [str(f) for f in findings])
    # The fused graphs are ORT-only (com.microsoft ops): exactly why TensorRT never sees them.
    findings, _ = lint.lint_file(micro_export / "target_fused_t1.onnx")
    assert any("com.microsoft" in str(f) for f in findings)
    assert lint.cli_report(micro_export) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines and all(line.startswith("ok   trt-lint ") for line in lines)


# -- profiles ------------------------------------------------------------------------------------

def test_decoder_profile_from_manifest(micro_export):
    m = load_manifest(micro_export, verify_checksums=False)
    spec = m.models["target"]
    prof = graph_profile(m, "target_t9")
    assert prof["input_ids"].min == prof["input_ids"].max == (1, 9)
    assert prof["tree_mask"].opt == (1, 9, 9)
    past = prof["past_value.0"]
    hi = m.max_context - 9
    assert past.min == (1, 0, spec.num_kv_heads, spec.head_dim)  # empty cache on the first prefill chunk
    assert past.max == (1, hi, spec.num_kv_heads, spec.head_dim)
    assert past.min[1] < past.opt[1] < past.max[1]
    assert sum(n.startswith("past_") for n in prof) == 2 * spec.num_layers
    assert set(profile_json(prof)["past_key.0"]) == {"min", "opt", "max"}


def test_profile_cross_checks_network_inputs(micro_export):
    m = load_manifest(micro_export, verify_checksums=False)
    spec = m.models["draft"]
    good = {"input_ids": (1, 1), "position_ids": (1, 1), "tree_mask": (1, 1, 1)}
    for i in range(spec.num_layers):
        good[f"past_key.{i}"] = good[f"past_value.{i}"] = (1, -1, spec.num_kv_heads, spec.head_dim)
    assert graph_profile(m, "draft_t1", good)
    with pytest.raises(SpecDeployError, match="unexpected"):
        graph_profile(m, "draft_t1", {**good, "extra": (1,)})
    with pytest.raises(SpecDeployError, match="input_ids"):
        graph_profile(m, "draft_t1", {**good, "input_ids": (1, 3)})


# -- engine manifest and staleness ------------------------------------------------------------------

@pytest.fixture
def export_copy(micro_export, tmp_path):
    out = tmp_path / "export"
    shutil.copytree(micro_export, out)
    return out


def _fake_engines(root):
    """A fake engine file and record per graph, as `specdeploy engines` would write them."""
    m = load_manifest(root)
    digest = file_digests(root)
    data = load_engines(root)
    identity = {"tensorrt": "10.99.0", "gpu": "Test GPU", "compute_capability": "9.0"}
    for name, g in m.graphs.items():
        blob = f"not a real engine: {name}".encode()
        (root / engine_rel(name)).parent.mkdir(exist_ok=True)
        (root / engine_rel(name)).write_bytes(blob)
        data["engines"][name] = make_record(root, g, graph_sources(m, name), digest, len(blob), "0" * 64, m.dtype,
                                            profile_json(graph_profile(m, g)), identity, 1.0, None)
    save_engines(root, data)
    return m, identity


def test_engine_records_list_onnx_and_weights(export_copy):
    m, _ = _fake_engines(export_copy)
    rec = load_engines(export_copy)["engines"]["target_t9"]
    assert set(rec["sources"]) == {"target_t9.onnx", "weights/target.bin"}
    assert rec["sources"]["target_t9.onnx"] == m.files["target_t9.onnx"]
    assert rec["profile"]["past_key.0"]["min"][1] == 0
    assert all(why == [] for why in engine_status(m).values())


def test_changed_onnx_makes_its_engine_stale(export_copy):
    m, identity = _fake_engines(export_copy)
    model = onnx.load(str(export_copy / "target_t1.onnx"), load_external_data=False)
    model.doc_string = "re-exported"
    onnx.save(model, str(export_copy / "target_t1.onnx"))
    status = engine_status(m)
    assert status["target_t1"] == ["target_t1.onnx changed since the engine was built"]
    assert status["target_t9"] == [] and status["draft_t1"] == []
    # Weights shared by all target graphs: every target engine goes stale, the draft's do not.
    with open(export_copy / "weights" / "target.bin", "r+b") as f:
        f.write(b"\1\2\3\4")
    status = engine_status(m)
    assert all("weights/target.bin changed" in " ".join(status[g]) for g in ("target_t1", "target_t9", "target_t64"))
    assert status["draft_t64"] == []


def test_engine_from_other_tensorrt_or_gpu_or_missing_is_stale(export_copy):
    m, identity = _fake_engines(export_copy)
    rec = load_engines(export_copy)["engines"]["draft_t1"]
    digest = file_digests(export_copy)
    assert stale_reasons(export_copy, rec, digest, **identity) == []
    assert "TensorRT 10.99.0" in stale_reasons(export_copy, rec, digest, **{**identity, "tensorrt": "11.4.0"})[0]
    other_gpu = {**identity, "gpu": "B", "compute_capability": "10.0"}
    assert "compute 9.0" in stale_reasons(export_copy, rec, digest, **other_gpu)[0]
    (export_copy / rec["file"]).write_bytes(b"truncated")
    assert "changed" in stale_reasons(export_copy, rec, digest)[0]
    (export_copy / rec["file"]).unlink()
    assert "missing" in stale_reasons(export_copy, rec, digest)[0]
    (export_copy / "engines.json").write_text("{not json")
    with pytest.raises(SpecDeployError, match="engines.json"):
        load_engines(export_copy)


# -- CLI without TensorRT / GPU ---------------------------------------------------------------------

@pytest.mark.skipif(not NO_TRT, reason="TensorRT and a GPU are present: engines would really be built")
def test_engines_command_prints_one_skip_line(micro_export):
    proc = run_cli("engines", micro_export)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("engines: skipped") and unavailable_reason() in lines[0]
    assert not (micro_export / "engines.json").exists()


@pytest.mark.skipif(not NO_TRT, reason="TensorRT and a GPU are present")
def test_check_reports_trt_comparison_skipped(micro_export):
    from specdeploy.engines import trt_check

    assert trt_check.skip_reason() == unavailable_reason()
    proc = run_cli("check", micro_export)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("trt-check:")]
    assert len(skipped) == 1 and "skipped" in skipped[0]


@pytest.mark.parametrize("backend", ["trt", "ort-cuda"])
def test_unavailable_backend_is_one_clear_error(micro_export, backend):
    from specdeploy.runtime.backends import available_backends

    if backend in available_backends():
        pytest.skip(f"{backend} is available here")
    proc = run_cli("generate", micro_export, "--backend", backend, "--prompt-ids", "1,2,3")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert lines[0].startswith(f"error: backend '{backend}' is not available here: ")
    assert ("TensorRT" if backend == "trt" else "CUDAExecutionProvider") in lines[0]


# -- device-resident decoders, on host memory -------------------------------------------------------

TREE_MASK = np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]], bool)
TREE_DEPTH = np.array([0, 1, 1, 2, 2])


def _same_steps(ref: OrtDecoder, dev) -> None:
    """Prefill, a tree step committed along a non-prefix path, then single steps: identical results."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 500, 37)
    a, b = ref.prefill(prompt, 16), dev.prefill(prompt, 16)
    np.testing.assert_array_equal(a.logits, b.logits)
    ta = ref.forward(np.array([5, 6, 7, 8, 9]), ref.cache.length + TREE_DEPTH, TREE_MASK)
    tb = dev.forward(np.array([5, 6, 7, 8, 9]), dev.cache.length + TREE_DEPTH, TREE_MASK)
    np.testing.assert_array_equal(ta.logits, tb.logits)
    np.testing.assert_array_equal(ta.hidden, tb.hidden)
    ref.commit(ta, [0, 2, 4])
    dev.commit(tb, [0, 2, 4])
    assert dev.cache.length == ref.cache.length == 40
    for layer in range(ref.spec.num_layers):
        np.testing.assert_array_equal(dev.cache.read(layer, 0), ref.cache.keys[layer][:40])
        np.testing.assert_array_equal(dev.cache.read(layer, 1), ref.cache.values[layer][:40])
    ref.cache.truncate(38)
    dev.cache.truncate(38)
    for _ in range(3):
        pos = np.array([ref.cache.length])
        sa = ref.forward(np.array([11]), pos, np.ones((1, 1), bool))
        sb = dev.forward(np.array([11]), pos, np.ones((1, 1), bool))
        np.testing.assert_array_equal(sa.logits, sb.logits)
        ref.commit(sa, slice(0, 1))
        dev.commit(sb, slice(0, 1))
    assert dev.cache.bytes_copied == ref.cache.bytes_copied
    with pytest.raises(SpecDeployError, match="latest step"):
        dev.commit(tb, [0])  # its presents were overwritten by later steps


def test_ort_iobinding_decoder_matches_plain_decoder(micro_export):
    from specdeploy.runtime.backends.ort_bound import OrtBoundDecoder

    m = load_manifest(micro_export, verify_checksums=False)
    _same_steps(OrtDecoder(m, "target"), OrtBoundDecoder(m, "target", "ort-cpu"))


def test_generation_unchanged_on_iobinding_decoder(micro_export):
    from specdeploy.runtime.backends.ort_bound import OrtBoundDecoder
    from specdeploy.runtime.generate import Generation
    from specdeploy.runtime.loaded_export import LoadedExport

    class BoundExport(LoadedExport):  # the generator sees a device-resident decoder, nothing else changes
        def _open_decoder(self, model):
            return OrtBoundDecoder(self.manifest, model, "ort-cpu")

    prompt = [1, 17, 42, 99, 7, 17, 42]
    for method in ("ar", "draft"):
        plain = Generation(LoadedExport(micro_export, "ort-cpu", flavor="portable"), prompt, method=method,
                           max_new_tokens=24, ignore_eos=True).result()
        bound = Generation(BoundExport(micro_export, "ort-cpu"), prompt, method=method, max_new_tokens=24,
                           ignore_eos=True).result()
        assert bound.token_ids == plain.token_ids, method
        assert bound.stats["kv_bytes_copied"] == plain.stats["kv_bytes_copied"]


def test_trt_decoder_binding_logic_on_a_stand_in_engine(micro_export):
    import onnxruntime as ort

    from specdeploy.runtime.backends.trt import TrtDecoder

    m = load_manifest(micro_export, verify_checksums=False)
    engines = {t: StandInEngine(ort.InferenceSession(str(m.graph_path(g)), providers=["CPUExecutionProvider"]),
                                [graph_profile(m, g)])
               for t, g in m.decoder_graphs("target").items()}
    dev = TrtDecoder.from_engines(m, "target", FAKE_TRT, HostMemory(), engines)
    _same_steps(OrtDecoder(m, "target"), dev)
    with pytest.raises(SpecDeployError, match="engines for T"):
        TrtDecoder.from_engines(m, "target", FAKE_TRT, HostMemory(), {1: engines[1]})
