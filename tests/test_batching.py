"""Continuous batching (runtime/batching): the batched target graph and the batched service
compute for every row exactly what the batch-1 runtime computes for it alone."""

from __future__ import annotations

import json
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from specdeploy.runtime.graph_contract import (
    INPUT_IDS,
    LOGITS,
    PAST_LENGTH,
    POSITION_IDS,
    TREE_MASK,
    past_names,
    present_of,
)
from specdeploy.runtime.tree import Tree


@pytest.fixture(scope="module")
def batched_export(micro_export):
    """A fresh export: the exporter writes the batched target graph (no extra step)."""
    return micro_export


def _batch1_session(export):
    import onnxruntime as ort

    from specdeploy.runtime.manifest import load_manifest

    manifest = load_manifest(export, verify_checksums=False)
    record = next(iter(manifest.decoder_graphs("target", "fused").values()))
    return ort.InferenceSession(str(manifest.graph_path(record))), manifest.models["target"]


def _run(session, ids, positions, mask, past, kv):
    names = [o.name for o in session.get_outputs()]
    feeds = {INPUT_IDS: ids, POSITION_IDS: positions, TREE_MASK: mask, PAST_LENGTH: past, **kv}
    if "logit_rows" in {i.name for i in session.get_inputs()}:  # a batch-1 graph that can score fewer rows
        feeds["logit_rows"] = np.array([ids.shape[1]], np.int64)
    return dict(zip(names, session.run(None, feeds)))


def test_every_row_of_a_batched_call_equals_the_row_alone(batched_export):
    """Decode rows (T=1, each its own past) and runs of several tokens (a speculative tree, a
    prefill chunk) in one call: every row's logits and KV equal the batch-1 graph's for it alone."""
    from specdeploy.runtime.batching.graph import BatchedGraph, Run
    from specdeploy.runtime.manifest import load_manifest

    single, spec = _batch1_session(batched_export)
    batched = BatchedGraph(load_manifest(batched_export))
    rng = np.random.default_rng(0)
    slots, rows = 4, 513  # max_context + the trash row
    shape = (slots, spec.num_kv_heads, rows, spec.head_dim)
    kv = {n: rng.standard_normal(shape).astype(np.float32) for n in past_names(spec.num_layers)}
    before = {n: v.copy() for n, v in kv.items()}
    tree, chain = Tree((-1, 0, 0, 1, 2)), Tree(tuple(range(-1, 6)))  # a draft tree; a prefill chunk of 7
    calls = {0: (rng.integers(0, spec.vocab_size, 1), np.array([5]), np.ones((1, 1), bool), 5),
             1: (rng.integers(0, spec.vocab_size, 1), np.array([40]), np.ones((1, 1), bool), 40),
             2: (rng.integers(0, spec.vocab_size, tree.size), 17 + tree.depth, tree.mask, 17),
             3: (rng.integers(0, spec.vocab_size, chain.size), np.arange(chain.size), chain.mask, 0)}
    decode = [(int(calls[s][0][0]), int(calls[s][1][0]), calls[s][3]) for s in (0, 1)]
    runs = [Run(*calls[s], kv={n: v[s : s + 1] for n, v in kv.items()}) for s in (2, 3)]
    logits, _ = batched.run(decode, {n: v[0:2] for n, v in kv.items()}, runs)
    at = 0
    for s, (ids, pos, mask, past) in calls.items():
        alone = _run(single, ids[None], pos[None], mask[None], np.array([past]),
                     {n: v[s : s + 1].copy() for n, v in before.items()})
        np.testing.assert_array_equal(logits[at : at + len(ids)], alone[LOGITS][0])
        at += len(ids)
        for n in kv:  # the row's new KV landed at its own past length, nothing else moved
            np.testing.assert_array_equal(kv[n][s, :, : past + len(ids)], alone[present_of(n)][0, :, : past + len(ids)])
            np.testing.assert_array_equal(kv[n][s, :, past + len(ids) :], before[n][s, :, past + len(ids) :])
    assert at == len(logits)
    # parts with no token of their own return none: no decode row and one run (the same row
    # again), then decode rows around a slot that takes no part (it writes its trash row only)
    for n in kv:
        kv[n][...] = before[n]
    again, _ = batched.run([], None, runs[:1])
    np.testing.assert_array_equal(again, logits[2 : 2 + tree.size])
    for n in kv:
        kv[n][...] = before[n]
    trash = rows - 1
    gapped, _ = batched.run([decode[0], trash, (decode[1][0], calls[2][3], calls[2][3])],
                            {n: v[0:3] for n, v in kv.items()}, [])
    np.testing.assert_array_equal(gapped[0], logits[0])
    alone = _run(single, calls[1][0][None], np.array([[calls[2][3]]]), np.ones((1, 1, 1), bool),
                 np.array([calls[2][3]]), {n: v[2:3].copy() for n, v in before.items()})
    np.testing.assert_array_equal(gapped[1], alone[LOGITS][0, 0])
    for n in kv:
        np.testing.assert_array_equal(kv[n][1, :, :trash], before[n][1, :, :trash])


def test_slots_that_take_no_part_in_a_call_leave_every_row_as_it_was(batched_export):
    """The scheduler's call with gaps in its decode range (`Batcher._gap_pasts`): a row running
    in the call (it writes just past its run), a row waiting on a later call (at its own past),
    a busy row (the trash row only) and a slot no request holds. The decode rows and the run
    equal the batch-1 graph's, and no row's KV below what it may overwrite itself moves."""
    from specdeploy.runtime.batching.graph import BatchedGraph
    from specdeploy.runtime.batching.kv_slots import SlotKV
    from specdeploy.runtime.batching.scheduler import Batcher, Work
    from specdeploy.runtime.manifest import load_manifest

    single, spec = _batch1_session(batched_export)
    manifest = load_manifest(batched_export)
    kv = SlotKV(spec, 6, manifest.max_context)
    rng = np.random.default_rng(1)
    for buf in (*kv.keys, *kv.values):
        buf[...] = rng.standard_normal(buf.shape).astype(np.float32)
    bufs = kv.views(0, kv.slots)
    before = {n: buf.copy() for n, buf in bufs.items()}
    batcher = Batcher(BatchedGraph(manifest), kv)
    try:
        def work(slot, past, t=1):
            return Work(slot, rng.integers(0, spec.vocab_size, t), past + np.arange(t), np.tril(np.ones((t, t), bool)),
                        past)

        decodes, run, waiting = [work(0, 9), work(5, 30)], work(1, 20, 4), work(3, 12, 3)
        for slot in (0, 1, 2, 3, 5):  # slot 4: no request; slot 2: busy between its calls
            batcher.join(slot)
        batcher._waiting[3] = waiting
        assert batcher._gap_pasts(0, 6, [run]) == [kv.trash, 24, kv.trash, 12, 0, kv.trash]
        batcher._call(decodes, [run])
        for w in (*decodes, run):
            alone = _run(single, w.ids[None], w.positions[None], w.mask[None], np.array([w.past]),
                         {n: v[w.slot : w.slot + 1].copy() for n, v in before.items()})
            np.testing.assert_array_equal(w.logits, alone[LOGITS][0])
        for n, buf in bufs.items():
            old = before[n]
            np.testing.assert_array_equal(buf[1, :, :20], old[1, :, :20])  # the run's past
            np.testing.assert_array_equal(buf[2, :, : kv.trash], old[2, :, : kv.trash])  # busy: all its rows
            np.testing.assert_array_equal(buf[3, :, :12], old[3, :, :12])  # waiting: below its past
    finally:
        batcher.close()


JOBS = [dict(prompt="Once upon a time", method="ar"),
        dict(prompt="the cat sat on the mat and the cat sat on", method="prompt-lookup"),
        dict(prompt="a b c d a b c d a b", method="suffix", temperature=0.8, seed=3),
        dict(prompt="Hello", method="draft", sampling="seeded", temperature=0.7, seed=5),
        dict(prompt="the cat sat on the mat", method="lookahead"),
        dict(prompt="Once upon a time there was", method="ar", temperature=1.0, seed=11, stop=["e"]),
        dict(prompt="the dog ran and the dog ran and the", method="draft+suffix", temperature=0.9, seed=7),
        dict(prompt="the cat sat on the mat and the cat", method="prompt-lookup", repetition_penalty=1.3),
        dict(prompt="a b c d a b c d", method="draft", frequency_penalty=0.8, presence_penalty=0.4)]


@pytest.fixture(scope="module")
def services(batched_export):
    from specdeploy.runtime.service import Service

    return Service.load(batched_export, pool_size=1), Service.load(batched_export, batch=3, queue_size=8)


def test_concurrent_mixed_requests_equal_their_batch1_output(services):
    alone, batched = services
    jobs = [dict(job, max_new_tokens=10, ignore_eos=True, logprobs=i % 3, prompt_logprobs=i % 4 == 1)
            for i, job in enumerate(JOBS)]
    want = [alone.generate(**job) for job in jobs]
    got: list = [None] * len(jobs)

    def run(i):
        got[i] = batched.generate(**jobs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]  # 9 requests on 3 rows
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for job, w, g in zip(jobs, want, got):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason), job
        assert g.logprobs == w.logprobs and len(g.logprobs) == len(g.token_ids), job  # a row's logits are its own
        assert g.prompt_logprobs == w.prompt_logprobs, job  # a row's prefill scores its prompt as alone
    assert batched.pool.in_use == 0
    assert batched.pool.exports[0].batcher.steps < sum(len(w.token_ids) for w in want)  # rows shared steps


def test_rows_stay_lossless_over_many_concurrent_rounds(batched_export, services):
    """Twice the mixed jobs on 3 rows, 20 rounds: which rows share a call, wait for a later one
    or are busy between calls changes every round (a gap slot's past depends on it: a stale
    waiting entry once let a gap write into a row that was committing, 25 of 60 such rounds
    with a changed token)."""
    from specdeploy.runtime.service import Service

    alone, _ = services
    batched = Service.load(batched_export, batch=3, queue_size=16)
    jobs = [dict(job, max_new_tokens=24, ignore_eos=True) for job in JOBS] * 2
    want = [alone.generate(**job).token_ids for job in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        for _ in range(20):
            assert list(pool.map(lambda job: batched.generate(**job).token_ids, jobs)) == want


def test_a_cancelled_row_leaves_and_its_slot_serves_the_next_request(services):
    alone, batched = services
    job = dict(prompt="Once upon a time", method="ar", max_new_tokens=12, ignore_eos=True)
    with batched.stream(**job) as req:
        events = iter(req)
        next(events)
        req.cancel()
        rest = list(events)
    assert req.finish_reason == "cancelled" and len(rest) < 11
    assert batched.pool.in_use == 0
    assert batched.generate(**job).token_ids == alone.generate(**job).token_ids


def test_the_server_batches_concurrent_requests_losslessly(batched_export, services):
    """`specdeploy serve --batch N`: concurrent streamed and plain completions through the real
    server, each the text its request gets from the batch-1 service."""
    import httpx
    from serve_util import ServerProcess

    alone, _ = services
    jobs = [dict(model="micro", prompt=j["prompt"], max_tokens=8, temperature=j.get("temperature", 0),
                 seed=j.get("seed"), method=j["method"], ignore_eos=True, stream=i % 2 == 1,
                 **({"sampling": j["sampling"]} if "sampling" in j else {}))
            for i, j in enumerate(JOBS)]
    want = [alone.generate(j["prompt"], method=j["method"], max_new_tokens=8, temperature=j["temperature"],
                           seed=j["seed"], ignore_eos=True, sampling=j.get("sampling")).text for j in jobs]

    def complete(job):
        with httpx.Client(timeout=60) as http:
            if not job["stream"]:
                return http.post(f"{srv.url}/v1/completions", json=job).json()["choices"][0]["text"]
            text = ""
            with http.stream("POST", f"{srv.url}/v1/completions", json=job) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        text += json.loads(line[6:])["choices"][0]["text"]
            return text

    with ServerProcess(batched_export, "--batch", "3", "--queue", "8") as srv:
        with ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(complete, jobs))
        assert srv.health()["pool_size"] == 3
        # a request's n choices are rows of the batch too: each is its candidate seed's batch-1 answer
        body = dict(model="micro", prompt="the cat sat on", max_tokens=8, temperature=0.9, seed=5, n=3, method="draft",
                    sampling="seeded", ignore_eos=True)
        choices = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).json()["choices"]
    assert got == want
    from specdeploy.serve.choices import candidate_seed
    assert [c["text"] for c in choices] == [
        alone.generate(body["prompt"], method="ar", max_new_tokens=8, temperature=0.9, seed=candidate_seed(5, i),
                       ignore_eos=True).text for i in range(3)]


def test_rows_stay_lossless_whatever_draft_size_the_policy_picks(batched_export, services, monkeypatch):
    """With the load-aware policy on, flat costs and at most two drafts weighed, every request
    still prints its batch-1 tokens (drafters see truncated proposals, and plain steps when the
    seats are taken)."""
    from specdeploy.runtime.batching.policy import CostModel
    from specdeploy.runtime.service import Service

    alone, _ = services
    monkeypatch.setenv("SPECDEPLOY_ADAPTIVE", "1")
    svc = Service.load(batched_export, batch=3, queue_size=8)
    row = svc.pool.exports[0]
    assert row.policy.enabled and row.policy.costs.calls  # calibrated at load
    row.batcher.observers.clear()
    flat = CostModel()  # fixed costs: a draft is free, so each row drafts what it may
    for tokens in (1, 1000):
        flat.observe(tokens, 1.0, replace=True)
    row.policy.costs, row.policy.sizes = flat, (1, 2)
    jobs = [dict(job, max_new_tokens=10, ignore_eos=True) for job in JOBS if job["method"] != "lookahead"]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: svc.generate(**job), jobs))
    for job, g in zip(jobs, got):
        assert g.token_ids == alone.generate(**job).token_ids, job
    assert max(g.stats["accepted_drafts"] / max(1, g.stats["target_calls"]) for g in got) <= 2
    assert any(g.stats["accepted_drafts"] for g in got)


def test_a_batched_service_holds_the_target_weights_once(batched_export):
    """Its own process: the batched graph is the only target session (no batch-1 target opened)."""
    import subprocess
    import sys

    code = ("import sys; from specdeploy.runtime.service import Service; "
            "from specdeploy.runtime.backends.sessions import live_sessions; "
            "s = Service.load(sys.argv[1], batch=2); s.generate('Hello', method='prompt-lookup', max_new_tokens=4); "
            "print(' '.join(sorted(p.name for p in live_sessions())))")
    proc = subprocess.run([sys.executable, "-c", code, str(batched_export)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    targets = [name for name in proc.stdout.split() if name.startswith("target")]
    assert targets == ["target_fused_batched.onnx"]


def test_a_fresh_export_records_its_batched_graph_for_the_batched_service_only(batched_export):
    """The exporter's fused_batched record: checksummed like every graph, never a batch-1 decoder
    graph nor a TensorRT source."""
    from specdeploy.runtime.loaded_export import LoadedExport

    export = LoadedExport(batched_export)
    manifest = export.manifest
    record = manifest.batched_graph()
    assert (record.file, record.model, record.flavor) == ("target_fused_batched.onnx", "target", "fused_batched")
    assert {record.file, "weights/target.fused_batched.bin"} <= set(manifest.files)
    assert (batched_export / "check" / "target_fused_batched.inputs.json").is_file()  # the accuracy check's
    assert record.name not in manifest.trt_graphs()
    chosen = {g.file for g in export.decoder("target").records.values()}  # what the batch-1 decoder opens
    assert "target_fused_t1.onnx" in chosen and record.file not in chosen


def test_the_batch1_service_never_opens_the_batched_graph(batched_export):
    import subprocess
    import sys

    code = ("import sys; from specdeploy.runtime.service import Service; "
            "from specdeploy.runtime.backends.sessions import live_sessions; "
            "s = Service.load(sys.argv[1], pool_size=2); s.generate('Hello', method='draft', max_new_tokens=4); "
            "print(' '.join(sorted(p.name for p in live_sessions())))")
    proc = subprocess.run([sys.executable, "-c", code, str(batched_export)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    opened = proc.stdout.split()
    assert "target_fused_t1.onnx" in opened and not [n for n in opened if "batched" in n]


def test_an_older_export_gets_its_batched_graph_from_the_manual_step(micro_family, micro_export, services,
                                                                      tmp_path):
    """Without the record `--batch` names the fix; `python -m specdeploy.export.batched_graph` adds
    the graph and its record (checksums), after which the export serves batched as a fresh one.
    The old export is a hard-linked copy holding unrecorded batched files (as the step wrote them
    before): they are replaced, not rewritten in place under the export they are linked to."""
    from specdeploy.export.batched_graph import main as add_batched
    from specdeploy.runtime.errors import SpecDeployError
    from specdeploy.runtime.manifest import load_manifest
    from specdeploy.runtime.service import Service

    old = tmp_path / "old"
    shutil.copytree(micro_export, old, copy_function=os.link)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["graphs"]["target_fused_batched"]
    manifest["files"] = {rel: d for rel, d in manifest["files"].items() if "batched" not in rel}
    (old / "manifest.json").unlink()  # a file of its own
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SpecDeployError, match="no batched target graph.*specdeploy.export.batched_graph"):
        Service.load(old, batch=2)
    assert add_batched([str(old), str(micro_family / "target")]) == 0
    record = load_manifest(old).batched_graph()  # checksums verified, the new files included
    assert record is not None and "weights/target.fused_batched.bin" in load_manifest(old).files
    for rel in ("target_fused_batched.onnx", "weights/target.fused_batched.bin"):  # new files, the links left
        assert not os.path.samefile(old / rel, micro_export / rel)
    import onnx  # its weights are the fused target's, read where the export stores them: its own file

    own = {t.name for t in onnx.load(str(old / "target_fused_batched.onnx"), load_external_data=False).graph.initializer
           if any(e.key == "location" and e.value.endswith("target.fused_batched.bin") for e in t.external_data)}
    assert own == {"rope.cos", "rope.sin"}, own  # holds only its longer RoPE tables
    alone, _ = services
    job = dict(prompt="Once upon a time", method="ar", max_new_tokens=6, ignore_eos=True)
    assert Service.load(old, batch=2).generate(**job).token_ids == alone.generate(**job).token_ids


def test_a_batched_graph_of_the_older_form_is_named_and_replaced(micro_family, micro_export, services, tmp_path):
    """A recorded batched graph without runs of several tokens (the form before speculative steps
    joined the decode call; here the batch-1 graph stands in for it): `--batch` names the step,
    which replaces it, after which the export serves batched as a fresh one."""
    from specdeploy.export.batched_graph import main as add_batched
    from specdeploy.runtime.errors import SpecDeployError
    from specdeploy.runtime.manifest import sha256_file
    from specdeploy.runtime.service import Service

    old = tmp_path / "older-form"
    shutil.copytree(micro_export, old, copy_function=os.link)
    (old / "target_fused_batched.onnx").unlink()
    shutil.copyfile(micro_export / "target_fused_t1.onnx", old / "target_fused_batched.onnx")
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["files"]["target_fused_batched.onnx"] = sha256_file(old / "target_fused_batched.onnx")
    (old / "manifest.json").unlink()
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SpecDeployError, match="older specdeploy.*specdeploy.export.batched_graph"):
        Service.load(old, batch=2)
    assert add_batched([str(old), str(micro_family / "target")]) == 0
    alone, _ = services
    job = dict(prompt="the cat sat on the mat and the cat sat on", method="prompt-lookup", max_new_tokens=6,
               ignore_eos=True)
    assert Service.load(old, batch=2).generate(**job).token_ids == alone.generate(**job).token_ids


def test_the_speculation_gate_measures_both_ways_and_rows_stay_lossless(batched_export, services, monkeypatch):
    """The gate (runtime/batching/gate.py) keeps every row plain in some epochs and lets the policy
    speculate in others: tokens stay each request's batch-1 tokens, and the gate has compared the
    two ways (short epochs, so these few calls make several)."""
    from specdeploy.runtime.batching import gate
    from specdeploy.runtime.service import Service

    alone, _ = services
    monkeypatch.setenv("SPECDEPLOY_ADAPTIVE", "1")
    monkeypatch.setattr(gate, "EPOCH_CALLS", 2)
    svc = Service.load(batched_export, batch=3, queue_size=8)
    row = svc.pool.exports[0]
    jobs = [dict(job, max_new_tokens=24, ignore_eos=True) for job in JOBS]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: svc.generate(**job).token_ids, jobs))
    assert got == [alone.generate(**job).token_ids for job in jobs]
    state = row.gate.state()
    assert state and max(entry["pairs"] for entry in state.values()) >= 1, state


def test_a_batched_server_reports_what_its_speculation_gate_measured(batched_export, services):
    """With the load-adaptive policy on, /metrics shows the gate's speculating / plain rate per batch
    size once rows have run side by side; the completions are still each request's batch-1 text."""
    import httpx
    from serve_util import ServerProcess

    alone, _ = services
    jobs = [dict(model="micro", prompt=j["prompt"], max_tokens=24, temperature=0, method=j["method"],
                 ignore_eos=True) for j in JOBS]
    want = [alone.generate(j["prompt"], method=j["method"], max_new_tokens=24, ignore_eos=True).text for j in jobs]
    with ServerProcess(batched_export, "--batch", "3", "--queue", "8", env={"SPECDEPLOY_ADAPTIVE": "1"}) as srv:
        with httpx.Client(timeout=60) as http, ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(lambda job: http.post(f"{srv.url}/v1/completions", json=job).json()
                                ["choices"][0]["text"], jobs))
            metrics = http.get(f"{srv.url}/metrics").text
    assert got == want
    ratios = [line for line in metrics.splitlines() if line.startswith("specdeploy_speculation_gate_ratio{")]
    assert ratios and all(float(line.rsplit(" ", 1)[1]) > 0 for line in ratios), metrics[-2000:]
