"""EAGLE: trained and published-layout heads, static and dynamic trees, lossless verification.

- greedy output equals Hugging Face greedy for EAGLE-2 (dynamic) and EAGLE-1 (static)
  trees, with the trained micro head and with random-weight heads in SafeAILab's
  EAGLE-1/2 (.safetensors, .bin) and EAGLE-3 (draft vocabulary, three feature layers)
  layouts;
- every drafted node is among the top-k of a plain PyTorch head recomputed from
  scratch along its path (catches KV-cache, position, mask or feature-pairing bugs
  that greedy equality cannot see: verification would hide them);
- sampling reproduces the target's own distribution (chi-square);
- the dynamic tree always has exactly total_tokens nodes and is a valid tree;
- bad heads give one clear error (bad configs: tests/unit/test_method_configs.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import BUILD, hf_greedy, run_cli
from scipy.stats import chisquare

PROMPTS = [
    "def foo(x):\n    return",
    "import os\nimport sys\n\n\nclass Config",
    "    def __init__(self, name, value=None):\n        self.",
    "with open(path) as f:\n    data = f.read()\n",
]
NEW = 40
SAMPLING_RUNS = 1000  # enough to reject a wrong residual or bonus rule (checked by breaking verify.py)
ROOT = BUILD / "test_eagle"
# eagle1's 25-node tree needs a 26-token verify graph; eagle2 (16 nodes) pads into it.
CONFIG = "max_context: 256\nmethods:\n  eagle: {mode: eagle1}\n"


def _export(target: Path, head: Path, name: str, config_text: str = CONFIG) -> Path:
    from specdeploy.export.exporter import export_all

    config = ROOT / f"{name}.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(config_text)
    return export_all(target, ROOT / name, eagle=head, config=config, progress=lambda m: None)


def _random_target(micro_family: Path, out: Path, layers: int) -> Path:
    """A random Llama with enough layers for EAGLE-3's three feature layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdeploy.train.tokenizer import copy_tokenizer

    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(5)
    LlamaForCausalLM(cfg).eval().save_pretrained(out)
    copy_tokenizer(micro_family / "tokenizer", out)
    return out


def _random_head(version: int, target_dir: Path, out: Path, fmt: str, seed: int, draft_vocab=None) -> Path:
    from specdeploy.export.eagle_heads import new_head, save_head
    from specdeploy.export.hf_loading import load_causal_lm

    target = load_causal_lm(target_dir)
    head = new_head(version, target, seed=seed, draft_vocab=draft_vocab)
    with torch.no_grad():
        for name, p in head.head_state_dict().items():
            if name.endswith("norm.weight"):  # published heads have trained norms, not ones
                p.add_(torch.randn_like(p) * 0.2)
        if version == 3:  # a draft vocabulary: every other target id, mapped back through d2t
            keep = torch.arange(0, target.config.vocab_size, 2)[:draft_vocab]
            head.d2t.copy_(keep - torch.arange(draft_vocab))
            head.t2d.zero_()
            head.t2d[keep] = True
    return save_head(head, target.config, out, fmt)


@pytest.fixture(scope="module")
def trained_head(micro_family):
    from specdeploy.train.eagle import build_eagle_head

    meta = build_eagle_head(micro_family, "micro", progress=lambda m: None)
    return micro_family / "eagle", meta


@pytest.fixture(scope="module")
def heads(micro_family, trained_head):
    """name -> (target dir, head dir, export dir)."""
    target = micro_family / "target"
    deep = _random_target(micro_family, ROOT / "target4", layers=4)
    made = {
        "trained": (target, trained_head[0]),
        "eagle1_safetensors": (target, _random_head(1, target, ROOT / "head1_st", "safetensors", seed=1)),
        "eagle1_bin": (target, _random_head(1, target, ROOT / "head1_bin", "bin", seed=2)),
        "eagle3_bin": (deep, _random_head(3, deep, ROOT / "head3_bin", "bin", seed=3, draft_vocab=200)),
    }
    return {name: (t, h, _export(t, h, f"export_{name}")) for name, (t, h) in made.items()}


def _open(export_dir: Path):
    from specdeploy.runtime.loaded_export import LoadedExport

    return LoadedExport(export_dir, threads=1)


def _steps(export, prompt: str, overrides: dict, steps: int):
    """The verify loop of runtime/generate.py by hand, yielding (state before, proposal) per step."""
    from specdeploy.runtime.generate import Generation
    from specdeploy.runtime.verify import verify

    g = Generation(export, export.tokenizer.encode(prompt), method="eagle", max_new_tokens=NEW,
                   method_overrides=overrides)
    target, drafter, state = g.target, g.drafter, g.state
    target.reset()
    target.prefill(state.tokens[:-1], export.prefill_chunk, on_chunk=drafter.prefilled)
    drafter.start(state)
    for _ in range(steps):
        proposal = drafter.propose(state)
        yield list(state.tokens), proposal, drafter
        out = target.forward(*proposal.packed(target.cache.length))
        verdict = verify(proposal.tree, proposal.tokens, out.logits, state.params, state.rng)
        target.commit(out, verdict.path)
        state.tokens.extend([int(proposal.tokens[i]) for i in verdict.path[1:]] + [verdict.next_token])
        drafter.update(state, proposal, verdict, out)


# ---------------------------------------------------------------- training and layout


@pytest.mark.parametrize("version", [1, 3])
def test_training_unroll_is_how_the_head_drafts(version):
    """train.eagle.head_unroll's level j at row i equals the head called as the drafter calls it: the
    committed rows 0..i in one causal call, then one call per level on its own output, each attending the
    committed rows and the path's earlier levels (a wrong position, mask or feature pairing differs)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdeploy.export.eagle_heads import new_head
    from specdeploy.train.eagle import head_unroll

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    head = new_head(version, LlamaForCausalLM(cfg).eval(), seed=1, draft_vocab=48).eval()
    levels, n = 3, 12
    seqs = torch.randint(0, 96, (2, n))
    feats = torch.randn(2, n, head.feature_dim)
    picked = (0, 4, n - levels - 1)
    with torch.no_grad():
        unrolled = head_unroll(head, seqs, feats, levels)
        # the draft levels at a subset of the rows (EagleTrainSpec.unroll_rows): the same rows' features
        subset = head_unroll(head, seqs, feats, levels, torch.tensor(picked))
        torch.testing.assert_close(subset[0], unrolled[0])
        for j in range(1, levels):
            torch.testing.assert_close(subset[j], unrolled[j][:, list(picked)], atol=1e-5, rtol=1e-4)
        for i in picked:
            rows = torch.arange(i + 1)
            mask = (rows[:, None] >= rows[None, :]).expand(2, i + 1, i + 1)
            past = [torch.zeros(2, 0, head.num_kv_heads, head.head_dim)] * (2 * head.num_layers)
            out, presents = head.step(seqs[:, 1 : i + 2], feats[:, : i + 1], rows.expand(2, i + 1), mask, past)
            past, feature = presents, out[:, -1:]
            for j in range(levels):
                if j:  # a draft level: the previous level's output, one position on, seeing its path
                    path = torch.ones(2, 1, j + 1, dtype=torch.bool)
                    feature, presents = head.step(seqs[:, i + 1 + j : i + 2 + j], feature,
                                                  torch.full((2, 1), i + j), path, past)
                    past = [torch.cat([p, k], 1) for p, k in zip(past, presents)]
                torch.testing.assert_close(unrolled[j][:, i], feature[:, 0], atol=1e-5, rtol=1e-4)


def test_a_spec_field_left_at_its_default_keeps_cached_heads_valid():
    """EagleTrainSpec.unroll_rows came after heads were cached: a spec that leaves it at 1.0 hashes as
    before it existed (the pinned hash: `make heads-long`'s float32 spec, trained before it), one that
    sets it is another recipe."""
    from dataclasses import replace

    from specdeploy.train.eagle import PRESETS

    long = replace(PRESETS["real-long"], bf16=False)
    assert long.unroll_rows == 1.0 and long.config_hash() == "1484beb8fc61fddc"
    assert replace(long, unroll_rows=0.5).config_hash() != long.config_hash()


def test_trained_head_is_accurate_and_in_published_layout(trained_head):
    from safetensors.torch import load_file

    head_dir, meta = trained_head
    assert meta["accuracy"]["heldout_greedy"]["top1"] >= 0.5, meta["accuracy"]
    keys = set(load_file(str(head_dir / "model.safetensors")))
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight",
            "layers.0.post_attention_layernorm.weight"} <= keys
    assert not any("input_layernorm" in k or "embed" in k or "lm_head" in k for k in keys), keys
    cfg = json.loads((head_dir / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["bias"] is True
    vocab = json.loads((head_dir / "draft_vocab.json").read_text())
    assert vocab["counts"] == sorted(vocab["counts"], reverse=True)
    assert len(set(vocab["token_ids"])) == len(vocab["token_ids"])


def test_export_checks_every_head_graph(heads):
    from specdeploy.export.check import check_path
    from specdeploy.runtime.manifest import load_manifest

    export_dir = heads["eagle3_bin"][2]
    manifest = load_manifest(export_dir)
    kinds = {g.kind for g in manifest.graphs.values()}
    assert kinds == {"decoder", "eagle_draft"}
    assert manifest.models["eagle"].extra["eagle_version"] == 3
    assert manifest.models["target"].extra["feature_layers"] == [0, 1, 2]
    assert manifest.methods["eagle"]["tree_paths"]["paths"]  # the runtime needs no tree file
    results = check_path(export_dir)
    assert results and all(r.passed for r in results), [(r.graph, r.detail) for r in results if not r.passed]


def test_draft_vocabulary_limits_candidates_not_output(micro_family, trained_head):
    """eagle.draft_vocab N: drafts come from the head's N most frequent tokens; output is unchanged."""
    from specdeploy.export.check import check_path
    from specdeploy.runtime.generate import generate

    head_dir = trained_head[0]
    allowed = set(json.loads((head_dir / "draft_vocab.json").read_text())["token_ids"][:48])
    export_dir = _export(micro_family / "target", head_dir, "export_vocab48",
                         "max_context: 256\nmethods:\n  eagle: {mode: eagle2, draft_vocab: 48}\n")
    export = _open(export_dir)
    assert export.manifest.models["eagle"].extra["draft_vocab_size"] == 48
    assert all(r.passed for r in check_path(export_dir) if r.graph.startswith("eagle"))
    drafted = set()
    for _, proposal, _ in _steps(export, PROMPTS[0], {}, 6):
        drafted |= {int(t) for t in proposal.tokens[1:]}
    assert drafted and drafted <= allowed, sorted(drafted - allowed)
    for prompt in PROMPTS[:2]:
        ids = export.tokenizer.encode(prompt)
        ours = generate(export, ids, method="eagle", max_new_tokens=NEW, ignore_eos=True)
        assert ours.token_ids == hf_greedy(micro_family / "target", ids, NEW)


# ---------------------------------------------------------------- greedy equality


@pytest.mark.parametrize("name", ["trained", "eagle1_safetensors", "eagle1_bin", "eagle3_bin"])
@pytest.mark.parametrize("mode", ["eagle2", "eagle1"])
def test_greedy_matches_hf(heads, name, mode):
    from specdeploy.runtime.generate import generate

    target, _, export_dir = heads[name]
    export = _open(export_dir)
    calls = 0
    for prompt in PROMPTS:
        ids = export.tokenizer.encode(prompt)
        ours = generate(export, ids, method="eagle", max_new_tokens=NEW, ignore_eos=True,
                        method_overrides={"mode": mode})
        assert ours.token_ids == hf_greedy(target, ids, NEW), (name, mode, prompt)
        calls += ours.stats["target_calls"]
    if name == "trained":  # the head drafts something the target accepts
        assert len(PROMPTS) * NEW / calls >= 2.0, f"acceptance length {len(PROMPTS) * NEW / calls:.2f}"


@pytest.mark.parametrize("name", ["trained", "eagle3_bin"])
def test_portable_head_graphs_draft_the_same(heads, name):
    """The fused head graphs (the CPU default) and the portable ones draft identically."""
    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.loaded_export import LoadedExport

    _, _, export_dir = heads[name]
    runs = {}
    for graphs in ("fused", "portable"):
        export = LoadedExport(export_dir, backend="ort-cpu", flavor=graphs)
        ids = export.tokenizer.encode(PROMPTS[0])
        res = generate(export, ids, method="eagle", max_new_tokens=NEW, ignore_eos=True)
        assert export.part("eagle", None).fused == (graphs == "fused")
        runs[graphs] = (res.token_ids, res.stats["target_calls"])
    assert runs["fused"] == runs["portable"]


# ---------------------------------------------------------------- drafts vs a from-scratch PyTorch head


def _torch_features(target, head, tokens: list[int], feature_layers) -> torch.Tensor:
    with torch.no_grad():
        out = target.model(input_ids=torch.tensor([tokens]), output_hidden_states=True)
    if head.version == 1:
        return out.last_hidden_state
    return head.fc(torch.cat([out.hidden_states[i + 1] for i in feature_layers], -1))


def _torch_topk(head, committed: list[int], feats: torch.Tensor, path: list[int], k: int) -> set[int]:
    """Top-k target ids after `committed` + a draft `path`, features of draft rows fed back."""
    tokens, rows = list(committed[1:]), feats[:, : len(committed) - 1]
    with torch.no_grad():
        for depth in range(len(path) + 1):
            n = len(tokens)
            causal = torch.tril(torch.ones(1, n, n, dtype=torch.bool))
            h, _ = head.step(torch.tensor([tokens]), rows, torch.arange(n)[None], causal,
                             [torch.zeros(1, 0, head.num_kv_heads, head.head_dim)] * (2 * head.num_layers))
            if depth == len(path):
                logp = torch.log_softmax(head.logits(h[0, -1]), -1)
                return set(head.to_target_ids(logp.topk(k).indices).tolist())
            tokens.append(path[depth])
            rows = torch.cat([rows, h[:, -1:]], 1)


@pytest.mark.parametrize("name", ["trained", "eagle1_bin", "eagle3_bin"])
@pytest.mark.parametrize("mode", ["eagle2", "eagle1"])
def test_drafts_match_pytorch_head(heads, name, mode):
    from specdeploy.export.eagle_heads import load_eagle_head
    from specdeploy.export.hf_loading import load_causal_lm

    target_dir, head_dir, export_dir = heads[name]
    export = _open(export_dir)
    target_lm = load_causal_lm(target_dir)
    head = load_eagle_head(head_dir, target_lm)
    layers = export.manifest.models["target"].extra.get("feature_layers", ())
    for committed, proposal, drafter in _steps(export, PROMPTS[1], {"mode": mode}, 3):
        feats = _torch_features(target_lm, head, committed, layers)
        tree, toks = proposal.tree, proposal.tokens
        assert tree.size > 1
        for node in range(1, tree.size):
            path = [int(toks[i]) for i in tree.path_to(node)[1:]]
            assert path[-1] in _torch_topk(head, committed, feats, path[:-1], drafter.head.top_k), (node, path)


# ---------------------------------------------------------------- dynamic tree shape


@pytest.mark.parametrize("top_k,depth,total", [(4, 5, 16), (2, 6, 11), (3, 3, 3), (4, 2, 20), (1, 4, 4)])
def test_dynamic_tree_has_exactly_total_tokens(heads, top_k, depth, total):
    from specdeploy.runtime.tree import Tree

    export = _open(heads["trained"][2])
    overrides = {"mode": "eagle2", "top_k": top_k, "depth": depth, "total_tokens": total}
    for _, p, _ in _steps(export, PROMPTS[0], overrides, 8):
        assert p.tree.size == total + 1
        assert int(p.tree.depth.max()) <= depth
        Tree(p.tree.parents)  # parents precede children, one root
        for kids in p.tree.children:
            assert len(kids) <= top_k
            assert len({int(p.tokens[c]) for c in kids}) == len(kids)  # distinct siblings: lossless sampling


def test_tune_tree_calibrates_a_static_eagle_tree(heads):
    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.tree import Tree
    from specdeploy.runtime.tree_tuning import tune

    export = _open(heads["trained"][2])
    prompts = [export.tokenizer.encode(p) for p in PROMPTS[:2]]
    result = tune(export, "eagle", prompts, max_new_tokens=NEW, max_nodes=16, progress=lambda m: None)
    assert 1 <= Tree.from_paths(result["paths"]).size - 1 <= 16
    report = result["report"]
    assert report["acceptance"]["trials"][0] >= len(prompts)
    # The recorded ranks replay the export's own tree: they predict what eagle1 really accepts.
    calls = sum(generate(export, ids, method="eagle", max_new_tokens=NEW, ignore_eos=True,
                         method_overrides={"mode": "eagle1"}).stats["target_calls"] for ids in prompts)
    real = len(prompts) * NEW / calls
    assert abs(report["export_tree"]["empirical_tokens_per_step"] - real) < 0.5, (report["export_tree"], real)


# ---------------------------------------------------------------- sampling


def _two_token_dist(export, ids, params) -> dict:
    """Exact joint distribution of the first two new tokens under the target."""
    dec = export.decoder("target")
    dec.reset()
    dec.prefill(ids[:-1], export.prefill_chunk)
    base = len(ids)
    out = dec.forward(np.array(ids[-1:]), np.array([base - 1]), np.ones((1, 1), bool))
    dec.commit(out, slice(0, 1))
    p1 = params.probs(out.logits[0])
    dist = {}
    for x1 in np.flatnonzero(p1):
        dec.cache.length = base
        p2 = params.probs(dec.forward(np.array([x1]), np.array([base]), np.ones((1, 1), bool)).logits[0])
        for x2 in np.flatnonzero(p2):
            dist[(int(x1), int(x2))] = p1[x1] * p2[x2]
    return dist


@pytest.mark.parametrize("mode", ["eagle2", "eagle1"])
def test_sampling_matches_target_distribution(heads, mode):
    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.sampling import SamplingParams

    export = _open(heads["trained"][2])
    ids = export.tokenizer.encode(PROMPTS[0])
    dist = _two_token_dist(export, ids, SamplingParams(temperature=1.0, top_k=8))
    runs, counts, accepted = SAMPLING_RUNS, {}, 0
    for seed in range(runs):
        r = generate(export, ids, method="eagle", params=SamplingParams(temperature=1.0, top_k=8, seed=seed),
                     max_new_tokens=2, ignore_eos=True, method_overrides={"mode": mode})
        key = tuple(r.token_ids)
        counts[key] = counts.get(key, 0) + 1
        accepted += r.stats["accepted_drafts"]
    assert accepted > runs // 3, "drafts are rarely accepted: the test would not exercise verification"
    assert set(counts) <= set(dist), "a sample fell outside the target's support"
    keys = sorted(dist)
    expected = np.array([dist[k] for k in keys]) * runs
    observed = np.array([counts.get(k, 0) for k in keys], float)
    rare = expected < 5  # pool rare cells so the chi-square approximation holds
    obs, exp = np.append(observed[~rare], observed[rare].sum()), np.append(expected[~rare], expected[rare].sum())
    keep = exp > 0
    assert chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue > 1e-3


# ---------------------------------------------------------------- bad inputs


def _error(fn) -> str:
    from specdeploy.runtime.errors import SpecDeployError

    with pytest.raises(SpecDeployError) as info:
        fn()
    return str(info.value)


def test_head_that_does_not_fit_the_target(micro_family, tmp_path):
    from safetensors.torch import load_file, save_file

    from specdeploy.export.eagle_heads import load_eagle_head
    from specdeploy.export.hf_loading import load_causal_lm

    target = load_causal_lm(micro_family / "target")
    good = _random_head(1, micro_family / "target", tmp_path / "good", "safetensors", seed=4)
    weights = load_file(str(good / "model.safetensors"))
    weights["fc.weight"] = torch.zeros(64, 100)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((good / "config.json").read_text())
    save_file(weights, str(bad / "model.safetensors"))
    msg = _error(lambda: load_eagle_head(bad, target))
    assert "fc.weight" in msg and "[64, 100]" in msg and "[64, 128]" in msg, msg

    wide = json.loads((good / "config.json").read_text())
    wide["hidden_size"] = 96
    (bad / "config.json").write_text(json.dumps(wide))
    assert "hidden_size 96" in _error(lambda: load_eagle_head(bad, target))

    (bad / "model.safetensors").unlink()
    assert "no EAGLE head weights" in _error(lambda: load_eagle_head(bad, target))
    save_file({"medusa.0.weight": torch.zeros(2, 2)}, str(bad / "model.safetensors"))
    assert "not an EAGLE head" in _error(lambda: load_eagle_head(bad, target))
    assert "not found" in _error(lambda: load_eagle_head(tmp_path / "nowhere", target))
    # EAGLE-3 reads three layers below the last; the micro target has two.
    deep_head = _random_head(3, ROOT / "target4", tmp_path / "h3", "safetensors", seed=6, draft_vocab=200)
    proc = run_cli("export", "--target", micro_family / "target", "--eagle", deep_head, "--out", tmp_path / "x")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: EAGLE-3"), proc.stderr
    # a missing head or one for another vocabulary: said before the target loads (6 s on SmolLM2)
    (bad / "config.json").write_text(json.dumps({**wide, "vocab_size": 7}))
    for head, said in ((tmp_path / "nowhere", "EAGLE head directory not found"), (bad, "vocab_size 7 does not match")):
        proc = run_cli("export", "--target", micro_family / "target", "--eagle", head, "--out", tmp_path / "x")
        assert proc.returncode == 2 and said in proc.stderr.strip().splitlines()[-1], proc.stderr
        assert "loading target" not in proc.stdout, proc.stdout


def test_runtime_errors(heads, micro_export):
    from specdeploy.runtime.generate import Generation

    ids = [5, 6, 7]
    no_head = _open(micro_export)
    assert "eagle" in _error(lambda: Generation(no_head, ids, method="eagle"))
    export = _open(heads["trained"][2])
    assert "top 6 candidates" in _error(
        lambda: Generation(export, ids, method="eagle", method_overrides={"mode": "eagle2", "top_k": 6}))
    assert "re-export" in _error(
        lambda: Generation(export, ids, method="eagle",
                           method_overrides={"mode": "eagle2", "top_k": 4, "total_tokens": 70}))
