"""`specdeploy` errors that need no export: one `error:` line naming the problem, never a traceback
(tests/test_errors.py has the ones on real exports and models)."""

from __future__ import annotations

import os

import pytest
from conftest import run_cli


def test_missing_export_dir(tmp_path):
    proc = run_cli("generate", tmp_path / "nowhere", "--prompt", "def f():", "--max-new-tokens", "4")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "not found" in last and "nowhere" in last, proc.stderr


def test_serve_on_a_port_it_cannot_listen_on(tmp_path):
    """One `error:` line before anything says it serves (the socket is bound before the export loads)."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        for host, reason in (("127.0.0.1", "address already in use"), ("192.0.2.1", "cannot listen on 192.0.2.1")):
            proc = run_cli("serve", tmp_path / "never-loaded", "--host", host, "--port", port, timeout=120)
            assert proc.returncode == 2 and "serving" not in proc.stdout, proc.stdout + proc.stderr
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"error: cannot listen on {host}:{port}: "), lines
            assert reason in lines[0]


def test_tune_tree_never_overwrites_an_input(tmp_path):
    """--out is checked before the export loads and the calibration runs: an existing file that
    tune-tree did not write (the prompts, an export's manifest) is refused and left as it was."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text('["def f():"]')
    (tmp_path / "trees").mkdir()
    refusals = ((prompts, "is not a tree written by `specdeploy tune-tree`"), (tmp_path / "trees", "is a directory"))
    for out, reason in refusals:
        proc = run_cli("tune-tree", tmp_path / "never-loaded", "--prompts", prompts, "--out", out)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: --out {out}") and reason in lines[0], lines
    assert prompts.read_text() == '["def f():"]'


def test_threads_out_of_range_is_refused(tmp_path):
    """--threads 99999 hung (ONNX Runtime creating and spinning that many threads); 0 and negatives were
    taken silently. Refused by the parser, before anything loads."""
    for command in (["generate", tmp_path / "never-loaded", "--prompt", "x"], ["serve", tmp_path / "never-loaded"]):
        for threads in ("0", "-2", "99999"):
            proc = run_cli(*command, f"--threads={threads}", timeout=60)
            assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
            assert proc.stderr.strip().splitlines()[-1].endswith(
                f"argument --threads: threads must be an integer from 1 to {8 * (os.cpu_count() or 1)} (8 per "
                f"logical CPU of this machine), got {threads}"), proc.stderr


def test_threads_are_checked_where_the_runtime_takes_them():
    """The embedding API and the bench reach ONNX Runtime's pools without the CLI's parser."""
    from specdeploy.runtime.backends.ort import check_threads, session_options
    from specdeploy.runtime.errors import SpecDeployError

    assert check_threads(None) is None and check_threads(2) == 2
    for bad in (0, -1, 10**6, 2.0, True, "2"):
        with pytest.raises(SpecDeployError, match="threads must be an integer from 1 to"):
            session_options(bad)


def test_a_bad_serve_limit_names_the_option_it_came_from(tmp_path):
    """The limits are checked before the export loads, and named as `serve` spells them (the message named
    template-timeout-s, which no option is called), with the embedding API's field beside it."""
    proc = run_cli("serve", tmp_path / "never-loaded", "--template-timeout", "0", timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: --template-timeout (template_timeout_s) must be > 0 and at most 86400 seconds, got 0.0"], proc.stderr


@pytest.mark.parametrize("option, value", [("--body-timeout", "1e300"), ("--header-timeout", "inf"),
                                           ("--header-timeout", "nan"), ("--request-timeout", "-1")])
def test_serve_timeouts_are_finite(tmp_path, option, value):
    """A timeout past a day (1e300, inf: the event loop's timers overflow) or not a positive number is refused."""
    proc = run_cli("serve", tmp_path / "never-loaded", option, value, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "must be > 0 and at most 86400 seconds" in proc.stderr and option in proc.stderr, proc.stderr


def test_every_serve_limit_is_named_by_an_option_serve_has():
    """A limit's error names `serve`'s option for it; a limit with none (API_ONLY) is named by its field."""
    from dataclasses import fields

    from specdeploy.cli import build_parser
    from specdeploy.serve.limits import API_ONLY, ServeLimits, _option

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    options = {o for action in serve._actions for o in action.option_strings}
    for field in fields(ServeLimits):
        named = _option(field.name).split()[0]
        assert named == field.name if field.name in API_ONLY else named in options, (field.name, named)


def _one_error_line(proc, start: str, reason: str) -> None:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {start}") and reason in lines[0], lines


def test_bench_outputs_are_checked_before_it_runs_and_never_overwrite_an_input(tmp_path):
    """--json/--plot/--markdown overwrote any file (its own --prompts file, the measured export's
    manifest.json), and a directory failed only after the whole run. Now each is refused before the export
    is read (none exists here), and every file is left as it was."""
    export = tmp_path / "export"
    export.mkdir()
    (export / "manifest.json").write_text('{"format": 1}')
    prompts = tmp_path / "code.jsonl"
    prompts.write_text('{"prompt": "def f():"}\n')
    foreign = tmp_path / "notes.md"
    foreign.write_text("# my notes\n")
    (tmp_path / "out").mkdir()
    before = {p: p.read_bytes() for p in (export / "manifest.json", prompts, foreign)}
    refusals = [(["--json", prompts], f"--json {prompts}", "is one of this run's inputs"),
                (["--markdown", export / "manifest.json"], f"--markdown {export / 'manifest.json'}",
                 f"is inside the export {export} being measured"),
                (["--plot", export / "bench.png"], "--plot", "is inside the export"),  # a new file there too
                (["--plot", tmp_path / "out"], f"--plot {tmp_path / 'out'}", "is a directory"),
                (["--markdown", foreign], f"--markdown {foreign}", "exists and was not written by `specdeploy bench`"),
                (["--json", tmp_path / "r.json", "--markdown", tmp_path / "r.json"], "--markdown",
                 "--json names the same file"),
                (["--json", foreign / "r.json"], f"--json {foreign / 'r.json'}", "is not a directory")]
    for flags, start, reason in refusals:
        proc = run_cli("bench", export, "--prompts", prompts, "--peers", "none", *flags, timeout=60)
        _one_error_line(proc, start, reason)
    assert {p: p.read_bytes() for p in before} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["code.jsonl", "export", "notes.md", "out"]


def test_make_bench_may_rewrite_its_committed_outputs(monkeypatch):
    """`make bench` passes the same --json/--plot/--markdown every run: the files an earlier run wrote
    (BENCHMARKS.md and docs/bench.png are committed, the plot with its mark) may be replaced; a file of
    the user's may not."""
    import re
    import shlex
    from pathlib import Path

    from specdeploy.bench.report import check_outputs
    from specdeploy.runtime.errors import SpecDeployError

    repo = Path(__file__).resolve().parents[2]
    recipe = re.search(r"^bench:.*\n((?:\t.*\n)+)", (repo / "Makefile").read_text(), re.M).group(1)
    words = shlex.split(recipe.replace("\\\n", " "))
    outputs = {flag: Path(words[words.index(flag) + 1]) for flag in ("--json", "--plot", "--markdown")}
    assert outputs == {"--json": Path("bench_out/bench.json"), "--plot": Path("docs/bench.png"),
                       "--markdown": Path("BENCHMARKS.md")}
    monkeypatch.chdir(repo)  # make runs there: the paths are relative to it
    assert outputs["--markdown"].is_file() and outputs["--plot"].is_file()
    check_outputs(outputs, input_dirs=[Path("build/export/default")])
    check_outputs({"--plot": outputs["--plot"]})
    with pytest.raises(SpecDeployError, match="--plot README.md exists and was not written by"):
        check_outputs({"--plot": Path("README.md")})
    with pytest.raises(SpecDeployError, match="--markdown README.md exists and was not written by"):
        check_outputs({**outputs, "--markdown": Path("README.md")})


def test_an_empty_api_key_is_refused(tmp_path):
    """`--api-key ""` served with no key at all (an unset $SPECDEPLOY_API_KEY still means none)."""
    proc = run_cli("serve", tmp_path / "never-loaded", "--api-key", " ", timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: --api-key is empty: give a key, or leave the option out to serve without one"], proc.stderr


@pytest.mark.parametrize("origin", ["not a url", "https://app.example.com/path", "app.example.com", "https://"])
def test_allowed_origins_are_web_origins(tmp_path, origin):
    """An origin no browser can send (a path, no scheme) was accepted and then matched nothing."""
    proc = run_cli("serve", tmp_path / "never-loaded", "--allowed-origins", origin, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "is not a web origin" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_web_origins_pass():
    from specdeploy.serve.main import ORIGIN

    for origin in ("https://app.example.com", "http://localhost:3000", "http://127.0.0.1:8080", "http://[::1]:5173",
                   "chrome-extension://abcdef"):
        assert ORIGIN.fullmatch(origin), origin
