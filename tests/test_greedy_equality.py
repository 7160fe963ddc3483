"""ar, draft and prompt-lookup greedy output is token-identical to Hugging Face greedy,
on the fused ORT-CPU graphs (the default) and on the portable ones."""

from __future__ import annotations

import pytest
from conftest import hf_greedy

PROMPTS = [
    "def foo(x):\n    return",
    "import os\nimport sys\n\n\nclass Config",
    "for i in range(10):\n    if i %",
    "    def __init__(self, name, value=None):\n        self.",
    "x = [1, 2, 3]\ny = {",
    "# Copyright\n\"\"\"Module docstring.\"\"\"\n",
    "try:\n    import",
    "with open(path) as f:\n    data = f.read()\n",
    "raise ValueError(",
    "\n",
    "assert isinstance(",
    "return self._",
]
NEW = 40


@pytest.fixture(scope="module")
def micro(micro_export):
    from specdeploy.runtime.loaded_export import LoadedExport

    return LoadedExport(micro_export)


@pytest.fixture(scope="module")
def micro_portable(micro_export):
    from specdeploy.runtime.loaded_export import LoadedExport

    return LoadedExport(micro_export, flavor="portable")


def _openai_penalties(frequency: float, presence: float, prompt_len: int):
    """OpenAI's frequency and presence penalties as an HF logits processor (transformers has none):
    over the output tokens so far, not the prompt's."""
    import torch
    from transformers import LogitsProcessor

    class Penalize(LogitsProcessor):
        def __call__(self, input_ids, scores):
            out = input_ids[0, prompt_len:]
            if len(out):
                ids, counts = torch.unique(out, return_counts=True)
                scores[0, ids] -= frequency * counts.to(scores.dtype) + presence
            return scores

    return Penalize()


@pytest.mark.parametrize("method", ["ar", "draft", "prompt-lookup", "lookahead"])
def test_penalties_match_hf(micro, micro_family, method):
    """Repetition (HF's own processor) and frequency / presence penalties (OpenAI's) choose each token as
    HF's greedy decoding with them does, whichever method drafts; and they change the output."""
    from transformers import LogitsProcessorList

    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.penalties import Penalties

    changed = 0
    for prompt in PROMPTS[:6]:
        ids = micro.tokenizer.encode(prompt)
        plain = generate(micro, ids, method="ar", max_new_tokens=NEW, ignore_eos=True).token_ids
        rep = generate(micro, ids, method=method, max_new_tokens=NEW, ignore_eos=True, penalties=Penalties(1.3))
        assert rep.token_ids == hf_greedy(micro_family / "target", ids, NEW, repetition_penalty=1.3), prompt
        freq = generate(micro, ids, method=method, max_new_tokens=NEW, ignore_eos=True,
                        penalties=Penalties(frequency=0.7, presence=0.4))
        processors = LogitsProcessorList([_openai_penalties(0.7, 0.4, len(ids))])
        assert freq.token_ids == hf_greedy(micro_family / "target", ids, NEW, logits_processor=processors), prompt
        changed += (rep.token_ids != plain) + (freq.token_ids != plain)
    assert changed >= 6  # the micro family loops: penalties must move it


@pytest.mark.parametrize("graphs", ["fused", "portable"])
@pytest.mark.parametrize("method", ["ar", "draft", "prompt-lookup"])
def test_micro_family_matches_hf_greedy(micro, micro_portable, micro_family, method, graphs):
    from specdeploy.runtime.generate import generate

    micro = micro if graphs == "fused" else micro_portable
    assert micro.decoder("target").fused == (graphs == "fused")

    mismatches = []
    for prompt in PROMPTS:
        ids = micro.tokenizer.encode(prompt)
        ours = generate(micro, ids, method=method, max_new_tokens=NEW, ignore_eos=True)
        ref = hf_greedy(micro_family / "target", ids, NEW)
        if ours.token_ids != ref:
            mismatches.append(prompt)
        if method != "ar":
            assert ours.stats["target_calls"] <= NEW
    assert not mismatches, f"{method} differs from HF greedy on {mismatches}"


@pytest.mark.parametrize("graphs", ["fused", "portable"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "mistral"])
@pytest.mark.parametrize("method", ["ar", "draft"])
def test_other_architectures_match_hf_greedy(arch_exports, random_models, arch, method, graphs):
    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.loaded_export import LoadedExport

    export = LoadedExport(arch_exports[arch], flavor=graphs)
    for prompt in PROMPTS[:4]:
        ids = export.tokenizer.encode(prompt)
        ours = generate(export, ids, method=method, max_new_tokens=24, ignore_eos=True)
        assert ours.token_ids == hf_greedy(random_models[arch][0], ids, 24), (arch, method, prompt)


def test_long_generation_crosses_prefill_chunks_and_stops_at_context(micro, micro_family):
    """A prompt longer than one prefill chunk, generating up to the context end."""
    from specdeploy.runtime.generate import generate

    ids = micro.tokenizer.encode("\n".join(PROMPTS))
    assert len(ids) > micro.prefill_chunk
    ref = hf_greedy(micro_family / "target", ids, 64)
    for method in ("ar", "draft"):
        assert generate(micro, ids, method=method, max_new_tokens=64, ignore_eos=True).token_ids == ref
    room = micro.manifest.max_context - len(ids)
    full = generate(micro, ids, method="draft", max_new_tokens=10_000, ignore_eos=True)
    assert full.finish_reason == "length"
    assert len(full.token_ids) == room


def test_eos_stops_generation(micro):
    from specdeploy.runtime.generate import generate

    eos = next(iter(micro.eos_token_ids))
    ids = micro.tokenizer.encode(PROMPTS[0])
    free = generate(micro, ids, method="draft", max_new_tokens=200)
    if eos in free.token_ids:
        assert free.token_ids[-1] == eos and free.finish_reason == "stop"
    else:
        assert len(free.token_ids) == 200


def test_stop_strings_cut_text(micro):
    from specdeploy.runtime.generate import Generation

    ids = micro.tokenizer.encode(PROMPTS[3])
    full = Generation(micro, ids, method="draft", max_new_tokens=60, ignore_eos=True).result().text
    stop = full.strip()[3:6]
    assert stop and stop in full
    gen = Generation(micro, ids, method="draft", max_new_tokens=60, ignore_eos=True, stop=[stop])
    streamed = "".join(e.text for e in gen)
    assert gen.finish_reason == "stop"
    assert streamed == full[: full.index(stop)]


def test_stop_strings_hold_back_only_what_could_begin_one(micro):
    """Streaming with stop strings delays only text that could still become one: a stop string that cannot
    be forming leaves each event with its own token's text, and a partial match holds back exactly its
    characters (the longest of several stops' partial matches, a self-overlapping stop's included)."""
    from specdeploy.runtime.generate import Generation

    ids = micro.tokenizer.encode(PROMPTS[3])

    def events(stop):
        return [e.text for e in Generation(micro, ids, method="ar", max_new_tokens=40, ignore_eos=True, stop=stop)]

    def expected(stops):
        """Each event's text when the shown text stops short of its longest suffix that begins a stop."""
        out, text, shown = [], "", 0
        for i, delta in enumerate(plain):
            text += delta
            held = max(max((n for n in range(1, len(s)) if text[shown:].endswith(s[:n])), default=0) for s in stops)
            end = len(text) if i == len(plain) - 1 else len(text) - held  # the last event shows everything
            out.append(text[shown:end])
            shown = end
        return out

    plain = events(None)
    assert events(["\x00" * 200, "\x01"]) == plain  # no text can begin either
    full = "".join(plain)
    piece = full.strip()[3:6]
    assert len(piece) == 3 and piece in full
    for stops in ([piece + "\x00"],  # its first characters match where piece occurs, the whole never does
                  [piece[:2] + "\x00", piece + "\x01"],  # two stops, partial matches of different lengths
                  [piece + piece[0] + piece + "\x00"]):  # a stop that overlaps itself
        held = events(stops)
        assert held == expected(stops) and "".join(held) == full, stops
        assert held != plain  # something was held back, and shown with a later token


def test_streamed_text_equals_full_decode(micro):
    """The incremental detokenizer's deltas add up to decoding every new token at once."""
    from specdeploy.runtime.generate import Generation
    from specdeploy.runtime.sampling import SamplingParams
    from specdeploy.runtime.tokenizer import IncrementalDecoder

    for prompt in ("s = 'héllo wörld ✓ ", *PROMPTS[:3]):
        gen = Generation(micro, micro.tokenizer.encode(prompt), method="draft", max_new_tokens=48, ignore_eos=True,
                         params=SamplingParams(1.0, seed=3))
        streamed = "".join(e.text for e in gen)
        assert streamed == gen.text == micro.tokenizer.decode(gen.new_ids)
    # Multi-byte characters split across byte-level tokens come out whole.
    ids = micro.tokenizer.encode("αβγ ✓ 日本語")
    detok = IncrementalDecoder(micro.tokenizer)
    pieces = [detok.push(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == micro.tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


@pytest.fixture(scope="module")
def odd_models(micro_family, tmp_path_factory) -> dict:
    """Llama-family configurations whose fused graphs were refused or could not run."""
    from specdeploy.train.family import make_random_model

    root, tok = tmp_path_factory.mktemp("odd_models"), micro_family / "tokenizer"
    return {
        # open_llama_3b's 3200 / 32 = 100 is the same case: ONNX Runtime's CPU attention refuses it
        "head_dim_24": make_random_model("llama", root / "hd24", tok, seed=3, overrides={"hidden_size": 96,
                                                                                         "head_dim": 24}),
        "swish": make_random_model("llama", root / "swish", tok, seed=4, overrides={"hidden_act": "swish"}),
        "short_context": make_random_model("qwen2", root / "short", tok, seed=5,
                                           overrides={"max_position_embeddings": 96}),
        # transformers rotates a call reaching past 64 positions with the long factors, all its positions
        "longrope": make_random_model("llama", root / "longrope", tok, seed=6, overrides={
            "original_max_position_embeddings": 64, "rope_scaling": {
                "rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [2.0 + 1.5 * i for i in range(8)]}}),
        # transformers rescales every position of a call reaching past 96 (dynamic NTK)
        "dynamic": make_random_model("llama", root / "dynamic", tok, seed=7, overrides={
            "max_position_embeddings": 96, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    }


def test_a_head_size_the_fused_graphs_cannot_take_exports_portable_graphs(odd_models, tmp_path):
    """The export used to fail its check on fused graphs ONNX Runtime cannot run (and with --no-check
    published graphs that crashed generate): now it writes the portable graphs only, says why, passes its
    check, and decodes like Hugging Face."""
    import json

    from conftest import run_cli

    model, out = odd_models["head_dim_24"], tmp_path / "hd24"
    proc = run_cli("export", "--target", model, "--draft", model, "--out", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "target: no fused graphs for head_dim 24" in proc.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["check"] == "passed"
    assert all(g.get("flavor", "portable") == "portable" for g in manifest["graphs"].values())
    ids = [5, 6, 7, 8, 9]
    for method in ("ar", "draft", "prompt-lookup"):
        gen = run_cli("generate", out, "--method", method, "--prompt-ids", ",".join(map(str, ids)),
                      "--max-new-tokens", "16", "--ignore-eos", "--json")
        assert gen.returncode == 0, gen.stderr
        assert json.loads(gen.stdout.splitlines()[-1])["token_ids"] == hf_greedy(model, ids, 16), method
    # its batched graph is a fused one too: serving batched says so (it advised re-adding a graph it cannot build)
    serve = run_cli("serve", out, "--batch", "2", "--port", "0")
    assert serve.returncode == 2 and "has no fused target graphs" in serve.stderr and "without --batch" in serve.stderr
    # quantized weights rewrite fused graphs: refused before anything is written
    proc = run_cli("export", "--target", model, "--out", tmp_path / "q", "--weights", "int8")
    assert proc.returncode == 2 and "head_dim 24" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "q").exists()


def test_swish_is_silu_for_the_fused_graphs(odd_models, tmp_path):
    from specdeploy.export.exporter import export_all
    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.loaded_export import LoadedExport

    model = odd_models["swish"]
    export = LoadedExport(export_all(model, tmp_path / "swish", progress=lambda msg: None))
    assert export.decoder("target").fused
    ids = [5, 6, 7, 8, 9]
    assert generate(export, ids, method="ar", max_new_tokens=16, ignore_eos=True).token_ids == hf_greedy(model, ids, 16)


def test_a_model_shorter_than_the_default_context_exports_at_its_own(odd_models, tmp_path):
    """ExportConfig's max_context 512 used to refuse it ("exceeds max_position_embeddings") with no hint."""
    from specdeploy.export.exporter import export_all
    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.loaded_export import LoadedExport

    model, said = odd_models["short_context"], []
    export = LoadedExport(export_all(model, tmp_path / "short", progress=said.append))
    assert export.manifest.max_context == 96 and any("max_context 96" in line for line in said)
    ids = list(range(5, 45))
    ours = generate(export, ids, method="prompt-lookup", max_new_tokens=200, ignore_eos=True)
    assert ours.finish_reason == "length" and len(ids) + len(ours.token_ids) <= 96
    assert ours.token_ids[:24] == hf_greedy(model, ids, 24)


def test_dynamic_rope_at_its_whole_context_matches_hf_batched_too(odd_models, tmp_path):
    """The batched graph's RoPE table reaches a scratch row past the context: built in one call, transformers'
    dynamic NTK rescaled every position of it, and the export failed its own check (2.8e-1 > 4.9e-4)."""
    import json

    from conftest import run_cli

    from specdeploy.runtime.service import Service

    model, out = odd_models["dynamic"], tmp_path / "dynamic"
    proc = run_cli("export", "--target", model, "--draft", model, "--out", out)  # with its accuracy check
    assert proc.returncode == 0, proc.stdout + proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["check"] == "passed" and manifest["max_context"] == 96  # the model's whole context
    assert any(g.get("flavor") == "fused_batched" for g in manifest["graphs"].values())
    ids = list(range(5, 25))
    svc = Service.load(out, batch=2)
    try:
        for method in ("ar", "draft"):
            got = svc.generate(prompt_ids=ids, method=method, temperature=0, max_new_tokens=30, ignore_eos=True)
            assert got.token_ids == hf_greedy(model, ids, 30), method
    finally:
        svc.close()


def test_longrope_exports_within_its_window_and_matches_hf(odd_models, tmp_path):
    """A fused table built in one call over all positions took the long factors everywhere (every token
    differed from transformers'); an export past the window is refused, since no table by position
    reproduces transformers there."""
    import json

    from conftest import run_cli

    model, out = odd_models["longrope"], tmp_path / "longrope"
    proc = run_cli("export", "--target", model, "--draft", model, "--out", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "max_context 64: the target's longrope original_max_position_embeddings" in proc.stdout
    assert json.loads((out / "manifest.json").read_text())["check"] == "passed"
    ids = list(range(5, 25))
    for graphs in ("fused", "portable"):
        gen = run_cli("generate", out, "--graphs", graphs, "--method", "draft", "--prompt-ids",
                      ",".join(map(str, ids)), "--max-new-tokens", "30", "--ignore-eos", "--json")
        assert gen.returncode == 0, gen.stderr
        assert json.loads(gen.stdout.splitlines()[-1])["token_ids"] == hf_greedy(model, ids, 30), graphs
    too_long = tmp_path / "long.yaml"
    too_long.write_text("max_context: 128\n")
    proc = run_cli("export", "--target", model, "--out", tmp_path / "x", "--config", too_long)
    assert proc.returncode == 2 and "original_max_position_embeddings 64" in proc.stderr
