"""Two forms of the batched target graph's call (runtime/batching/graph.py):

* it scores only the tokens a call asks logits for (logit_tokens): a prefill chunk's last row,
  or none; every decode row and speculative run all of theirs. The rows it scores and every
  row's KV equal the full call's;
* a row alone (lone_row) runs the batch-1 graph's nodes only, over the same weights: its
  logits and KV equal the batch-1 graph's, every other buffer is left as it was.

A graph exported before these inputs still serves, scoring every token and part."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import onnx
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


def _call(graph, kv, rows: dict[int, np.ndarray | None]):
    """One call of decode rows 0 and 1 and runs on slots 2 (a draft tree) and 3 (a prefill chunk of
    7), the runs scoring `rows[slot]` (None: every row); (logits, hidden, KV after)."""
    from specdeploy.runtime.batching.graph import Run

    buffers = {n: v.copy() for n, v in kv.items()}
    tree, chain = Tree((-1, 0, 0, 1, 2)), Tree(tuple(range(-1, 6)))
    decode = [(3, 5, 5), (7, 40, 40)]
    runs = [Run(np.array([1, 2, 3, 4, 5]), 17 + tree.depth, tree.mask, 17,
                {n: v[2:3] for n, v in buffers.items()}, rows[2]),
            Run(np.arange(10, 10 + chain.size), np.arange(chain.size), chain.mask, 0,
                {n: v[3:4] for n, v in buffers.items()}, rows[3])]
    logits, hidden = graph.run(decode, {n: v[0:2] for n, v in buffers.items()}, runs)
    return logits.copy(), hidden.copy(), buffers


@pytest.fixture(scope="module")
def kv_and_graph(micro_export):
    from specdeploy.runtime.batching.graph import BatchedGraph
    from specdeploy.runtime.manifest import load_manifest

    manifest = load_manifest(micro_export)
    spec = manifest.models["target"]
    rng = np.random.default_rng(0)
    shape = (4, spec.num_kv_heads, manifest.max_context + 1, spec.head_dim)
    kv = {n: rng.standard_normal(shape).astype(np.float32) for n in past_names(spec.num_layers)}
    return kv, BatchedGraph(manifest)


def test_a_call_scores_only_the_rows_asked_for(kv_and_graph):
    kv, graph = kv_and_graph
    assert graph.picks_logits
    full, hidden, full_kv = _call(graph, kv, {2: None, 3: None})
    assert len(full) == 2 + 5 + 7
    # the tree's rows 0 and 3, the chunk's last row
    picked, picked_hidden, picked_kv = _call(graph, kv, {2: np.array([0, 3]), 3: np.array([6])})
    assert picked.shape == (2 + 2 + 1, full.shape[1])
    np.testing.assert_allclose(picked, full[[0, 1, 2, 5, 13]], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(picked_hidden, hidden)
    for n in kv:
        np.testing.assert_array_equal(picked_kv[n], full_kv[n])
    # a chunk that is not its prompt's last: no row at all
    none, _, none_kv = _call(graph, kv, {2: None, 3: np.array([], np.int64)})
    np.testing.assert_allclose(none, full[:7], rtol=1e-5, atol=1e-5)
    for n in kv:
        np.testing.assert_array_equal(none_kv[n], full_kv[n])


def _as_before(path) -> None:
    """Rewrite the batched graph at `path` to its form before logit_tokens and lone_row (the LM
    head over every token, every part's attention in every call), as a new file: the If's
    branch of many rows inlined, its Gather before the LM head and the two inputs removed."""
    from specdeploy.runtime.batching.graph import LOGIT_TOKENS, LONE_ROW

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    (branch_node,) = [node for node in graph.node if node.op_type == "If"]
    rows = next(a.g for a in branch_node.attribute if a.name == "else_branch")
    names = {out.name: final for out, final in zip(rows.output, branch_node.output)}
    nodes = list(rows.node)
    (gather,) = [node for node in nodes if LOGIT_TOKENS in node.input]
    names[gather.output[0]] = names.get(gather.input[0], gather.input[0])
    nodes.remove(gather)
    for node in nodes:
        node.input[:] = [names.get(name, name) for name in node.input]
        node.output[:] = [names.get(name, name) for name in node.output]
    del graph.node[:]
    graph.node.extend(nodes)
    for name in (LOGIT_TOKENS, LONE_ROW):
        graph.input.remove(next(i for i in graph.input if i.name == name))
    (out,) = [o for o in graph.output if o.name == LOGITS]
    out.type.tensor_type.shape.dim[1].dim_param = "tokens"
    path.unlink()  # a file of its own: the export it is linked to keeps the current graph
    onnx.save(model, str(path))


def test_a_batched_graph_of_the_form_before_scores_every_row_and_serves(micro_export, kv_and_graph, tmp_path):
    from specdeploy.export.batched_graph import is_current
    from specdeploy.runtime.batching.graph import BatchedGraph
    from specdeploy.runtime.manifest import load_manifest, sha256_file
    from specdeploy.runtime.service import Service

    kv, graph = kv_and_graph
    old = tmp_path / "before-logit-tokens"
    shutil.copytree(micro_export, old, copy_function=os.link)
    _as_before(old / "target_fused_batched.onnx")
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["files"]["target_fused_batched.onnx"] = sha256_file(old / "target_fused_batched.onnx")
    (old / "manifest.json").unlink()
    (old / "manifest.json").write_text(json.dumps(manifest))
    assert not is_current(old / "target_fused_batched.onnx") and is_current(micro_export / "target_fused_batched.onnx")

    older = BatchedGraph(load_manifest(old))
    assert not older.picks_logits and not older.has_lone_row
    rows = {2: np.array([0, 3]), 3: np.array([6])}
    want, want_hidden, want_kv = _call(graph, kv, rows)
    got, got_hidden, got_kv = _call(older, kv, rows)  # every row scored, the asked ones returned
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got_hidden, want_hidden)
    for n in kv:
        np.testing.assert_array_equal(got_kv[n], want_kv[n])

    job = dict(prompt="the cat sat on the mat and the cat sat on", method="prompt-lookup", max_new_tokens=6,
               ignore_eos=True)
    alone = Service.load(micro_export, pool_size=1).generate(**job).token_ids
    assert Service.load(old, batch=2).generate(**job).token_ids == alone


def _batch1(export, ids, positions, mask, past, kv):
    """The batch-1 fused graph's outputs for one row's call over copies of `kv` ([1, ...] each)."""
    import onnxruntime as ort

    from specdeploy.runtime.manifest import load_manifest

    manifest = load_manifest(export, verify_checksums=False)
    record = next(iter(manifest.decoder_graphs("target", "fused").values()))
    session = ort.InferenceSession(str(manifest.graph_path(record)))
    feeds = {INPUT_IDS: ids[None], POSITION_IDS: positions[None], TREE_MASK: mask[None],
             PAST_LENGTH: np.array([past]), "logit_rows": np.array([len(ids)], np.int64),
             **{n: v.copy() for n, v in kv.items()}}
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def test_a_lone_row_runs_its_own_attention_only_and_equals_the_batch1_graph(micro_export, kv_and_graph):
    """A lone decode step (run as a one-token run 0) and a lone speculative step."""
    from specdeploy.runtime.batching.graph import Run

    kv, graph = kv_and_graph
    assert graph.has_lone_row
    tree = Tree((-1, 0, 0, 1, 2))
    steps = {0: (np.array([3]), np.array([9]), np.ones((1, 1), bool), 9),
             2: (np.array([1, 2, 3, 4, 5]), 17 + tree.depth, tree.mask, 17)}
    for slot, (ids, positions, mask, past) in steps.items():
        buffers = {n: v.copy() for n, v in kv.items()}
        row = {n: v[slot : slot + 1] for n, v in buffers.items()}
        if len(ids) == 1:
            logits, hidden = graph.run([(int(ids[0]), int(positions[0]), past)], row, [])
        else:
            logits, hidden = graph.run([], None, [Run(ids, positions, mask, past, row)])
        alone = _batch1(micro_export, ids, positions, mask, past, {n: v[slot : slot + 1] for n, v in kv.items()})
        np.testing.assert_array_equal(logits, alone[LOGITS][0])
        np.testing.assert_array_equal(hidden, alone["hidden"][0])
        end = past + len(ids)
        others = [s for s in range(4) if s != slot]
        for n in kv:
            np.testing.assert_array_equal(buffers[n][slot, :, :end], alone[present_of(n)][0, :, :end])
            np.testing.assert_array_equal(buffers[n][slot, :, end:], kv[n][slot, :, end:])
            np.testing.assert_array_equal(buffers[n][others], kv[n][others])
