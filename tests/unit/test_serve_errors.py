"""What the server tells a client (serve/errors.py): error bodies never carry server paths."""

from __future__ import annotations

import json

from specdeploy.serve.errors import error_body, strip_paths


def test_server_paths_never_reach_a_client(tmp_path):
    (tmp_path / "tokenizer").mkdir()
    message = f"tokenizer file missing: {tmp_path}/tokenizer/tokenizer.json (see {tmp_path}/tokenizer)"
    assert strip_paths(message) == "tokenizer file missing: tokenizer.json (see tokenizer)"
    assert strip_paths("use /v1/completions instead") == "use /v1/completions instead"
    # an echoed URL keeps its scheme and host (its "//" is not a path, though "/" is a directory)
    for url in ("http://evil", "https://example.com/tmp/x", "file:///etc/passwd"):
        assert strip_paths(f"web origin '{url}' is not allowed") == f"web origin '{url}' is not allowed"
    assert str(tmp_path) not in json.dumps(error_body(500, message))
