"""`specdeploy` errors that need no export: one `error:` line naming the problem, never a traceback
(tests/test_errors.py has the ones on real exports and models)."""

from __future__ import annotations

from conftest import run_cli


def test_missing_export_dir(tmp_path):
    proc = run_cli("generate", tmp_path / "nowhere", "--prompt", "def f():", "--max-new-tokens", "4")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "not found" in last and "nowhere" in last, proc.stderr
