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
