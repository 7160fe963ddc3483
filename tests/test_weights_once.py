"""Each model's weights once in memory, whatever the number of static T and the pool size;
only the graphs a method calls are opened (runtime/backends/sessions.py, export/fused_graph.py)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO
from trt_standin import FAKE_TRT, StandInEngine

MIB = 1 << 20
ALLOWANCE = 96 * MIB  # ORT sessions' own state, arenas of a T=64 call, the tokenizer: measured 40-60 MiB


@pytest.fixture(scope="module")
def smollm2_4l_export(smollm2_4l, tmp_path_factory):
    """The 4-layer SmolLM2, exported with the defaults."""
    from specdeploy.export.exporter import export_all

    return export_all(smollm2_4l, tmp_path_factory.mktemp("weights_once") / "smollm2-4l", progress=lambda msg: None)


@pytest.fixture(params=["micro", "smollm2-4l"])
def export(request, micro_export):
    return micro_export if request.param == "micro" else request.getfixturevalue("smollm2_4l_export")


def _fused_files(export: Path, model: str) -> list[Path]:
    manifest = json.loads((export / "manifest.json").read_text())
    return [export / g["file"] for g in manifest["graphs"].values()
            if g["model"] == model and g.get("flavor") == "fused" and g["kind"] == "decoder"]


def test_a_fused_graph_is_one_file_content_for_every_t(export):
    """The fused decoder's token count is a dynamic dimension and its file is byte-identical
    for every static T, so the runtime can open it once."""
    import onnx

    from specdeploy.runtime.graph_contract import TOKENS_DIM

    files = _fused_files(export, "target")
    assert len(files) >= 3
    assert len({hashlib.sha256(f.read_bytes()).hexdigest() for f in files}) == 1
    graph = onnx.load(str(files[0]), load_external_data=False).graph
    ids = next(i for i in graph.input if i.name == "input_ids")
    assert [d.dim_param or d.dim_value for d in ids.type.tensor_type.shape.dim] == [1, TOKENS_DIM]


def test_sessions_are_shared_across_t_and_pool_instances(export):
    from specdeploy.runtime.backends.sessions import sessions_opened
    from specdeploy.runtime.loaded_export import LoadedExport

    first = LoadedExport(export)
    before = sessions_opened()
    target = first.decoder("target")
    target.open()  # every static T
    assert len(target.opened) >= 3
    assert len({id(g.session) for g in target.graphs.values()}) == 1
    assert sessions_opened() - before <= 1  # 0 when an earlier test's session of this export is alive

    twins = [first.sibling() for _ in range(3)]
    for twin in twins:
        assert twin.tokenizer is first.tokenizer and twin.manifest is first.manifest
        decoder = twin.decoder("target")
        decoder.open()
        assert decoder is not target and decoder.cache is not target.cache  # KV per instance
        assert {id(g.session) for g in decoder.graphs.values()} == {id(target.graphs[1].session)}
        assert decoder.graphs[1].binding is not target.graphs[1].binding
    assert sessions_opened() - before <= 1


def test_static_t_files_open_lazily_and_are_shared_between_instances(micro_export, tmp_path):
    """An older export whose graph files differ per T: a session per file, opened on first
    call, shared by every instance."""
    import shutil

    import onnx

    from specdeploy.runtime.backends.sessions import sessions_opened
    from specdeploy.runtime.generate import Generation
    from specdeploy.runtime.loaded_export import LoadedExport

    old = tmp_path / "static"
    shutil.copytree(micro_export, old)
    for path in _fused_files(old, "target"):  # distinct bytes per T, as static-T graphs have
        model = onnx.load(str(path), load_external_data=False)
        model.graph.name = path.stem
        onnx.save(model, str(path))
    first = LoadedExport(old, verify_checksums=False)
    before = sessions_opened()
    target = first.decoder("target")
    assert target.opened == [1] and sessions_opened() - before == 1  # the decode graph opens with the decoder
    Generation(first, list(range(5, 25)), method="ar", max_new_tokens=4, ignore_eos=True).result()
    assert len({id(g.session) for g in target.graphs.values()}) == len(target.opened) == 2
    twin = first.sibling().decoder("target")
    twin.open()
    target.open()
    assert sessions_opened() - before == len(target.sizes)  # one per file, none per instance
    assert all(twin.graphs[t].session is target.graphs[t].session for t in target.sizes)


@pytest.mark.parametrize("flavor", ["fused", "portable"])
def test_ar_opens_only_the_graphs_it_calls(micro_export, flavor):
    """`generate --method ar`: T=1 and the prefill graph; no draft model, no verify graph."""
    from specdeploy.runtime.generate import Generation
    from specdeploy.runtime.loaded_export import LoadedExport

    export = LoadedExport(micro_export, flavor=flavor)
    sizes = export.manifest.decoder_graphs("target", flavor)
    prefill = min(t for t in sizes if t >= export.prefill_chunk)
    below = max(t for t in sizes if t < prefill)
    # All but the last prompt token are prefilled (the last is the first step's root): one chunk
    # too long for any graph below the prefill graph.
    ids = (export.tokenizer.encode("Once upon a time, in a land far away, ") * 40)[: below + 2]
    Generation(export, ids, method="ar", max_new_tokens=8, ignore_eos=True).result()
    assert set(export._decoders) == {"target"}
    # fused: the one dynamic-T graph runs the prompt unpadded, at T = its rows; portable: the prefill graph
    assert export.decoder("target").opened == [1, below + 1 if flavor == "fused" else prefill]


def test_service_warm_up_opens_each_methods_graphs(micro_export):
    from specdeploy.runtime.service import Service

    cold = Service.load(micro_export, pool_size=2, warmup=False)  # the rest opens on first use
    assert all(e.decoder("target").opened == [1] and "draft" not in e._decoders for e in cold.pool.exports)
    warm = Service.load(micro_export, pool_size=2)
    for instance in warm.pool.exports:  # every exported size (and, in one instance, each small call size run once)
        assert set(instance.decoder("target").sizes) <= set(instance.decoder("target").opened)
        assert set(instance.decoder("draft").sizes) <= set(instance.decoder("draft").opened)


def test_pool_instances_on_shared_sessions_give_the_same_tokens(micro_export):
    """Concurrent requests on shared sessions (separate bindings and KV) equal sequential ones,
    and equal the portable graphs' (one session per static T) greedy output."""
    from specdeploy.runtime.generate import Generation
    from specdeploy.runtime.loaded_export import LoadedExport
    from specdeploy.runtime.service import Service

    svc = Service.load(micro_export, pool_size=3, queue_size=16)
    jobs = [dict(prompt=p, method=m, max_new_tokens=24, ignore_eos=True)
            for p, m in [("import os", "ar"), ("class A:", "draft"), ("Once upon", "prompt-lookup"),
                         ("def f(", "lookahead"), ("x = 1", "ar"), ("The end", "draft")]]
    sequential = [svc.generate(**job).token_ids for job in jobs]
    with ThreadPoolExecutor(3) as pool:
        assert list(pool.map(lambda job: svc.generate(**job).token_ids, jobs * 2)) == sequential * 2
    portable = LoadedExport(micro_export, flavor="portable")
    for job, want in zip(jobs, sequential):
        ids = portable.tokenizer.encode(job["prompt"])
        got = Generation(portable, ids, method=job["method"], max_new_tokens=24, ignore_eos=True).result()
        assert got.token_ids == want


RSS_PROBE = r"""
import json, sys
import numpy, onnxruntime, tokenizers  # the runtime's own imports count as the baseline

def rss():
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {key: int(status[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM")}

from specdeploy.runtime.backends import use_shared_threads
from specdeploy.runtime.service import Service

use_shared_threads(1)
base = rss()["VmRSS"]
svc = Service.load(sys.argv[1], pool_size=int(sys.argv[2]))  # warm-up: every method's graphs
for method in svc.methods:  # and one call at every size the methods use (arenas sized)
    svc.generate(prompt_ids=list(range(5, 75)), method=method, max_new_tokens=4, ignore_eos=True)
print(json.dumps({"base": base, **rss()}))
"""


def _weights_and_kv(export: Path, pool: int) -> tuple[int, int]:
    """Bytes of the weights ORT CPU runs (what the fused graphs read, in whichever file: a payload
    is stored once per export), and of the pool's KV caches."""
    import onnx

    manifest = json.loads((export / "manifest.json").read_text())
    read = set()
    for g in manifest["graphs"].values():
        if g.get("flavor") == "fused":
            for t in onnx.load(str(export / g["file"]), load_external_data=False).graph.initializer:
                entry = {e.key: e.value for e in t.external_data}
                if entry:
                    read.add((entry["location"], int(entry["offset"]), int(entry["length"])))
    weights = sum(length for _, _, length in read)
    kv = sum(2 * m["num_layers"] * m["num_kv_heads"] * m["head_dim"] * manifest["max_context"] * 4
             for m in manifest["models"].values())
    return weights, kv * pool


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("pool,factor", [(1, 1.3), (4, 1.5)])
def test_resident_memory_is_about_one_copy_of_the_weights(export, pool, factor):
    """RSS after loading (and running) every graph of every method, in a fresh process:
    <= factor x the weights + the KV caches + a fixed allowance. Each static T or pool
    instance holding its own prepacked copy measured 3-4x (1 instance) and 12-16x (4)."""
    proc = subprocess.run([sys.executable, "-c", RSS_PROBE, str(export), str(pool)], capture_output=True,
                          text=True, cwd=REPO, timeout=600, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rss = json.loads(proc.stdout.strip().splitlines()[-1])
    weights, kv = _weights_and_kv(export, pool)
    grown = rss["VmRSS"] - rss["base"]
    assert grown <= factor * weights + kv + ALLOWANCE, (
        f"RSS grew {grown / MIB:.0f} MiB for {weights / MIB:.0f} MiB of weights and {kv / MIB:.0f} MiB of KV")


# -- TensorRT: one engine per model, one optimization profile per static T (no TensorRT here) -----

def test_tensorrt_layout_is_one_engine_per_model(micro_export):
    from specdeploy.engines.builder import engine_groups, group_staleness
    from specdeploy.runtime.backends.engine_records import engine_rel, file_digests
    from specdeploy.runtime.manifest import load_manifest

    m = load_manifest(micro_export)
    digest = file_digests(m.root)
    groups = {g.name: g for g in engine_groups(m, digest)}
    names = {model: f"{model}_t" + "-".join(map(str, sorted(m.decoder_graphs(model)))) for model in ("target", "draft")}
    assert set(groups) == set(names.values())
    target = groups[names["target"]]
    assert [g.tokens for g in target.graphs] == sorted(m.decoder_graphs("target"))
    assert group_staleness(m.root, target, {}, digest, {}) == ["no engine built for target_t1"]
    per_graph = {g.name: {"file": engine_rel(g.name)} for g in target.graphs}  # the earlier layout: rebuilt
    assert "laid out otherwise" in group_staleness(m.root, target, per_graph, digest, {})[0]


class _FakeTrt:
    """The slice of the tensorrt module build_engine uses, recording the profiles it is given."""

    NetworkDefinitionCreationFlag = type("Flags", (), {"STRONGLY_TYPED": 0})
    BuilderFlag = type("BuilderFlag", (), {"TF32": "tf32"})
    MemoryPoolType = type("MemoryPoolType", (), {"WORKSPACE": "workspace"})

    class OnnxParser:
        def __init__(self, network, logger):
            self.network = network

        def parse_from_file(self, path):
            import onnxruntime as ort

            session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
            self.network.inputs = [(i.name, tuple(d if isinstance(d, int) else -1 for d in i.shape))
                                   for i in session.get_inputs()]
            return True


class _FakeBuilder:
    def __init__(self):
        self.config = None

    def create_network(self, flags):
        network = type("Network", (), {})()
        network.get_input = lambda i: type("Tensor", (), {"name": network.inputs[i][0], "shape": network.inputs[i][1]})
        type(network).num_inputs = property(lambda self: len(self.inputs))
        return network

    def create_builder_config(self):
        config = self.config = type("Config", (), {})()
        config.profiles = []
        config.clear_flag = lambda flag: None
        config.add_optimization_profile = lambda p: config.profiles.append(p) or len(config.profiles) - 1
        config.create_timing_cache = lambda blob: object()
        config.set_timing_cache = lambda cache, ignore: True
        config.get_timing_cache = lambda: None
        return config

    def create_optimization_profile(self):
        profile = type("Profile", (), {})()
        profile.shapes = {}
        profile.set_shape = lambda name, *lo_opt_hi: profile.shapes.__setitem__(name, tuple(map(tuple, lo_opt_hi)))
        return profile

    def build_serialized_network(self, network, config):
        return b"plan"


def test_engine_has_one_profile_per_static_t(micro_export, tmp_path):
    """build_engine on the target's group: one network, profile i pins T = graphs[i].tokens and
    bounds the past to max_context - T (written to TensorRT 10's builder API, run on a fake)."""
    from specdeploy.engines.builder import TimingCache, build_engine, engine_groups
    from specdeploy.runtime.backends.engine_records import file_digests
    from specdeploy.runtime.manifest import load_manifest

    m = load_manifest(micro_export)
    group = next(g for g in engine_groups(m, file_digests(m.root)) if g.graphs[0].model == "target")
    builder, logger = _FakeBuilder(), type("Logger", (), {"errors": []})()
    blob, profiles = build_engine(_FakeTrt, builder, logger, m, group.graphs, None, TimingCache(tmp_path / "t.cache"))
    assert blob == b"plan" and len(profiles) == len(builder.config.profiles) == len(group.graphs)
    for g, recorded in zip(group.graphs, builder.config.profiles):
        t = g.tokens
        assert recorded.shapes["input_ids"] == ((1, t),) * 3
        assert recorded.shapes["tree_mask"] == ((1, t, t),) * 3
        lo, _, hi = recorded.shapes["past_key.0"]
        assert (lo[1], hi[1]) == (0, m.max_context - t)


def test_trt_decoder_runs_every_t_on_one_engine(micro_export):
    """TrtDecoder over one multi-profile engine (tests/trt_standin.py): a context per T on its own
    profile, and the same logits as the ORT decoder through prefill, a tree step and decode steps."""

    import onnxruntime as ort

    from specdeploy.runtime.backends.device_memory import HostMemory
    from specdeploy.runtime.backends.ort_decoder import OrtDecoder
    from specdeploy.runtime.backends.trt import TrtDecoder
    from specdeploy.runtime.backends.trt_profiles import graph_profile
    from specdeploy.runtime.manifest import load_manifest

    m = load_manifest(micro_export, verify_checksums=False)
    graphs = sorted(m.decoder_graphs("target").items())
    session = ort.InferenceSession(str(m.graph_path(graphs[0][1])), providers=["CPUExecutionProvider"])
    engine = StandInEngine(session, [graph_profile(m, g) for _, g in graphs])
    engines = {t: (engine, index) for index, (t, _) in enumerate(graphs)}  # one engine, profile i for the i-th T
    dev = TrtDecoder.from_engines(m, "target", FAKE_TRT, HostMemory(), engines)
    assert sorted(c.index for c in engine.contexts) == list(range(len(graphs)))
    ref = OrtDecoder(m, "target")
    prompt = np.random.default_rng(0).integers(3, 500, 37)
    np.testing.assert_array_equal(ref.prefill(prompt, 16).logits, dev.prefill(prompt, 16).logits)
    mask = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)
    a = ref.forward(np.array([5, 6, 7]), ref.cache.length + np.array([0, 1, 1]), mask)
    b = dev.forward(np.array([5, 6, 7]), dev.cache.length + np.array([0, 1, 1]), mask)
    np.testing.assert_array_equal(a.logits, b.logits)
    ref.commit(a, [0, 2])
    dev.commit(b, [0, 2])
    for _ in range(3):
        step = (np.array([11]), np.array([ref.cache.length]), np.ones((1, 1), bool))
        a, b = ref.forward(*step), dev.forward(*step)
        np.testing.assert_array_equal(a.logits, b.logits)
        ref.commit(a, slice(0, 1))
        dev.commit(b, slice(0, 1))
