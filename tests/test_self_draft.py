"""`export --draft self`: the target drafts for itself through int4 weights (export/main.py,
runtime/drafters/draft_model.py). Its graphs are the target's, quantized; the accuracy check holds
it to the draft floor only; greedy output equals `ar` whatever the stop rule drafts; and the
stop rule drafts fewer tokens the higher it is set."""

from __future__ import annotations

import hashlib
import json
import os

import onnx
import pytest

PROMPTS = [
    "def foo(x):\n    return",
    "import os\nimport sys\n\n\nclass Config",
    "for i in range(10):\n    if i %",
    "    def __init__(self, name, value=None):\n        self.",
]


@pytest.fixture(scope="module")
def self_draft(micro_with_heads, tmp_path_factory):
    from specdeploy.cli import main

    family = micro_with_heads
    out = tmp_path_factory.mktemp("self-draft") / "export"
    config = out.parent / "config.yaml"  # as make export's: a draft vocabulary for a distilled draft
    config.write_text("methods:\n  draft: {draft_vocab: 64}\n")
    code = main(["export", "--target", str(family / "target"), "--draft", "self", "--out", str(out),
                 "--config", str(config), "--eagle", str(family / "eagle"), "--medusa", str(family / "medusa")])
    assert code == 0
    return out


def test_the_draft_is_the_target_with_int4_weights(self_draft, micro_family):
    manifest = json.loads((self_draft / "manifest.json").read_text())
    assert manifest["check"] == "passed"  # the task check held the draft to the draft floor, the target to float
    assert list(manifest["quantization"]["models"]) == ["draft"]
    assert manifest["quantization"]["models"]["draft"]["bits"] == 4
    target, draft = manifest["models"]["target"], manifest["models"]["draft"]
    for key in ("num_layers", "hidden_size", "vocab_size", "num_heads", "num_kv_heads"):
        assert draft[key] == target[key], key
    assert "draft_vocab_file" not in draft  # a self-draft keeps the whole LM head
    methods = manifest["methods"]
    assert methods["draft"]["stop_below"] == 0.6 and methods["draft"]["k"] >= 4
    assert methods["draft"]["draft_vocab"] == 0  # the whole LM head, and the manifest says so


def test_the_targets_weights_are_stored_once(self_draft):
    """The draft's portable graphs (TensorRT's source, the check's float reference) are the target's
    weights: they read the target's file, and the export holds no second copy; the draft's own file
    holds its int4 fused weights only."""
    from specdeploy.runtime.manifest import load_manifest
    from specdeploy.runtime.onnx_external import external_data_locations

    manifest = load_manifest(self_draft)  # every file checksummed, every location inside the export
    weights = sorted(rel for rel in manifest.files if rel.startswith("weights/"))
    assert "weights/draft.bin" not in weights and not (self_draft / "weights" / "draft.bin").exists(), weights
    for g in manifest.graphs.values():
        reads = {(manifest.graph_path(g).parent / loc).resolve().relative_to(self_draft.resolve()).as_posix()
                 for loc in external_data_locations(manifest.graph_path(g))}
        if g.model == "draft" and g.flavor == "portable":
            assert reads == {"weights/target.bin"}, (g.name, reads)
        if g.model == "draft" and g.flavor == "fused":
            # its int4 weights its own; what stays float (norms, RoPE tables) read from the target's files
            assert "weights/draft.fused.bin" in reads and reads - {"weights/draft.fused.bin"} <= {
                "weights/target.bin", "weights/target.fused.bin"}, reads
        assert reads <= set(weights), (g.name, reads)
    # a fused graph reads the portable file for what it keeps as is, a quantized one for what stays
    # float, the EAGLE head the target's embedding: no payload is stored twice in the export
    _assert_each_payload_stored_once(manifest)
    # its portable graphs' references are the target's (same graph, same seeded call): linked, and the
    # int4 fused graphs keep no float reference (the task check holds them)
    check = self_draft / "check"
    assert os.path.samefile(check / "draft_t1.outputs.json", check / "target_t1.outputs.json")
    assert (check / "draft_t2.outputs.json").is_file()  # a T the target does not export: its own
    assert not list(check.glob("draft_fused_*")) and (check / "target_fused_t1.outputs.json").is_file()
    # the fused target reads the portable file for all it keeps as is: it stores its fused QKV and
    # RoPE tables, the batched graph its longer RoPE tables only, the int4 draft its MatMulNBits weights
    own = {}
    for g in manifest.graphs.values():
        for t in onnx.load(str(manifest.graph_path(g)), load_external_data=False).graph.initializer:
            entry = {e.key: e.value for e in t.external_data}
            if entry and entry["location"].endswith(f"{g.model}.{g.flavor}.bin"):
                own.setdefault(g.name, set()).add(t.name)
    assert own["target_fused_batched"] == {"rope.cos", "rope.sin"}, own["target_fused_batched"]
    assert own["target_fused_t1"] <= {"rope.cos", "rope.sin"} | {f"layers.{i}.qkv.weight" for i in range(64)}, \
        own["target_fused_t1"]


def _assert_each_payload_stored_once(manifest) -> None:
    stored: dict[str, set] = {}  # payload sha256 -> where the graphs read it
    for g in manifest.graphs.values():
        for t in onnx.load(str(manifest.graph_path(g)), load_external_data=False).graph.initializer:
            entry = {e.key: e.value for e in t.external_data}
            if entry:
                where = ((manifest.graph_path(g).parent / entry["location"]).resolve(), int(entry["offset"]))
                with open(where[0], "rb") as f:
                    f.seek(where[1])
                    digest = hashlib.sha256(f.read(int(entry["length"]))).hexdigest()
                stored.setdefault(digest, set()).add(where)
    assert all(len(places) == 1 for places in stored.values()), [sorted(p) for p in stored.values() if len(p) > 1]


@pytest.mark.parametrize("extra", [["--weights", "int8"], ["--heads-weights", "int4"]])
def test_quantized_exports_read_each_payload_where_it_is_stored(micro_with_heads, tmp_path, extra):
    """An int8 target with its int4 self-draft (both rewritten; the draft's fused graph built, not
    copied, since the target's fused file is rewritten), and a float target with an int4 EAGLE head
    (whose float graph read the target's fused file): every graph loads from what the export stores,
    each payload once, and the methods still print `ar`'s tokens."""
    from specdeploy.cli import main
    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.loaded_export import LoadedExport
    from specdeploy.runtime.manifest import load_manifest
    from specdeploy.runtime.methods import build_drafter

    family, out = micro_with_heads, tmp_path / "export"
    code = main(["export", "--target", str(family / "target"), "--draft", "self", "--out", str(out),
                 "--eagle", str(family / "eagle"), "--medusa", str(family / "medusa"), *extra])
    assert code == 0
    manifest = load_manifest(out)  # checksums and containment of every file a graph reads
    assert set(manifest.quantization["models"]) == ({"target", "draft", "eagle"} if "--weights" in extra
                                                    else {"draft", "eagle"})
    _assert_each_payload_stored_once(manifest)
    export = LoadedExport(out)
    # verified along a tree's leading chain only, an int8 target's draft proposes no runner-up leaves
    drafter = build_drafter(export, export.method_config("draft"))
    assert drafter.runner_up == (0.0 if "--weights" in extra else 0.1)
    for text in PROMPTS[:2]:
        ids = export.tokenizer.encode(text)
        ar = generate(export, ids, method="ar", max_new_tokens=24, ignore_eos=True).token_ids
        for method in ("draft", "eagle", "medusa"):
            got = generate(export, ids, method=method, max_new_tokens=24, ignore_eos=True, adaptive=False)
            assert got.token_ids == ar, (method, text)


def test_greedy_output_equals_ar_whatever_the_stop_rule_drafts(self_draft):
    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.loaded_export import LoadedExport

    export = LoadedExport(self_draft)
    calls = {}
    for stop in (0.0, 0.4, 0.95):
        total = 0
        for text in PROMPTS:
            ids = export.tokenizer.encode(text)
            ar = generate(export, ids, method="ar", max_new_tokens=40, ignore_eos=True)
            got = generate(export, ids, method="draft", max_new_tokens=40, ignore_eos=True, adaptive=False,
                           method_overrides={"stop_below": stop})
            assert got.token_ids == ar.token_ids, (stop, text)
            total += got.stats["target_calls"]
        calls[stop] = total
    # the int4 copy agrees with its target on most tokens: far fewer target calls than tokens
    assert calls[0.0] < 0.6 * 40 * len(PROMPTS), calls
    # a high stop drafts fewer tokens per step, so it verifies more often
    assert calls[0.0] < calls[0.95], calls
    # the stop rule priced the drafts by what the export measured: every greedy step counted its drafts
    from specdeploy.runtime.drafters.acceptance import PRIOR_WEIGHT, ConfidenceAcceptance

    table = export.part("draft-acceptance:greedy", ConfidenceAcceptance)
    assert sum(table.offered) > len(table.offered) * PRIOR_WEIGHT + 40, table.offered
    assert 0 < sum(table.hits) < sum(table.offered)


def test_under_penalties_the_draft_drafts_as_the_target_will_choose(self_draft):
    """The self-draft penalizes its own logits as the target's rows will be (runtime/penalties.py), so a
    penalty that turns the target away from a repeat turns the draft away too: it keeps agreeing."""
    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.loaded_export import LoadedExport
    from specdeploy.runtime.penalties import Penalties

    export = LoadedExport(self_draft)
    calls, tokens, moved = 0, 0, 0
    for penalties in (Penalties(1.5), Penalties(frequency=1.0, presence=0.5)):
        for text in PROMPTS:
            ids = export.tokenizer.encode(text)
            ar = generate(export, ids, method="ar", max_new_tokens=40, ignore_eos=True, penalties=penalties)
            got = generate(export, ids, method="draft", max_new_tokens=40, ignore_eos=True, adaptive=False,
                           method_overrides={"stop_below": 0.0}, penalties=penalties)
            assert got.token_ids == ar.token_ids, (penalties, text)
            moved += ar.token_ids != generate(export, ids, method="ar", max_new_tokens=40, ignore_eos=True).token_ids
            calls, tokens = calls + got.stats["target_calls"], tokens + 40
    assert moved >= len(PROMPTS)  # the penalties changed the output
    # about as few calls as without penalties (0.14 of the tokens here); drafting unpenalized, 0.28-0.43
    assert calls < 0.2 * tokens, (calls, tokens)


@pytest.mark.parametrize("which", ["self", "own"])
def test_greedy_runner_up_leaves_are_verified_and_taken(self_draft, micro_export, which):
    """draft.runner_up: a greedy step also verifies the draft's runner-up where it hesitates, as a leaf
    beside the chain; leaves get taken, and the output is still `ar`'s, for the self-draft (its cache
    refilled from the target's) and for a draft with its own cache (its rows after a taken leaf dropped)."""
    import numpy as np

    from specdeploy.runtime.generate import Generation
    from specdeploy.runtime.loaded_export import LoadedExport
    from specdeploy.runtime.methods import build_drafter

    export = LoadedExport(self_draft if which == "self" else micro_export)
    counts = {}
    for runner_up in (0.0, 0.001):  # 0.001: leaves beside every draft the budget leaves room for
        trees = taken = 0
        for text in PROMPTS:
            ids = export.tokenizer.encode(text)
            # a low stop: longer chains, so leaves beside drafts the chain went past get taken too
            drafter = build_drafter(export, export.method_config("draft", {"runner_up": runner_up, "stop_below": 0.05}))
            # priced by its own probabilities: the chains stop short of k and leave the leaves room (the
            # measured chance of a draft that agrees this well runs every chain to k)
            drafter.acceptance = None
            update = drafter.update

            def recorded(state, proposal, verdict, out, update=update):
                nonlocal trees, taken
                parents = proposal.tree.parents
                chain = next((j for j in range(1, len(parents)) if parents[j] != j - 1), len(parents))
                trees += chain < len(parents)
                taken += max(verdict.path) >= chain  # the accepted path ends in a leaf
                update(state, proposal, verdict, out)

            drafter.update = recorded
            gen = Generation(export, ids, method="draft", max_new_tokens=40, ignore_eos=True, adaptive=False,
                             drafter=drafter)
            got = gen.result()
            ar = Generation(export, ids, method="ar", max_new_tokens=40, ignore_eos=True).result()
            assert got.token_ids == ar.token_ids, (which, runner_up, text)
            if which == "own":  # its cache holds the committed tokens' rows, not a passed-over draft's
                draft = drafter.decoder
                n = draft.cache.length
                kept = [np.array(rows[:, :n]) for rows in draft.cache.head_major()]
                draft.reset()
                draft.prefill(gen.state.tokens[:n], export.prefill_chunk)
                for old, fresh in zip(kept, draft.cache.head_major()):
                    np.testing.assert_allclose(old, fresh[:, :n], atol=1e-4)
        counts[runner_up] = (trees, taken)
    assert counts[0.0] == (0, 0)  # a chain only
    assert counts[0.001][1] > 0, counts  # leaves were verified and some were the target's tokens


def test_the_self_draft_drafts_on_its_targets_kv_of_the_committed_tokens(self_draft, micro_export):
    """A self-draft's cache holds the target's KV of every committed token: the prompt's (its int4 prefill
    cost as much as the target's), so the draft model runs no call over the prompt, and each step's
    accepted tokens', copied when it drafts. The output is still the target's own. A draft from another
    model is not seeded."""
    import numpy as np

    from specdeploy.runtime.generate import Generation
    from specdeploy.runtime.loaded_export import LoadedExport
    from specdeploy.runtime.methods import build_drafter

    export = LoadedExport(self_draft)
    ids = export.tokenizer.encode(PROMPTS[1] * 6)
    assert len(ids) > export.prefill_chunk
    drafter = build_drafter(export, export.method_config("draft"))
    target, draft = export.decoder("target"), drafter.decoder
    assert drafter.seed_from is target
    rows: list[int] = []  # rows of each draft-model call (the real calls, recorded)
    forward = draft.forward
    draft.forward = lambda tokens, *args, **kw: (rows.append(len(tokens)), forward(tokens, *args, **kw))[1]
    gen = Generation(export, ids, method="draft", max_new_tokens=24, ignore_eos=True, adaptive=False,
                     drafter=drafter)
    steps = iter(gen)
    next(steps)  # prefill and the first step
    prompt = len(ids) - 1  # the target's prefill: all but the root
    for seeded, own in zip(target.cache.head_major(), draft.cache.head_major()):
        np.testing.assert_array_equal(own[:, :prompt], seeded[:, :prompt])
    assert rows and max(rows) == 1  # the root and its drafts, one row a call: nothing over the prompt
    list(steps)
    assert max(rows) <= 2  # never a catch-up past the root and the last draft
    # the accepted tokens' rows are the target's too, copied when it drafts next (a plain step copies nothing)
    committed = target.cache.length
    assert prompt < draft.cache.length < committed
    calls = len(rows)
    drafter.propose(gen.state)
    assert max(rows[calls:]) == 1  # nothing fed but the root and its drafts
    for seeded, own in zip(target.cache.head_major(), draft.cache.head_major()):
        np.testing.assert_array_equal(own[:, :committed], seeded[:, :committed])
    ar = Generation(export, ids, method="ar", max_new_tokens=24, ignore_eos=True).result()
    assert gen.new_ids == ar.token_ids
    # micro's draft is its own small model: its cache is its own prefill
    other = LoadedExport(micro_export)
    assert build_drafter(other, other.method_config("draft")).seed_from is None


@pytest.mark.parametrize("extra,message", [
    (["--draft-weights", "float"], "would cost at least as much per token as the float target"),
    (["--weights", "int8", "--draft-weights", "int8"], "would cost at least as much per token as the int8 target"),
    (["--weights", "int4"], "an int4 target has none"),
])
def test_a_self_draft_no_cheaper_than_its_target_is_refused(micro_family, tmp_path, capsys, extra, message):
    from specdeploy.cli import main

    code = main(["export", "--target", str(micro_family / "target"), "--draft", "self", "--out",
                 str(tmp_path / "never"), "--no-check", *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert not (tmp_path / "never").exists()


def test_batched_rows_self_draft_on_their_own_slots_kv(self_draft):
    """On a batched service each row's self-draft copies its target rows from its own slot of the
    batch's KV: concurrent draft requests give the batch-1 `ar` tokens and still draft (a wrong slot's
    rows would leave the output lossless but take few drafts)."""
    from concurrent.futures import ThreadPoolExecutor

    from specdeploy.runtime.service import Service

    alone = Service.load(self_draft, pool_size=1)
    batched = Service.load(self_draft, batch=3, queue_size=8)
    jobs = [dict(prompt=text, max_new_tokens=32, ignore_eos=True) for text in PROMPTS[:3]]
    want = [alone.generate(**job, method="ar").token_ids for job in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: batched.generate(**job, method="draft"), jobs))
    assert [r.token_ids for r in got] == want
    # drafts as many tokens per call as alone. The stop rule prices drafts by what its instance measured in
    # earlier requests (drafters/acceptance.py), and each batch row served its one request fresh: so does
    # each request here, on an instance of its own
    alone_calls = []
    for job in jobs:
        fresh = Service.load(self_draft, pool_size=1)
        try:
            alone_calls.append(fresh.generate(**job, method="draft").stats["target_calls"])
        finally:
            fresh.close()
    assert [r.stats["target_calls"] for r in got] == alone_calls


def test_a_float_self_draft_keeps_its_whole_lm_head_too(micro_family, tmp_path):
    """The target's own dir as a float draft (no quantization): its dir has no draft vocabulary, so a
    config's draft_vocab is dropped and the manifest says 0 (for a while only quantized exports did)."""
    from specdeploy.export.exporter import export_all

    config = tmp_path / "config.yaml"
    config.write_text("methods:\n  draft: {draft_vocab: 64}\n")
    target = micro_family / "target"
    out = export_all(target, tmp_path / "out", draft=target, config=config, progress=lambda m: None)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["methods"]["draft"]["draft_vocab"] == 0 and "draft_vocab_file" not in manifest["models"]["draft"]
