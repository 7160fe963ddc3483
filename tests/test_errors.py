"""Bad inputs: one clear `error:` line naming the problem, non-zero exit, never a traceback."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import run_cli


def assert_clean_error(proc, *needles):
    assert proc.returncode != 0, proc.stdout
    err = proc.stderr.strip()
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    last = err.splitlines()[-1]
    assert last.startswith("error:"), err
    for needle in needles:
        assert needle in last, (needle, last)


@pytest.fixture()
def broken_copy(micro_export, tmp_path):
    dst = tmp_path / "export"
    shutil.copytree(micro_export, dst)
    return dst


def gen(export, *extra):
    return run_cli("generate", export, "--prompt", "def f():", "--max-new-tokens", "4", *extra)


def test_missing_graph_file(broken_copy):
    (broken_copy / "target_t1.onnx").unlink()
    assert_clean_error(gen(broken_copy), "missing", "target_t1.onnx")


def test_corrupt_graph_file_fails_checksum(broken_copy):
    (broken_copy / "target_t1.onnx").write_bytes(b"not an onnx graph")
    assert_clean_error(gen(broken_copy), "checksum mismatch", "target_t1.onnx")


def test_corrupt_graph_file_with_updated_checksum(broken_copy):
    """Even when the manifest was 'fixed' to match, a corrupt graph gives a clear load error (the
    manifest loader reads each graph's protobuf for its external-data files: it names the graph)."""
    from specdeploy.runtime.manifest import sha256_file

    for name in ("target_t1.onnx", "target_fused_t1.onnx"):  # whichever flavor the runtime opens
        graph = broken_copy / name
        graph.write_bytes(b"\x08\x07garbage")
        manifest = json.loads((broken_copy / "manifest.json").read_text())
        manifest["files"][name] = sha256_file(graph)
        (broken_copy / "manifest.json").write_text(json.dumps(manifest))
    assert_clean_error(gen(broken_copy), "is not a valid ONNX file", "_t1.onnx")


def test_corrupt_manifest(broken_copy):
    (broken_copy / "manifest.json").write_text("{ nope")
    assert_clean_error(gen(broken_copy), "not valid JSON")


def test_check_reports_a_wrong_path_or_manifest_before_loading_torch(broken_copy, tmp_path):
    """`specdeploy check` on a path that is not an export, or an export whose manifest is broken:
    one clear line, exit 2, before the graph check's reference (torch) is imported."""
    import subprocess
    import sys

    (broken_copy / "manifest.json").write_text("{ nope")
    code = ("import sys\nfrom specdeploy.cli import main\n"
            "rc = main(['check', sys.argv[1]])\n"
            "print('rc', rc, 'torch' in sys.modules)\nsys.exit(rc)\n")
    for path, needle in ((tmp_path / "no-such-export", "nothing to check"), (tmp_path, "manifest"),
                         (broken_copy, "not valid JSON")):
        proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
        assert proc.stdout.strip() == "rc 2 False", (path, proc.stdout, proc.stderr)
        assert_clean_error(proc, needle)


def test_check_refuses_a_bad_task_text_before_the_graph_checks(micro_export, tmp_path):
    """--task-text was read after the graph checks (15 s): a missing file or a directory was an internal
    error then, /dev/urandom was read without end. One clear line, exit 2, before torch is imported."""
    import os
    import subprocess
    import sys

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    code = ("import sys\nfrom specdeploy.cli import main\n"
            "rc = main(['check', sys.argv[1], '--task', '--task-text', sys.argv[2]])\n"
            "print('rc', rc, 'torch' in sys.modules)\nsys.exit(rc)\n")
    for path, needle in ((tmp_path / "missing.txt", "no such file"), (tmp_path, "is a directory"),
                         (tmp_path / "fifo", "not a regular file"), ("/dev/urandom", "not a regular file"),
                         (tmp_path / "latin1.txt", "not UTF-8 text")):
        proc = subprocess.run([sys.executable, "-c", code, str(micro_export), str(path)], capture_output=True,
                              text=True, timeout=120)
        assert proc.stdout.strip() == "rc 2 False", (path, proc.stdout, proc.stderr)
        assert_clean_error(proc, f"--task-text {path}", needle)


def test_weights_checksum_mismatch(broken_copy):
    weights = broken_copy / "weights" / "target.bin"
    data = bytearray(weights.read_bytes())
    data[100] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert_clean_error(gen(broken_copy), "checksum mismatch", "target.bin")


def test_vocab_mismatch_between_draft_and_target(micro_family, tmp_path):
    from specdeploy.train.family import make_random_model

    other_tok = tmp_path / "tok"
    shutil.copytree(micro_family / "tokenizer", other_tok)
    vocab_file = other_tok / "tokenizer.json"
    tok = json.loads(vocab_file.read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    vocab_file.write_text(json.dumps(tok))
    draft = make_random_model("llama", tmp_path / "draft", other_tok)
    proc = run_cli("export", "--target", micro_family / "target", "--draft", draft, "--out", tmp_path / "out")
    assert_clean_error(proc, "vocabulary mismatch")


def test_vocab_size_mismatch(micro_family, tmp_path):
    """Sizes may differ by padding only: with the same tokenizer both sides (tests/test_draft_vocab_padding.py);
    a draft without one, or smaller than the ids its tokenizer names, is refused."""
    draft = tmp_path / "draft"
    shutil.copytree(micro_family / "draft", draft,
                    ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
    cfg = json.loads((draft / "config.json").read_text())
    cfg["vocab_size"] += 8
    (draft / "config.json").write_text(json.dumps(cfg))
    proc = run_cli("export", "--target", micro_family / "target", "--draft", draft, "--out", tmp_path / "out")
    assert_clean_error(proc, "vocabulary mismatch", "vocab_size", "same tokenizer.json")
    shutil.copy(micro_family / "target" / "tokenizer.json", draft)
    cfg["vocab_size"] -= 16  # fewer rows than the tokenizer's ids
    (draft / "config.json").write_text(json.dumps(cfg))
    proc = run_cli("export", "--target", micro_family / "target", "--draft", draft, "--out", tmp_path / "out")
    assert_clean_error(proc, "vocabulary mismatch", "names ids up to")


def test_corrupt_weights_at_export(micro_family, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(micro_family / "target", target)
    (target / "model.safetensors").write_bytes(b"\x00" * 64)
    proc = run_cli("export", "--target", target, "--out", tmp_path / "out")
    assert_clean_error(proc, "could not load model")


def test_not_a_model_dir(tmp_path):
    proc = run_cli("export", "--target", tmp_path, "--out", tmp_path / "out")
    assert_clean_error(proc, "config.json")


def test_unsupported_architecture(micro_family, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(micro_family / "target", target)
    cfg = json.loads((target / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (target / "config.json").write_text(json.dumps(cfg))
    assert_clean_error(run_cli("export", "--target", target, "--out", tmp_path / "o"), "not supported", "gpt2")


def test_bad_export_config(micro_family, tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("methods:\n  draft:\n    k: 0\n")
    proc = run_cli("export", "--target", micro_family / "target", "--draft", micro_family / "draft",
                   "--out", tmp_path / "o", "--config", cfg)
    assert_clean_error(proc, "draft.k")
    cfg.write_text("max_context: 100000\n")
    proc = run_cli("export", "--target", micro_family / "target", "--out", tmp_path / "o", "--config", cfg)
    assert_clean_error(proc, "max_position_embeddings")


def test_prompt_longer_than_context(micro_export):
    ids = ",".join(["5"] * 600)
    assert_clean_error(run_cli("generate", micro_export, "--prompt-ids", ids), "max context")


@pytest.mark.parametrize("flags,needle", [
    (["--temperature", "-1"], "temperature"),
    (["--temperature", "nan"], "temperature"),
    (["--top-p", "-0.5"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["--top-k", "-2"], "top_k"),
    (["--max-new-tokens", "0"], "max_new_tokens"),
    (["--seed", "-3"], "seed"),
    (["--method", "telepathy"], "unknown method"),
    (["--backend", "trt"], "backend"),
])
def test_invalid_generation_values(micro_export, flags, needle):
    assert_clean_error(gen(micro_export, *flags), needle)


def test_bad_prompt_ids(micro_export):
    assert_clean_error(run_cli("generate", micro_export, "--prompt-ids", "1,x"), "prompt-ids")
    assert_clean_error(run_cli("generate", micro_export, "--prompt-ids", "1,999999"), "out of range")


def test_method_not_exported(micro_family, tmp_path):
    out = tmp_path / "target_only"
    proc = run_cli("export", "--target", micro_family / "target", "--out", out, "--no-check")
    assert proc.returncode == 0, proc.stderr
    assert_clean_error(gen(out, "--method", "draft"), "draft")


def test_check_fails_on_tampered_reference(broken_copy):
    from polygraphy.comparator import RunResults

    ref = broken_copy / "check" / "target_t1.outputs.json"
    results = RunResults.load(str(ref))
    for _, iters in results:
        iters[0]["logits"] = iters[0]["logits"] + 1.0
    results.save(str(ref))
    proc = run_cli("check", broken_copy)
    assert proc.returncode != 0
    assert "FAIL target_t1" in proc.stdout


@pytest.mark.parametrize("flags, option", [
    (["--prompt", "\udcff\udcfe bad"], "--prompt"),  # the bytes ff fe, as Python's argv holds them
    (["--chat", "hi \udcff"], "--chat"),
    (["--chat", "hi", "--system", "\udcc3"], "--system"),
    (["--prompt", "x", "--stop", "ok", "--stop", "\udced\udca0\udc80"], "--stop"),  # a UTF-8-encoded surrogate
])
def test_text_that_is_not_utf8(micro_export, flags, option):
    proc = run_cli("generate", micro_export, *flags, "--max-new-tokens", "4")
    assert proc.returncode == 2
    assert_clean_error(proc, f"{option} is not valid UTF-8 text", "byte 0x")


@pytest.mark.parametrize("graphs", ["fused", "portable"])
def test_manifest_that_disagrees_with_its_graphs(broken_copy, graphs):
    """A manifest edited (or mixed up) after export is named when its graphs open, not by ONNX Runtime."""
    manifest_path = broken_copy / "manifest.json"
    original = json.loads(manifest_path.read_text())
    layers = original["models"]["target"]["num_layers"]
    vocab = original["models"]["target"]["vocab_size"]
    flavor = "fused_" if graphs == "fused" else ""
    for key, value, prompt, needles in [
        ("num_layers", 1, "1,2", [f"target_{flavor}t1.onnx expects {layers} layers' KV", "manifest says 1"]),
        # an id the manifest's vocabulary has and the graph does not: refused at load, not scored
        ("vocab_size", vocab + 100, f"1,{vocab + 50}",
         [f"target_{flavor}t1.onnx scores {vocab} tokens", f"has {vocab + 100}"]),
        # ONNX Runtime said "Got invalid dimensions for input: past_key.0" (an internal error, exit 1)
        ("num_kv_heads", 1, "1,2", [f"target_{flavor}t1.onnx's KV input past_key.0 has shape", "1 KV heads"]),
        ("head_dim", 8, "1,2", ["KV input past_key.0 has shape", "of size 8"]),
        ("dtype", "float16", "1,2", ["KV input past_key.0 is tensor(float)", "export is float16"]),
    ]:
        edited = json.loads(json.dumps(original))
        (edited if key == "dtype" else edited["models"]["target"])[key] = value
        manifest_path.write_text(json.dumps(edited))
        proc = run_cli("generate", broken_copy, "--graphs", graphs, "--prompt-ids", prompt,
                       "--max-new-tokens", "4")
        assert proc.returncode == 2
        assert_clean_error(proc, *needles, "re-export")


def test_json_nested_too_deeply_is_not_valid_json(broken_copy, micro_export, tmp_path):
    """'[' * 100000 (past the parser's recursion limit) as manifest.json or tune-tree's --prompts file was an
    internal error (RecursionError); now a user error, exit 2."""
    deep = "[" * 100000 + "]" * 100000
    (broken_copy / "manifest.json").write_text(deep)
    proc = gen(broken_copy)
    assert_clean_error(proc, "manifest.json is not valid JSON: nested too deeply")
    assert proc.returncode == 2
    for name in ("deep.json", "deep.jsonl"):
        (tmp_path / name).write_text(deep + "\n")
        proc = run_cli("tune-tree", micro_export, "--prompts", tmp_path / name, "--out", tmp_path / "tree.json")
        assert_clean_error(proc, f"prompts file {tmp_path / name} is not valid JSON/JSONL: nested too deeply")
        assert proc.returncode == 2 and not (tmp_path / "tree.json").exists()


@pytest.mark.parametrize("name", ["generation_config.json", "config.json", "tokenizer_config.json"])
def test_a_model_dir_json_that_is_not_json_fails_the_export_at_once(micro_family, tmp_path, name):
    """generation_config.json was read only when the manifest was written, after every graph (an internal
    error then); any model-dir JSON nested past the parser's limit was a RecursionError."""
    target = tmp_path / "target"
    shutil.copytree(micro_family / "target", target)
    for text in ("{not json", "[" * 100000 + "]" * 100000):
        (target / name).write_text(text)
        proc = run_cli("export", "--target", target, "--draft", target, "--out", tmp_path / "out", timeout=60)
        assert_clean_error(proc, f"{name} is not valid JSON")
        assert proc.returncode == 2 and not (tmp_path / "out").exists()


def test_a_tokenizer_the_runtime_would_refuse_fails_the_export_at_once(micro_family, tmp_path):
    """A corrupt tokenizer.json, or one naming tokens past the model's embedding rows, was published as a
    checked export that every `generate` then refused."""
    target = tmp_path / "target"
    shutil.copytree(micro_family / "target", target)
    tokenizer = target / "tokenizer.json"
    good = tokenizer.read_text()
    tokenizer.write_text('{"model":')
    proc = run_cli("export", "--target", target, "--out", tmp_path / "out", timeout=60)
    assert_clean_error(proc, "tokenizer.json is corrupt")
    assert proc.returncode == 2 and not (tmp_path / "out").exists()
    tokenizer.write_text(good)
    cfg = json.loads((target / "config.json").read_text())
    cfg["vocab_size"] = 64  # fewer embedding rows than the tokenizer's tokens
    (target / "config.json").write_text(json.dumps(cfg))
    proc = run_cli("export", "--target", target, "--out", tmp_path / "out", timeout=60)
    assert_clean_error(proc, "vocabulary mismatch", "vocab_size is 64", "resize_token_embeddings")
    assert proc.returncode == 2 and not (tmp_path / "out").exists()
