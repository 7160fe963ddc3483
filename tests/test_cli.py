"""The command line end to end: export, check, generate --json."""

from __future__ import annotations

import json
import re

import pytest
from conftest import run_cli


@pytest.mark.parametrize("method", ["ar", "draft", "prompt-lookup", "lookahead"])
def test_generate_json_last_line(micro_export, method):
    """Every method's stats serialize (tree methods move KV rows: their byte counts included)."""
    prompt = "def f(x):\n    return x\n\n\ndef f(x):\n    return"
    proc = run_cli("generate", micro_export, "--method", method, "--prompt", prompt, "--max-new-tokens", "12",
                   "--ignore-eos", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["token_ids"]) == 12
    for key in ("new_tokens", "target_calls", "acceptance_length", "tokens_per_s"):
        assert key in result["stats"]
    assert result["stats"]["new_tokens"] == 12
    assert result["stats"]["acceptance_length"] == 12 / result["stats"]["target_calls"]


def test_generate_runs_the_exports_recommended_method_by_default(micro_export):
    """No --method: `auto`, the export's recommended method (draft+prompt-lookup with a draft model), whose greedy
    tokens are ar's."""
    args = ("--prompt", "def f(x):\n    return x\n\n\ndef f(x):", "--max-new-tokens", "16", "--ignore-eos", "--json")
    auto = json.loads(run_cli("generate", micro_export, *args).stdout.splitlines()[-1])
    ar = json.loads(run_cli("generate", micro_export, "--method", "ar", *args).stdout.splitlines()[-1])
    assert auto["stats"]["method"] == "draft+prompt-lookup" and ar["stats"]["method"] == "ar"
    assert auto["token_ids"] == ar["token_ids"]


def test_generate_prompt_ids_equals_prompt_text(micro_export):
    from specdeploy.runtime.tokenizer import TextTokenizer

    tok = TextTokenizer(micro_export / "tokenizer")
    ids = ",".join(map(str, tok.encode("import os\n")))
    a = run_cli("generate", micro_export, "--prompt", "import os\n", "--max-new-tokens", "8", "--json")
    b = run_cli("generate", micro_export, "--prompt-ids", ids, "--max-new-tokens", "8", "--json")
    assert json.loads(a.stdout.splitlines()[-1])["token_ids"] == json.loads(b.stdout.splitlines()[-1])["token_ids"]


def test_generate_past_the_context_says_how_many_tokens_fit(micro_export):
    """The server refuses such a request (400); the CLI generates what fits and says so on stderr."""
    max_context = json.loads((micro_export / "manifest.json").read_text())["max_context"]
    ids = ",".join(["42"] * (max_context - 3))
    proc = run_cli("generate", micro_export, "--method", "ar", "--prompt-ids", ids, "--max-new-tokens", "10",
                   "--ignore-eos", "--json")
    assert proc.returncode == 0, proc.stderr
    assert f"leaves room for 3 new tokens after this {max_context - 3}-token prompt: at most 3, not 10" in proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert len(result["token_ids"]) == 3 and result["finish_reason"] == "length"


def test_streaming_text_to_stdout(micro_export):
    proc = run_cli("generate", micro_export, "--prompt", "def f(x):", "--max-new-tokens", "10", "--ignore-eos")
    assert proc.returncode == 0
    ref = run_cli("generate", micro_export, "--prompt", "def f(x):", "--max-new-tokens", "10", "--ignore-eos", "--json")
    assert proc.stdout.rstrip("\n") == json.loads(ref.stdout.splitlines()[-1])["text"].rstrip("\n")
    assert "acceptance length" in proc.stderr


def test_generate_logprobs_in_json_and_on_stderr(micro_export):
    args = ("--prompt", "def f(x):", "--max-new-tokens", "6", "--ignore-eos", "--logprobs", "2")
    result = json.loads(run_cli("generate", micro_export, *args, "--json").stdout.splitlines()[-1])
    assert [lp["token_id"] for lp in result["logprobs"]] == result["token_ids"]
    assert all(len(lp["top"]) == 2 and lp["logprob"] <= 0 for lp in result["logprobs"])
    shown = run_cli("generate", micro_export, *args)
    assert shown.returncode == 0
    rows = [line for line in shown.stderr.splitlines() if line.count("\t") == 2]
    assert [float(r.split("\t")[1]) for r in rows] == [round(lp["logprob"], 4) for lp in result["logprobs"]]
    bad = run_cli("generate", micro_export, "--prompt", "x", "--logprobs", "21")
    assert bad.returncode != 0 and "logprobs must be an integer from 0 to 20" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_check_export_dir_and_single_graph(micro_export):
    proc = run_cli("check", micro_export)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(re.findall(r"^ok +\S+$", proc.stdout, re.M)) >= 5, proc.stdout
    single = run_cli("check", micro_export / "draft_t1.onnx")
    assert single.returncode == 0 and "draft_t1" in single.stdout


def test_check_task_scores_a_given_text_file(micro_export, tmp_path):
    """--task-text: what --task-tokens can use of the file is read up front and scored."""
    text = tmp_path / "text.py"
    text.write_text("def add(a, b):\n    return a + b\n" * 200, encoding="utf-8")
    proc = run_cli("check", micro_export, "--task", "--task-text", text, "--task-tokens", "64")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"on {text}, up to 64 tokens" in proc.stdout, proc.stdout
    assert re.search(r"^ok +target .*\[6[0-3] positions\]$", proc.stdout, re.M), proc.stdout


def test_no_fused_export_runs_the_portable_graphs(micro_family, tmp_path):
    out = tmp_path / "portable"
    proc = run_cli("export", "--target", micro_family / "target", "--out", out, "--no-fused", "--no-check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["graphs"] and all("flavor" not in g for g in manifest["graphs"].values())
    gen = run_cli("generate", out, "--prompt", "def f(x):", "--max-new-tokens", "6", "--json")
    assert gen.returncode == 0, gen.stderr
    fused = run_cli("generate", out, "--graphs", "fused", "--prompt", "def f(x):", "--max-new-tokens", "6")
    assert fused.returncode == 2 and "fused graphs need" in fused.stderr and "Traceback" not in fused.stderr


def test_fp16_export_checks_and_generates(micro_family, micro_export, tmp_path):
    """A float16 export passes its accuracy check (every graph printed within its bound against torch
    float16) and decodes like the float32 export: drafting is lossless within it, and its greedy tokens
    are the float32 export's (the micro target has no near-tie in the first tokens of this prompt)."""
    out = tmp_path / "fp16"
    proc = run_cli("export", "--target", micro_family / "target", "--draft", micro_family / "draft", "--out", out,
                   "--dtype", "float16")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dtype"] == "float16" and manifest["check"] == "passed"
    assert all(g.get("flavor") != "fused" for g in manifest["graphs"].values())  # fused graphs are fp32-only
    report = proc.stdout + proc.stderr
    for name in manifest["graphs"]:
        assert re.search(rf"^ *ok +{re.escape(name)}: .*max\|err\| \S+ <= bound .*torch float16", report, re.M), \
            (name, report)
    assert not re.search(r"^ *FAIL", report, re.M), report

    def greedy(export, method: str) -> dict:
        gen = run_cli("generate", export, "--method", method, "--prompt", "def f(x):", "--max-new-tokens", "12",
                      "--ignore-eos", "--json")
        assert gen.returncode == 0, gen.stderr
        return json.loads(gen.stdout.splitlines()[-1])

    draft16, ar16, ar32 = greedy(out, "draft"), greedy(out, "ar"), greedy(micro_export, "ar")
    assert len(draft16["token_ids"]) == 12 and draft16["token_ids"] == ar16["token_ids"]
    assert draft16["stats"]["acceptance_length"] > 1  # the float16 draft model's tokens were accepted
    assert ar16["token_ids"][:8] == ar32["token_ids"][:8], (ar16["text"], ar32["text"])


def test_manifest_records_shapes_vocab_and_checksums(micro_export):
    manifest = json.loads((micro_export / "manifest.json").read_text())
    assert manifest["max_context"] >= 256
    verify = {params["k"] + 1 for m, params in manifest["methods"].items() if m in ("draft", "prompt-lookup")}
    target_sizes = {g["tokens"] for g in manifest["graphs"].values() if g["model"] == "target"}
    assert target_sizes >= {1, manifest["prefill_chunk"]} | verify
    assert manifest["models"]["target"]["vocab_size"] == manifest["models"]["draft"]["vocab_size"]
    assert manifest["tokenizer"]["eos_token_ids"]
    assert all(len(d) == 64 for d in manifest["files"].values())
    weights = [f for f in manifest["files"] if f.startswith("weights/")]
    # one weights file per model and graph flavor, however many static-T graphs share it (the target's
    # batched graph, for serve --batch, is a flavor of its own)
    assert sorted(weights) == ["weights/draft.bin", "weights/draft.fused.bin", "weights/target.bin",
                               "weights/target.fused.bin", "weights/target.fused_batched.bin"]
    flavors = {(g["model"], g.get("flavor", "portable")): set() for g in manifest["graphs"].values()}
    for g in manifest["graphs"].values():
        flavors[g["model"], g.get("flavor", "portable")].add(g["tokens"])
    assert flavors["target", "fused"] == flavors["target", "portable"]
    assert flavors["draft", "fused"] == flavors["draft", "portable"]


def test_demo_runs_every_method_in_one_process_with_ar_tokens(micro_export):
    """`specdeploy demo` (make export's demo): each of the export's methods, a line each, its greedy
    tokens compared with ar's; suffix's cross-request cache emptied between methods, so no method
    drafts an earlier method's answer."""
    from specdeploy.runtime.manifest import load_manifest

    methods = list(load_manifest(micro_export).methods)
    proc = run_cli("demo", micro_export, "--prompt", "def f(x):\n    return", "--max-new-tokens", "16")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["ar"] + [m for m in methods if m != "ar"]
    assert all(line.endswith("same tokens as ar") for line in lines), lines
    # the same method twice: the second run drafts as the first did, not from the first's answer
    twice = run_cli("demo", micro_export, "--prompt", "def g(y):\n    return", "--max-new-tokens", "24",
                    "--methods", "suffix,suffix")
    acceptance = [re.search(r"acceptance length ([\d.]+)", line).group(1) for line in twice.stdout.splitlines()]
    assert len(acceptance) == 3 and acceptance[1] == acceptance[2], twice.stdout
    typo = run_cli("demo", micro_export, "--prompt", "x", "--methods", "prompt-lookup,bogus")
    assert typo.returncode == 2 and typo.stdout == "", typo.stdout  # refused before ar runs
    choices = ", ".join(["auto", *methods])  # what this export can run, not every method specdeploy knows
    assert typo.stderr.strip().splitlines() == [f"error: unknown method 'bogus' (this export has: {choices})"]
    bad = run_cli("demo", micro_export, "--prompt", "x", "--system", "be brief")
    assert bad.returncode == 2 and bad.stderr.startswith("error: --system goes with --chat")


def test_ctrl_c_as_main_returns_is_no_traceback():
    """A Ctrl-C that landed in main's own restore of the default handler (signal.getsignal), after the command's
    output, escaped every handler: a traceback after the generation's line (seen in CI)."""
    import subprocess
    import sys

    from conftest import REPO

    script = (
        "import os, signal, sys\n"
        "import specdeploy.cli as cli\n"
        "real, calls = signal.getsignal, []\n"
        "def getsignal(sig):\n"
        "    calls.append(sig)\n"
        "    if len(calls) == 2:  # the restore in main's finally\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "    return real(sig)\n"
        "cli._main = lambda argv: 0\n"
        "signal.getsignal = getsignal\n"
        "sys.exit(cli.main([]))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr


def test_ctrl_c_at_any_point_of_start_up_is_one_line(micro_export):
    """SIGINT while main built its parser (importing the runtime) or while ONNX Runtime's extension
    initialised (an ImportError from the KeyboardInterrupt) printed a traceback; now `error: interrupted`
    and exit 130 wherever it lands, or exit 0 when the generation had finished. CPython ends a process
    whose KeyboardInterrupt went through an extension's import (or that gets SIGINT while finalising)
    by SIGINT itself: -2 here, exit status 130 to a shell, which is the same."""
    import signal
    import subprocess
    import time

    from conftest import REPO, SPECDEPLOY

    outcomes = []
    for delay in (0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5):
        proc = subprocess.Popen([*SPECDEPLOY, "generate", str(micro_export), "--prompt", "x", "--max-new-tokens", "64"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        assert "Traceback" not in err and proc.returncode in (0, 130, -signal.SIGINT), (delay, proc.returncode, err)
        if proc.returncode == 130:
            assert err.strip().splitlines()[-1] == "error: interrupted", err
        outcomes.append(proc.returncode)
    assert 130 in outcomes, outcomes  # the signal did land before the end


def test_a_full_disk_is_one_clear_error_not_an_internal_one(micro_export):
    """`specdeploy generate ... > /dev/full`: streamed text fails at its first flush, --json's line at
    the flush before exit (it was the interpreter's 'Exception ignored', exit 120); both are the
    environment's fault, said so in one line."""
    import subprocess

    from conftest import REPO, SPECDEPLOY

    for extra in ([], ["--json"]):
        with open("/dev/full", "w") as full:
            proc = subprocess.run([*SPECDEPLOY, "generate", str(micro_export), "--prompt", "def f(x):",
                                   "--max-new-tokens", "8", *extra], stdout=full, stderr=subprocess.PIPE, text=True,
                                  cwd=REPO, timeout=120)
        assert proc.returncode == 1, (extra, proc.returncode, proc.stderr)
        assert proc.stderr.strip().splitlines()[-1] == "error: could not write the output: No space left on device", \
            proc.stderr
        assert "internal error" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr


def test_triton_mode_refuses_the_http_servers_options_rather_than_ignoring_them(micro_export, tmp_path):
    """--batch, --replicas and a bad port were accepted and ignored under --triton-repo; a SPECDEPLOY_API_KEY in
    the environment was ignored without a word, leaving the ports open to a user who believed them guarded."""
    repo = tmp_path / "repo"
    for flags, words in ((["--batch", "2"], "--batch is not served under --triton-repo"),
                         (["--replicas", "2"], "--replicas is not served under --triton-repo"),
                         (["--port", "70000"], "--port must be in [1, 65535], got 70000")):
        proc = run_cli("serve", micro_export, "--triton-repo", repo, "--no-launch", *flags)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {words}"), proc.stderr
        assert not repo.exists()
    proc = run_cli("serve", micro_export, "--triton-repo", repo, "--no-launch", env={"SPECDEPLOY_API_KEY": "k"})
    assert proc.returncode == 0 and "SPECDEPLOY_API_KEY is set, but Triton has no API key" in proc.stderr
    assert (repo / micro_export.name / "config.pbtxt").exists()
