"""The method registry and its typed configs (runtime/methods.py, runtime/config.py and each
drafter's config): the dataclass defaults are the shipped defaults, validation is one clear
error, unknown keys are rejected uniformly."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from specdeploy.runtime.config import MAX_CONFIG_BYTES, ExportConfig, load_export_config, to_dict, with_overrides
from specdeploy.runtime.drafters.medusa import MedusaConfig
from specdeploy.runtime.drafters.suffix import SuffixConfig
from specdeploy.runtime.errors import SpecDeployError
from specdeploy.runtime.methods import REGISTRY, build_drafter, known_methods, method_spec, validate_methods

# The measured, shipped defaults (what configs/default.yaml held before the dataclasses did).
SHIPPED = {
    "ar": {},
    "draft": {"k": 8},
    "prompt-lookup": {"k": 14, "max_ngram": 3, "min_ngram": 1},
    "lookahead": {"window": 1, "ngram": 3, "guesses": 1},
    "suffix": {"max_nodes": 14, "max_match": 8, "min_prob": 0.1, "cache_tokens": 32768},
    "eagle": {"mode": "eagle2", "top_k": 2, "depth": 6, "total_tokens": 8, "draft_vocab": 1024,
              "tree": "eagle1_mc_sim_7b_63"},
    "medusa": {"heads": 4, "tree": "medusa_cpu_8", "draft_vocab": 1024},
}
VERIFY_TOKENS = {"ar": 1, "draft": 9, "prompt-lookup": 15, "lookahead": 4, "suffix": 15, "eagle": 9, "medusa": 9}


def test_registry_lists_every_method_once():
    assert known_methods() == ["ar", "draft", "prompt-lookup", "lookahead", "suffix", "eagle", "medusa",
                               "eagle+suffix", "eagle+prompt-lookup", "medusa+suffix", "medusa+prompt-lookup",
                               "lookahead+suffix", "lookahead+prompt-lookup", "draft+suffix", "draft+prompt-lookup"]
    assert all(name == spec.config.method for name, spec in REGISTRY.items())
    assert {n: s.export_input for n, s in REGISTRY.items() if s.export_input} == {
        "draft": "draft", "eagle": "eagle", "medusa": "medusa", "eagle+suffix": "eagle",
        "eagle+prompt-lookup": "eagle", "medusa+suffix": "medusa", "medusa+prompt-lookup": "medusa",
        "draft+suffix": "draft", "draft+prompt-lookup": "draft"}
    assert {n for n, s in REGISTRY.items() if s.calibrate} == {"eagle", "medusa"}


@pytest.mark.parametrize("name", list(SHIPPED))
def test_defaults_are_the_shipped_values(name):
    config = method_spec(name).config()
    data = to_dict(config)
    assert {k: data[k] for k in SHIPPED[name]} == SHIPPED[name]
    assert config.verify_tokens == VERIFY_TOKENS[name]
    assert method_spec(name).parse(data) == config  # the manifest's form reads back to the same config


def test_export_defaults_and_overrides(tmp_path):
    assert ExportConfig() == ExportConfig(max_context=512, prefill_chunk=64)
    cfg, overrides = load_export_config()
    assert cfg == ExportConfig() and overrides == {}  # configs/default.yaml overrides nothing
    user = tmp_path / "user.yaml"
    user.write_text("max_context: 256\nmethods:\n  draft: {k: 4}\n  lookahead: {window: 5}\n")
    cfg, overrides = load_export_config(user)
    assert cfg == ExportConfig(256, 64)
    methods = validate_methods(overrides)
    assert methods["draft"].k == 4 and methods["lookahead"].verify_tokens == 2 * (5 + 1)
    user.write_text("prefill_chunk: 0\n")
    with pytest.raises(SpecDeployError, match=r"config: prefill_chunk must be an integer >= 1, got 0"):
        load_export_config(user)


def test_config_file_that_is_not_yaml_text_is_one_line(tmp_path):
    """A binary file given as --config, or broken YAML: one line, not a decode error or PyYAML's excerpt."""
    user = tmp_path / "user.yaml"
    user.write_bytes(b"\xa0\x01\x02 weights")
    with pytest.raises(SpecDeployError, match=r"is not a YAML text file \(not UTF-8\)"):
        load_export_config(user)
    user.write_text("max_context: [1\n")
    with pytest.raises(SpecDeployError, match=r"is not valid YAML at line 2, column 1: expected") as err:
        load_export_config(user)
    assert "\n" not in str(err.value)
    user.write_bytes(b"max_context: \x00\n")  # UTF-8, but PyYAML's reader refuses NUL: its message has no `problem`
    with pytest.raises(SpecDeployError, match=r"is not valid YAML: unacceptable character #x0000") as err:
        load_export_config(user)
    assert "\n" not in str(err.value)
    with open(user, "wb") as f:  # a weights file given by mistake: refused by its size, not read whole
        f.truncate(MAX_CONFIG_BYTES + 1)
    with pytest.raises(SpecDeployError, match=r"bytes, not a config file \(at most 1,048,576\)"):
        load_export_config(user)


@pytest.mark.parametrize("name,key", [(n, k) for n in SHIPPED for k in ("bogus", "tree_path")])
def test_unknown_key_is_rejected_by_every_method(name, key):
    with pytest.raises(SpecDeployError) as err:
        method_spec(name).parse({key: 1})
    assert f"config: unknown {name} keys ['{key}'] (known: " in str(err.value)


@pytest.mark.parametrize("name,params,needle", [
    ("draft", {"k": 0}, "config: draft.k must be an integer >= 1, got 0"),
    ("draft", {"k": True}, "draft.k must be an integer"),
    ("prompt-lookup", {"k": "4"}, "prompt-lookup.k must be an integer >= 1, got '4'"),
    ("prompt-lookup", {"max_ngram": 2, "min_ngram": 3}, "min_ngram (3) exceeds max_ngram (2)"),
    ("lookahead", {"ngram": 1}, "lookahead.ngram must be an integer >= 2, got 1"),
    ("eagle", {"mode": "eagle3"}, "eagle.mode must be one of eagle2, eagle1"),
    ("eagle", {"mode": "eagle1", "tree": None}, "eagle.mode eagle1 needs eagle.tree"),
    ("eagle", {"top_k": 65, "total_tokens": 8}, "eagle.top_k must be <= 64"),
    ("medusa", {"heads": 2, "tree": [[0], [0, 0], [0, 0, 0]]}, "deeper than the 2 levels"),
    ("medusa", {"top_k": 1}, "needs top_k >= 3, but medusa.top_k is 1"),
    ("medusa", {"draft_vocab": 2}, "medusa.draft_vocab 2 is smaller than top_k 3"),
])
def test_bad_value_is_one_clear_error(name, params, needle):
    with pytest.raises(SpecDeployError) as err:
        method_spec(name).parse(params)
    assert needle in str(err.value)


def test_prefill_chunk_must_be_below_the_context():
    assert ExportConfig(max_context=500, prefill_chunk=64).prefill_chunk == 64  # not a multiple: fine
    with pytest.raises(SpecDeployError, match="prefill_chunk 64 must be below max_context 64"):
        ExportConfig(max_context=64, prefill_chunk=64)


def test_a_context_set_alone_takes_a_prefill_chunk_that_fits(tmp_path):
    """The export's advice for a draft's sliding window of 64 is `max_context: 64`; with the default chunk of 64
    that config was refused next ("prefill_chunk 64 must be below max_context 64"). A chunk set too is kept."""
    from specdeploy.runtime.config import load_export_config

    config = tmp_path / "c.yaml"
    config.write_text("max_context: 64\n")
    assert load_export_config(config)[0] == ExportConfig(max_context=64, prefill_chunk=32)
    config.write_text("max_context: 1024\n")
    assert load_export_config(config)[0].prefill_chunk == ExportConfig.prefill_chunk
    config.write_text("max_context: 64\nprefill_chunk: 64\n")
    with pytest.raises(SpecDeployError, match="prefill_chunk 64 must be below max_context 64"):
        load_export_config(config)


@pytest.mark.parametrize("params,words", [
    ({"window": 0}, "lookahead.window must be an integer >= 1"),
    ({"ngram": 1}, "lookahead.ngram must be an integer >= 2"),
    ({"guesses": "4"}, "lookahead.guesses must be an integer >= 1"),
    ({"window": 2.5}, "lookahead.window"),
    ({"windows": 4}, "unknown lookahead keys ['windows']"),
])
def test_bad_lookahead_config(params, words):
    with pytest.raises(SpecDeployError) as err:
        validate_methods({"lookahead": params})
    assert words in str(err.value)


@pytest.mark.parametrize("params,words", [
    ({"k": 0}, "prompt-lookup.k must be an integer >= 1"),
    ({"max_ngram": 2, "min_ngram": 3}, "min_ngram (3) exceeds max_ngram (2)"),
    ({"max_n": 2}, "unknown prompt-lookup keys ['max_n']"),
])
def test_bad_prompt_lookup_config(params, words):
    with pytest.raises(SpecDeployError) as err:
        validate_methods({"prompt-lookup": params})
    assert words in str(err.value)


def test_suffix_config_is_validated_like_the_others():
    spec = method_spec("suffix")
    config = spec.config()
    assert config == SuffixConfig() and config.verify_tokens == 15 and config.depth == 22
    assert spec.parse({"max_nodes": 7}).verify_tokens == 8
    for params, needle in [({"max_nodes": 0}, "suffix.max_nodes must be an integer >= 1, got 0"),
                           ({"max_match": "8"}, "suffix.max_match must be an integer >= 1, got '8'"),
                           ({"cache_tokens": -1}, "suffix.cache_tokens must be an integer >= 0, got -1"),
                           ({"min_prob": 2}, "suffix.min_prob must be a number in [0, 1], got 2"),
                           ({"min_prob": True}, "suffix.min_prob must be a number in [0, 1], got True"),
                           ({"tree": 1}, "config: unknown suffix keys ['tree'] (known: max_nodes, max_match")]:
        with pytest.raises(SpecDeployError) as err:
            spec.parse(params)
        assert needle in str(err.value)


@pytest.mark.parametrize("params,needle", [
    ({"mode": "eagle3"}, "eagle.mode"),
    ({"top_k": 0}, "eagle.top_k"),
    ({"depth": "5"}, "eagle.depth"),
    ({"top_k": 2, "depth": 2, "total_tokens": 7}, "total_tokens 7 exceeds"),
    ({"mode": "eagle1", "tree": None}, "needs eagle.tree"),
    ({"tree": "no_such_tree"}, "eagle.tree 'no_such_tree' is neither a tree file nor a known name"),
    ({"tree": [[0], [0, 0, 0]]}, "not prefix-closed"),
    ({"topk": 4}, "unknown eagle keys ['topk']"),
    ({"draft_vocab": -5}, "eagle.draft_vocab"),
])
def test_bad_eagle_config(params, needle):
    base = {"mode": "eagle2", "top_k": 4, "depth": 5, "total_tokens": 16, "tree": "eagle1_mc_sim_7b_63"}
    with pytest.raises(SpecDeployError) as err:
        method_spec("eagle").parse({**base, **params})
    assert needle in str(err.value)


@pytest.mark.parametrize("tree,needle", [
    ([[0], [0, 0], [1, 0]], "not prefix-closed"),
    ([[0], [0]], "listed twice"),
    ([[0], [-1]], "rank outside"),
    ([[0], [0, 0], [0, 0, 0]], "deeper than the 2 levels"),
    ("no_such_tree", "neither a tree file nor a known name"),
    ([], "non-empty list"),
])
def test_malformed_medusa_tree_is_one_clear_error(tree, needle):
    with pytest.raises(SpecDeployError) as err:
        MedusaConfig(heads=2, tree=tree)
    assert needle in str(err.value)


def test_unknown_method():
    with pytest.raises(SpecDeployError, match="unknown method 'telepathy' \\(choose from ar, draft, "):
        validate_methods({"telepathy": {}})


def test_verify_tokens_follow_the_config():
    assert method_spec("draft").parse({"k": 3}).verify_tokens == 4
    assert method_spec("prompt-lookup").parse({"k": 5}).verify_tokens == 6
    assert method_spec("lookahead").parse({"window": 4, "ngram": 3, "guesses": 1}).verify_tokens == 2 * 5
    eagle = method_spec("eagle").parse({"total_tokens": 5})
    assert eagle.verify_tokens == 6
    assert with_overrides(eagle, {"mode": "eagle1", "tree": [[0], [1], [0, 0]]}, "eagle").verify_tokens == 4
    assert method_spec("medusa").parse({"tree": [[0], [1], [0, 0], [0, 1]]}).verify_tokens == 5


def test_trees_resolve_once_and_travel_in_the_manifest():
    medusa = method_spec("medusa").parse({"tree": [[0], [2], [0, 0]]})
    assert medusa.top_k == 3 and medusa.tree == ((0,), (2,), (0, 0))  # frozen: inline paths become tuples
    data = to_dict(medusa)
    assert data["tree"] == [[0], [2], [0, 0]] and data["tree_paths"] == {"name": "inline", "paths": data["tree"]}
    json.dumps(data)
    # A named tree is read from the manifest's resolved copy, not from configs/trees/.
    named = {**to_dict(method_spec("medusa").config()), "tree": "gone", "tree_paths": {"name": "gone",
                                                                                   "paths": [[0], [1]]}}
    assert method_spec("medusa").parse(named).verify_tokens == 3
    # An override naming another tree resolves it again.
    assert with_overrides(method_spec("medusa").parse(named), {"tree": "medusa_cpu_8"}, "medusa").verify_tokens == 9


def test_build_drafter_refuses_a_config_bigger_than_the_export():
    class Target:
        sizes = (1, 15)

    class Export:
        def decoder(self, model):
            return Target()

    with pytest.raises(SpecDeployError) as err:
        build_drafter(Export(), method_spec("draft").parse({"k": 20}))
    assert str(err.value) == ("method 'draft' with k=20, draft_vocab=0, stop_below=0.6, runner_up=0.1 needs a target "
                              "graph of 21 tokens; this export's largest is 15 (re-export with this config)")
    inline = method_spec("medusa").parse({"tree": [[r] for r in range(20)]})
    with pytest.raises(SpecDeployError, match=r"tree=<20 inline entries>, top_k=20, draft_vocab=1024 needs"):
        build_drafter(Export(), inline)


def test_generate_help_lists_the_registry():
    proc = run_cli("generate", "--help")
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "ar | draft | prompt-lookup | lookahead | suffix | eagle | medusa" in text
    assert "lookahead: window, ngram, guesses" in text
