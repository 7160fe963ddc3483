"""Medusa: published heads layout, heads graph, trees against the export, drafter, tree calibration.
The static trees alone (published data, buffers, validation) and the tree search are in tests/unit/.

Heads: trained on the micro family (cached in build/family/micro/medusa) and random
heads in the published layout (.pt and .safetensors). Greedy output must equal
Hugging Face greedy; sampling must reproduce the target's exact joint distribution.
"""

from __future__ import annotations

import contextlib
import itertools
import json

import numpy as np
import pytest
import torch
from conftest import BUILD, hf_greedy, run_cli
from scipy.stats import chisquare

from specdeploy.runtime.errors import SpecDeployError
from specdeploy.runtime.sampling import SamplingParams
from specdeploy.runtime.tree import Tree

PROMPTS = [
    "def foo(x):\n    return",
    "import os\nimport sys\n\n\nclass Config",
    "    def __init__(self, name, value=None):\n        self.",
    "with open(path) as f:\n    data = f.read()\n",
    "for i in range(10):\n    if i %",
]
NEW = 40


# ---------------------------------------------------------------- fixtures


@contextlib.contextmanager
def one_torch_thread():
    """Micro models run fastest on one thread, and the suite shares two cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trained_heads(micro_family):
    from specdeploy.train.medusa import build_medusa_heads

    meta = build_medusa_heads(micro_family, "micro", progress=lambda m: None)
    return micro_family / "medusa", meta


def _random_heads(micro_family, fmt: str, seed: int):
    from specdeploy.export.medusa_heads import MedusaHeads, medusa_module_list, save_heads

    cfg = json.loads((micro_family / "target" / "config.json").read_text())
    torch.manual_seed(seed)
    heads = medusa_module_list(4, 1, cfg["hidden_size"], cfg["vocab_size"])
    with torch.no_grad():
        for p in heads.parameters():  # peaked logits: no near-ties between ORT and PyTorch
            p.normal_(0, 0.3)
    return save_heads(MedusaHeads(heads, 1, "random"), BUILD / "test_models" / f"medusa_random_{fmt}", fmt)


@pytest.fixture(scope="module")
def medusa_exports(micro_family, trained_heads):
    """name -> export dir: trained heads (default tree), random .pt heads (published 63-node
    tree), random .safetensors heads (a small tree)."""
    from specdeploy.export.exporter import export_all

    target = micro_family / "target"
    quiet = lambda m: None  # noqa: E731
    out = BUILD / "test_exports"
    with one_torch_thread():
        return {
            "trained": export_all(target, out / "medusa_trained", medusa=trained_heads[0], progress=quiet),
            "pt": export_all(target, out / "medusa_pt", medusa=_random_heads(micro_family, "pt", 1),
                             medusa_tree="mc_sim_7b_63", progress=quiet),
            "safetensors": export_all(target, out / "medusa_st", medusa=_random_heads(micro_family, "safetensors", 2),
                                      medusa_tree="medusa_cpu_8", progress=quiet),
        }


@pytest.fixture(scope="module")
def exports(medusa_exports):
    from specdeploy.runtime.loaded_export import LoadedExport

    # One ORT thread: the suite shares two cores, and spinning thread pools crawl when oversubscribed.
    return {name: LoadedExport(path, threads=1) for name, path in medusa_exports.items()}


@pytest.fixture(scope="module")
def hf_reference(micro_family, exports):
    """HF greedy continuation of every prompt (all three exports share the target)."""
    tok = exports["trained"].tokenizer
    with one_torch_thread():
        return {p: hf_greedy(micro_family / "target", tok.encode(p), NEW) for p in PROMPTS}


# ---------------------------------------------------------------- heads: layout, training, loading


def test_trained_heads_use_the_published_layout(trained_heads, micro_family):
    from safetensors.torch import load_file

    heads_dir, meta = trained_heads
    cfg = json.loads((heads_dir / "config.json").read_text())
    assert cfg["medusa_num_heads"] == 4 and cfg["medusa_num_layers"] == 1 and cfg["base_model_name_or_path"]
    state = load_file(str(heads_dir / "medusa_lm_head.safetensors"))
    target_cfg = json.loads((micro_family / "target" / "config.json").read_text())
    h, v = target_cfg["hidden_size"], target_cfg["vocab_size"]
    assert set(state) == {f"{k}.{n}" for k in range(4) for n in ("0.linear.weight", "0.linear.bias", "1.weight")}
    assert state["0.0.linear.weight"].shape == (h, h) and state["3.1.weight"].shape == (v, h)
    # Training reports per-head top-1 accuracy against the target on held-out text; the
    # first head must beat chance by far (the heads learned something).
    acc = meta["accuracy"]["heldout_greedy"]
    assert [a["head"] for a in acc] == [0, 1, 2, 3]
    assert acc[0]["top5"] > 0.3


def test_pt_and_safetensors_load_identically(micro_family, tmp_path):
    from specdeploy.export.medusa_heads import load_heads, save_heads

    src = _random_heads(micro_family, "safetensors", 3)
    cfg = json.loads((micro_family / "target" / "config.json").read_text())
    a = load_heads(src, cfg["hidden_size"], cfg["vocab_size"])
    save_heads(a, tmp_path / "pt", "pt")
    b = load_heads(tmp_path / "pt", cfg["hidden_size"], cfg["vocab_size"])
    for (ka, va), (kb, vb) in zip(a.heads.state_dict().items(), b.heads.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)


@pytest.mark.parametrize("bad,needle", [
    ("hidden", "0.0.linear.weight has shape [32, 32], expected [64, 64]"),
    ("vocab", "0.1.weight has shape [100, 64], expected [512, 64]"),
    ("missing", "missing"),
    ("extra_head", "unexpected tensors"),
    ("no_weights", "holds no Medusa weights"),
    ("corrupt", "could not read Medusa heads"),
])
def test_bad_heads_are_one_clear_error(micro_family, tmp_path, bad, needle):
    from safetensors.torch import save_file

    from specdeploy.export.medusa_heads import load_heads

    cfg = json.loads((micro_family / "target" / "config.json").read_text())
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    hid, voc = (32 if bad == "hidden" else h), (100 if bad == "vocab" else v)
    state = {"0.0.linear.weight": torch.zeros(hid, hid), "0.0.linear.bias": torch.zeros(hid),
             "0.1.weight": torch.zeros(voc, hid)}
    if bad == "missing":
        del state["0.0.linear.bias"]
    if bad == "extra_head":
        state["1.1.weight"] = torch.zeros(v, h)
    d = tmp_path / bad
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"medusa_num_heads": 1, "medusa_num_layers": 1}))
    if bad == "corrupt":
        (d / "medusa_lm_head.pt").write_bytes(b"not a pickle")
    elif bad != "no_weights":
        save_file(state, str(d / "medusa_lm_head.safetensors"))
    with pytest.raises(SpecDeployError) as err:
        load_heads(d, h, v)
    assert needle in str(err.value)


def test_cli_rejects_mismatched_heads_before_writing(micro_family, tmp_path):
    from specdeploy.export.medusa_heads import MedusaHeads, medusa_module_list, save_heads

    heads = save_heads(MedusaHeads(medusa_module_list(2, 1, 16, 512), 1), tmp_path / "heads")
    out = tmp_path / "out"
    proc = run_cli("export", "--target", micro_family / "target", "--medusa", heads, "--out", out)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and "hidden_size 64" in last and "Traceback" not in proc.stderr
    assert not out.exists()


# ---------------------------------------------------------------- trees


def test_tree_larger_than_the_graph_is_one_clear_error(exports):
    from specdeploy.runtime.generate import Generation

    export = exports["trained"]
    ids = export.tokenizer.encode("def f():")
    k, largest = export.method_config("medusa").top_k, export.decoder("target").sizes[-1]
    wide = [list(p) for n in (1, 2, 3, 4) for p in itertools.product(range(k), repeat=n)]  # ranks within top-k
    with pytest.raises(SpecDeployError) as err:
        Generation(export, ids, method="medusa", method_overrides={"tree": wide})
    assert f"needs a target graph of {len(wide) + 1} tokens; this export's largest is {largest}" in str(err.value)
    with pytest.raises(SpecDeployError, match=f"needs top_k >= 10, but medusa.top_k is {k}"):
        Generation(export, ids, method="medusa", method_overrides={"tree": "mc_sim_7b_63"})
    with pytest.raises(SpecDeployError, match="exceed the verify graph's 9 tokens"):
        Tree.from_paths(wide, max_size=9)


def test_tree_mask_logits_equal_sequential_decoding(exports):
    """The 63-node published tree scored in one masked call == each path decoded on its own."""
    export = exports["pt"]
    tree = export.method_config("medusa").tree_paths.tree()
    dec = export.decoder("target")
    prompt = export.tokenizer.encode("def read(path):\n    with open(path) as f:")
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, export.manifest.models["target"].vocab_size, tree.size)
    dec.reset()
    dec.prefill(prompt, export.prefill_chunk)
    base = dec.cache.length
    tree_out = dec.forward(tokens, base + tree.depth, tree.mask)
    for path in tree.leaf_paths:
        dec.cache.length = base
        n = len(path)
        seq = dec.forward(tokens[path], base + np.arange(n), np.tril(np.ones((n, n), bool)))
        np.testing.assert_allclose(tree_out.logits[path], seq.logits, atol=2e-4, rtol=1e-4)
        np.testing.assert_allclose(tree_out.hidden[path], seq.hidden, atol=2e-4, rtol=1e-4)


# ---------------------------------------------------------------- drafter and generation


def test_heads_graph_and_tree_fill_match_pytorch(exports, medusa_exports, micro_family):
    """Node (depth d, rank r) holds head d-1's r-th candidate; the graph equals the torch heads."""
    from specdeploy.export.medusa_heads import load_heads
    from specdeploy.runtime.drafters.base import DecodeState
    from specdeploy.runtime.methods import build_drafter

    export = exports["pt"]
    config = export.method_config("medusa")
    drafter = build_drafter(export, config)
    spec = export.manifest.models["target"]
    heads = load_heads(BUILD / "test_models" / "medusa_random_pt", spec.hidden_size, spec.vocab_size)
    hidden = np.random.default_rng(5).standard_normal(spec.hidden_size).astype(np.float32)
    drafter.hidden = hidden
    proposal = drafter.propose(DecodeState([7], SamplingParams(), np.random.default_rng(0)))
    with torch.no_grad():
        ref = heads.logits(torch.from_numpy(hidden)).topk(config.top_k, -1).indices.numpy()
    tree = proposal.tree
    assert proposal.tokens[0] == 7
    for i in range(1, tree.size):
        assert proposal.tokens[i] == ref[tree.depth[i] - 1, tree.ranks[i]]


@pytest.mark.parametrize("which", ["trained", "pt", "safetensors"])
def test_greedy_equals_hf_greedy(exports, hf_reference, which):
    from specdeploy.runtime.generate import generate

    export = exports[which]
    accepted = 0
    for prompt in PROMPTS:
        ids = export.tokenizer.encode(prompt)
        ours = generate(export, ids, method="medusa", max_new_tokens=NEW, ignore_eos=True)
        assert ours.token_ids == hf_reference[prompt], (which, prompt)
        accepted += ours.stats["accepted_drafts"]
    if which == "trained":  # the equality is not vacuous: trained heads' drafts were accepted
        assert accepted >= len(PROMPTS) * 4


def test_first_step_drafts_from_the_prefill_hidden_state(exports, hf_reference):
    """The prefill's last row produced the root, so the first step already verifies a tree;
    a one-token prompt (no prefill) starts with a plain step."""
    from specdeploy.runtime.generate import Generation

    export = exports["trained"]
    # A prompt that ends in the target's own continuation, as a chat template's assistant
    # header does: the heads assume the root is the target's pick at prompt[-2].
    ref = hf_reference[PROMPTS[0]]
    ids = export.tokenizer.encode(PROMPTS[0]) + ref[:8]
    gen = Generation(export, ids, method="medusa", max_new_tokens=NEW - 8, ignore_eos=True, adaptive=False)
    steps = iter(gen)
    next(steps)  # the first step's first token (ASCII: one token, one event)
    assert gen.stats["target_calls"] == 1 and gen.stats["accepted_drafts"] >= 1
    list(steps)
    assert gen.new_ids == ref[8:]
    alone = Generation(export, ids[:1], method="medusa", max_new_tokens=1, ignore_eos=True, adaptive=False)
    result = alone.result()
    assert result.stats["prefill_calls"] == 0 and result.stats["accepted_drafts"] == 0


def test_draft_vocabulary_limits_candidates(medusa_exports, trained_heads, micro_family, tmp_path):
    """medusa.draft_vocab N: trained heads (with draft_vocab.json) propose only the N most frequent
    tokens, and greedy output is unchanged; heads without the file keep the full vocabulary."""

    from specdeploy.export.check import check_path
    from specdeploy.export.exporter import export_all
    from specdeploy.runtime.backends import OrtGraph
    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.loaded_export import LoadedExport

    config = tmp_path / "vocab.yaml"
    config.write_text("max_context: 256\nmethods:\n  medusa: {draft_vocab: 40}\n")
    with one_torch_thread():
        out = export_all(micro_family / "target", tmp_path / "export", medusa=trained_heads[0], config=config,
                         progress=lambda m: None)
    allowed = set(json.loads((trained_heads[0] / "draft_vocab.json").read_text())["token_ids"][:40])
    vocab = json.loads((out / "manifest.json").read_text())["models"]["target"]["vocab_size"]
    assert json.loads((out / "manifest.json").read_text())["graphs"]["medusa_heads"]["draft_vocab"] == 40
    pt = json.loads((medusa_exports["pt"] / "manifest.json").read_text())["graphs"]["medusa_heads"]
    assert pt["draft_vocab"] == vocab  # random published-layout heads: no draft_vocab.json
    assert all(r.passed for r in check_path(out) if r.graph == "medusa_heads")
    graph = OrtGraph(out / "medusa_heads.onnx", threads=1)
    hidden_size = graph.session.get_inputs()[0].shape[-1]
    rng = np.random.default_rng(0)
    proposed = set()
    for _ in range(20):
        proposed |= set(graph.run({"hidden": rng.standard_normal((1, hidden_size)).astype(np.float32)})["topk_ids"]
                        .ravel().tolist())
    assert proposed and proposed <= allowed
    export = LoadedExport(out, threads=1)
    for prompt in PROMPTS[:3]:
        ids = export.tokenizer.encode(prompt)
        ours = generate(export, ids, method="medusa", max_new_tokens=NEW, ignore_eos=True)
        with one_torch_thread():
            assert ours.token_ids == hf_greedy(micro_family / "target", ids, NEW), prompt


def exact_joint(export, ids, params, n):
    """{(x1..xn): probability} of the target's first n tokens under `params`, from its logits."""
    dec = export.decoder("target")
    dist = {}

    def walk(prefix, prob):
        if len(prefix) == n:
            dist[tuple(prefix)] = prob
            return
        seq = ids + prefix
        dec.reset()
        dec.prefill(seq[:-1], export.prefill_chunk)
        out = dec.forward(np.array(seq[-1:]), np.array([len(seq) - 1]), np.ones((1, 1), bool))
        p = params.probs(out.logits[0])
        for x in np.flatnonzero(p):
            walk(prefix + [int(x)], prob * p[x])

    walk([], 1.0)
    return dist


RUNS = 1500  # a residual rule that resamples from p after a rejection scores p < 1e-15 at 1200 runs


def test_sampling_matches_target_distribution(exports):
    """Tokens 1-3: Medusa steps from the prefill's hidden state on (accepts, residuals, bonus).
    A wrong residual rule (resampling from p after a rejection) fails this by far."""
    from specdeploy.runtime.generate import generate

    export = exports["trained"]
    ids = export.tokenizer.encode("def foo(x):\n    return")
    params = SamplingParams(temperature=1.0, top_k=4)
    dist = exact_joint(export, ids, params, 3)
    counts = dict.fromkeys(dist, 0)
    drafted = 0
    for seed in range(RUNS):
        r = generate(export, ids, method="medusa", params=SamplingParams(1.0, 4, seed=seed), max_new_tokens=3,
                     ignore_eos=True)
        counts[tuple(r.token_ids)] += 1  # KeyError: a sample outside the target's support
        drafted += r.stats["accepted_drafts"]
    assert drafted > RUNS // 4  # the Medusa step really accepted drafts
    keys = sorted(dist)
    obs = np.array([counts[k] for k in keys], float)
    exp = np.array([dist[k] for k in keys]) * RUNS
    rare = exp < 5  # pool rare cells for the chi-square approximation
    obs, exp = np.append(obs[~rare], obs[rare].sum()), np.append(exp[~rare], exp[rare].sum())
    keep = exp > 0
    assert chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue > 1e-3


# ---------------------------------------------------------------- tree calibration


def test_tune_trees_replay_predicts_what_medusa_accepts(exports):
    """The calibration records the heads where steps start (not at every accepted position, which
    inside a long accepted run match well and were never a step's start): its replay of the
    export's own tree is within 0.5 tokens a step of what a real run accepts."""
    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.tree_tuning import tune

    export = exports["trained"]
    prompts = [export.tokenizer.encode(p) for p in PROMPTS[:3]]
    report = tune(export, "medusa", prompts, max_new_tokens=NEW, max_nodes=16, progress=lambda m: None)["report"]
    calls = sum(generate(export, ids, method="medusa", max_new_tokens=NEW, ignore_eos=True, adaptive=False)
                .stats["target_calls"] for ids in prompts)
    real = len(prompts) * NEW / calls
    assert abs(report["export_tree"]["empirical_tokens_per_step"] - real) < 0.5, (report["export_tree"], real)


def test_tune_tree_cli_writes_a_usable_tree(medusa_exports, exports, tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS[:3]))
    out = tmp_path / "tuned.json"
    proc = run_cli("tune-tree", medusa_exports["trained"], "--method", "medusa", "--prompts", prompts,
                   "--max-new-tokens", "24", "--max-nodes", "20", "--out", out)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    cal = doc["calibration"]
    assert cal["positions"] > 20 and len(cal["acceptance"]["rates"]) == 4
    assert 1 <= len(doc["paths"]) <= 20
    # The runtime accepts it as a tree for this export (ranks within top-k, depth within heads).
    config = exports["trained"].method_config("medusa", {"tree": str(out)})
    assert [list(p) for p in config.tree_paths.paths] == doc["paths"]
    # counts below 1 are refused before any calibration (a 0-node tree, a negative sample)
    for flag, value in (("--max-nodes", "0"), ("--max-nodes", "-1"), ("--num-prompts", "-1")):
        proc = run_cli("tune-tree", medusa_exports["trained"], "--method", "medusa", flag, value,
                       "--out", tmp_path / "bad.json")
        assert proc.returncode == 2 and f"{flag} must be at least 1" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and not (tmp_path / "bad.json").exists()
    # more held-out prompts than there are: one line, not an internal error
    proc = run_cli("tune-tree", medusa_exports["trained"], "--method", "medusa", "--num-prompts", "100000",
                   "--out", tmp_path / "bad.json")
    assert proc.returncode == 2 and "--num-prompts 100000: " in proc.stderr and "--prompts FILE" in proc.stderr
    # a folder that takes no new file is refused before the calibration's minutes, not after them
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        import os

        if not os.access(locked, os.W_OK):  # root writes anywhere but on a read-only filesystem
            proc = run_cli("tune-tree", medusa_exports["trained"], "--method", "medusa", "--out", locked / "t.json")
            assert proc.returncode == 2 and "cannot write in" in proc.stderr, proc.stderr
    finally:
        locked.chmod(0o700)
    # written whole or not at all: the tree is replaced by a rename, with no temp file left beside it
    assert sorted(p.name for p in out.parent.iterdir() if p.name.startswith(".tuned")) == []


def test_a_tree_ranking_past_the_heads_vocabulary_is_refused_at_export(micro_with_heads, tmp_path):
    """Rank 700 among 512 tokens exported every graph, then failed as an internal error (top-k out of range)."""
    tree = tmp_path / "tree.json"
    tree.write_text(json.dumps({"paths": [[0], [700]]}))
    proc = run_cli("export", "--target", micro_with_heads / "target", "--medusa", micro_with_heads / "medusa",
                   "--tree", tree, "--out", tmp_path / "out", "--no-check")
    assert proc.returncode == 2 and "needs top-701 candidates per head, but its heads choose among" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
