"""Bad arguments to the Python API and the CLI that need no export: one SpecDeployError, or one
`error:`/usage line and a non-zero exit, before anything loads (tests/test_errors.py and
tests/test_service.py have the ones on a real export)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli

from specdeploy.export.task_check import TEXT_BYTES_PER_TOKEN, read_task_text
from specdeploy.runtime import Service, SpecDeployError
from specdeploy.runtime.generate import checked_ids, checked_stop


def test_prompt_ids_must_be_ordered_and_finite():
    """A dict gave its keys, a set an arbitrary order, a generator could run for ever: refused."""
    for ids in ([1, 2, 3], (1, 2, 3), np.array([1, 2, 3]), np.array([1, 2, 3], np.int32), range(1, 4)):
        assert checked_ids(ids) == [1, 2, 3]
    for bad in ({1: 0, 2: 0}, {1, 2}, frozenset({1, 2}), {1: 0}.keys(), (t for t in [1, 2]), iter([1, 2]),
                np.array(5), None, 5, "12", b"12"):
        with pytest.raises(SpecDeployError, match="prompt_ids must be a list of token ids"):
            checked_ids(bad)


def test_stop_strings_must_be_utf8_text():
    assert checked_stop("ab") == ["ab"] and checked_stop(("a", "b")) == ["a", "b"] and checked_stop(None) == []
    for bad in ("\ud800", ["ok", "x\udcff"]):
        with pytest.raises(SpecDeployError, match="stop is not valid UTF-8 text"):
            checked_stop(bad)


@pytest.mark.parametrize("path", [None, 5, b"build/export", ["build/export"]])
def test_service_load_needs_a_path(path):
    with pytest.raises(SpecDeployError, match=r"the export path must be a path \(str or os.PathLike\), got "):
        Service.load(path)


def test_task_text_is_a_readable_regular_utf8_file(tmp_path):
    missing, folder, fifo = tmp_path / "missing.txt", tmp_path / "folder", tmp_path / "fifo"
    folder.mkdir()
    os.mkfifo(fifo)  # opening it for reading blocked until a writer came
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"ok\xff\xfe")
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n")
    for path, reason in ((missing, "no such file"), (folder, "is a directory"), (fifo, "not a regular file"),
                         (Path("/dev/urandom"), "not a regular file"), (binary, "is not UTF-8 text (byte 2: 0xff)"),
                         (empty, "is empty")):
        with pytest.raises(SpecDeployError, match=f"--task-text {re.escape(str(path))}.*{re.escape(reason)}"):
            read_task_text(path, 512)


def test_task_text_reads_only_what_the_tokens_can_use(tmp_path):
    """A big file is read up to a bound set by --task-tokens; a character the bound cuts is dropped."""
    path = tmp_path / "big.txt"
    path.write_text("a" + "é" * (1 << 20), encoding="utf-8")  # 2 MiB of two-byte characters after one byte
    # the bound is even: after the "a", its last byte is the first half of an "é"
    assert read_task_text(path, 3) == "a" + "é" * ((3 * TEXT_BYTES_PER_TOKEN - 1) // 2)
    assert read_task_text(path, 1 << 30) == "a" + "é" * (1 << 20)  # past the file's end: all of it


def _usage_error(proc, *needles):
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert all(n in last for n in needles), last
    return last


@pytest.mark.parametrize("tokens", ["0", "-1", "x"])
def test_check_task_tokens_must_be_at_least_one(tmp_path, tokens):
    proc = run_cli("check", tmp_path, f"--task-tokens={tokens}", timeout=60)
    _usage_error(proc, "argument --task-tokens: expected an integer >= 1")


def test_engines_checks_the_export_before_saying_tensorrt_is_skipped(tmp_path):
    """It printed `engines: skipped, TensorRT is not installed` and exited 0 for a path that is no export."""
    for flags in ([], ["--no-rebuild"], ["--rebuild"]):
        proc = run_cli("engines", tmp_path / "nowhere", *flags, timeout=60)
        assert "skipped" not in proc.stdout, proc.stdout
        last = _usage_error(proc, "export directory not found", "nowhere")
        assert last.startswith("error: "), last
    proc = run_cli("engines", tmp_path, timeout=60)
    _usage_error(proc, "no manifest.json in")


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "1e300", "lots"])
def test_engines_workspace_must_be_a_positive_number(tmp_path, value):
    proc = run_cli("engines", tmp_path, f"--workspace-gb={value}", timeout=60)
    _usage_error(proc, "argument --workspace-gb: expected a number of GiB above 0")
