"""runtime/atomic_write.py: a file replaced whole or not at all."""

from __future__ import annotations

import subprocess
import sys


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path):
    """tune-tree's and bench's outputs were written in place: a write cut short by a full disk or a file-size
    limit truncated the previous run's file (a tree left as 1,024 bytes of invalid JSON)."""
    from specdeploy.runtime.atomic_write import replace_text

    old = tmp_path / "tree.json"
    old.write_text('{"paths": [[0]]}\n')
    script = ("import resource, signal, sys\n"
              "from specdeploy.runtime.atomic_write import replace_text\n"
              "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead\n"
              "resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))\n"
              "try:\n"
              f"    replace_text({str(old)!r}, 'x' * 5000)\n"
              "except OSError as exc:\n"
              "    sys.exit(3)\n")
    assert subprocess.run([sys.executable, "-c", script], timeout=60).returncode == 3
    assert old.read_text() == '{"paths": [[0]]}\n' and sorted(p.name for p in tmp_path.iterdir()) == ["tree.json"]
    replace_text(old, "new\n")
    assert old.read_text() == "new\n" and sorted(p.name for p in tmp_path.iterdir()) == ["tree.json"]
